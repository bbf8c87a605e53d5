"""Requests of dropped sockets, parked for a resume.

When a socket drops, its unfinished requests are parked in the engine (out of the batch,
blocks freed within a step, tokens and sampler state kept) for `resume_grace` seconds. A
new socket of the same key that sends `resume {id, after_seq, session_id}` takes one
back (`reattach`); the rest expire and are aborted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from engine import AsyncEngine
from service.config import Limits
from service.delivery import Live
from service.metrics import Metrics
from service.protocol import ProtocolError


@dataclass
class Detached:
    """The unfinished requests of one dropped socket."""

    key: str | None  # its API key: only the same key may resume them
    lives: dict[str, Live] = field(default_factory=dict)  # by client id
    timer: asyncio.TimerHandle | None = None


class ParkedRequests:
    def __init__(self, limits: Limits, engine: AsyncEngine, metrics: Metrics,
                 release: Callable[[Live], None]) -> None:
        """`release(live)`: the gateway's end-of-request bookkeeping for an expired one."""
        self.limits, self.engine, self.metrics, self._release = limits, engine, metrics, release
        self.detached: dict[str, Detached] = {}  # by the dropped socket's session id
        self.count = 0  # requests parked now
        self.by_key: dict[str | None, int] = {}  # of those, by API key

    def detach(self, session_id: str, key: str | None, lives: dict[str, Live],
               accepting: bool) -> list[Live]:
        """Park a dropped socket's requests for `resume_grace` seconds. Returns the ones
        not kept (resume off, shutting down, or over max_detached): the caller aborts
        those."""
        lim = self.limits
        room = lim.max_detached - self.count
        if key is not None:  # the space is shared: no key takes more than its part
            room = min(room, lim.max_detached_per_key - self.by_key.get(key, 0))
        if lim.resume_grace <= 0 or not accepting or room <= 0:
            self.metrics.resumes.labels("refused").inc(len(lives))
            return list(lives.values())
        keep = dict(list(lives.items())[:room])
        for live in keep.values():
            if not live.adm.stream.finished:
                self.engine.park(live.adm.stream.request_id)
        d = Detached(key, keep)
        d.timer = asyncio.get_running_loop().call_later(lim.resume_grace, self._expire,
                                                        session_id)
        self.detached[session_id] = d
        self._count(len(keep), key)
        self.metrics.resumes.labels("parked").inc(len(keep))
        return [live for rid, live in lives.items() if rid not in keep]

    def reattach(self, session_id: str, key: str | None, rid: str, after_seq: int) -> Live:
        """Hand a parked request to the socket that resumes it (and requeue it), or
        raise invalid_request."""
        d = self.detached.get(session_id)
        live = d.lives.get(rid) if d is not None and d.key == key else None
        if d is None or live is None:
            raise ProtocolError("invalid_request", f"nothing to resume for {rid!r} in that "
                                "session: unknown, finished and delivered, or expired", rid)
        if after_seq > live.seq:
            raise ProtocolError("invalid_request", f"after_seq {after_seq} is past the last "
                                f"delta sent ({live.seq})", rid)
        del d.lives[rid]
        if not d.lives:
            self._drop(session_id)
        self._count(-1, key)
        self.metrics.resumes.labels("resumed").inc()
        if not live.adm.stream.finished:
            self.engine.unpark(live.adm.stream.request_id)
        return live

    def expire_all(self) -> None:
        """Shutdown: nobody will resume now."""
        for sid in list(self.detached):
            self._expire(sid)

    def _expire(self, session_id: str) -> None:
        d = self._drop(session_id)
        if d is None:
            return
        self._count(-len(d.lives), d.key)
        self.metrics.resumes.labels("expired").inc(len(d.lives))
        for live in d.lives.values():
            if not live.adm.stream.finished:
                self.engine.abort(live.adm.stream.request_id)
            if not live.ended:
                self._release(live)

    def _drop(self, session_id: str) -> Detached | None:
        d = self.detached.pop(session_id, None)
        if d is not None and d.timer is not None:
            d.timer.cancel()
        return d

    def _count(self, n: int, key: str | None) -> None:
        self.count += n
        left = self.by_key.get(key, 0) + n
        if left:
            self.by_key[key] = left
        else:
            self.by_key.pop(key, None)
        self.metrics.detached.set(self.count)

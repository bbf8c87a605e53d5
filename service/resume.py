"""Resume: the requests of dropped sockets, parked, and the session's side of a resume.

When a socket drops, its unfinished requests are parked in the engine (out of the batch,
blocks freed within a step, tokens and sampler state kept) for `resume_grace` seconds
(`ParkedRequests.park`). A new socket of the same key that sends `resume {id, after_seq,
session_id}` takes one back (`ParkedRequests.take`, by its `Resumer`); the rest expire
and are aborted. A resume this server holds nothing for, but that carries its request,
is continued: started again from the token ids its client received."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from engine import AsyncEngine
from service.config import Limits
from service.delivery import Live, replay
from service.metrics import Metrics
from service.protocol import ProtocolError, Resume, parse_generate, parse_resume

if TYPE_CHECKING:
    from service.session import Session

# How long a resume naming a session whose socket is still open here waits for it to close
# (a client that reconnects at once can be ahead of the server noticing the drop).
RESUME_WAIT_SECONDS = 5.0


@dataclass
class ParkedSocket:
    """The unfinished requests of one dropped socket."""

    key: str | None  # its API key: only the same key may resume them
    lives: dict[str, Live] = field(default_factory=dict)  # by client id
    timer: asyncio.TimerHandle | None = None


class ParkedRequests:
    def __init__(self, limits: Limits, engine: AsyncEngine, metrics: Metrics,
                 release: Callable[[Live], None]) -> None:
        """`release(live)`: the gateway's end-of-request bookkeeping for an expired one."""
        self.limits, self.engine, self.metrics, self._release = limits, engine, metrics, release
        self.sockets: dict[str, ParkedSocket] = {}  # by the dropped socket's session id
        self.count = 0  # requests parked now
        self.by_key: dict[str | None, int] = {}  # of those, by API key

    def park(self, session_id: str, key: str | None, lives: dict[str, Live],
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
            if not live.stream.finished:
                self.engine.park(live.stream.request_id)
        d = ParkedSocket(key, keep)
        d.timer = asyncio.get_running_loop().call_later(lim.resume_grace, self._expire,
                                                        session_id)
        self.sockets[session_id] = d
        self._count(len(keep), key)
        self.metrics.resumes.labels("parked").inc(len(keep))
        return [live for rid, live in lives.items() if rid not in keep]

    def take(self, session_id: str, key: str | None, rid: str, after_seq: int) -> Live:
        """Hand a parked request to the socket that resumes it (and requeue it), or
        raise invalid_request."""
        d = self.sockets.get(session_id)
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
        if not live.stream.finished:
            self.engine.unpark(live.stream.request_id)
        return live

    def expire_all(self) -> None:
        """Shutdown: nobody will resume now."""
        for sid in list(self.sockets):
            self._expire(sid)

    def _expire(self, session_id: str) -> None:
        d = self._drop(session_id)
        if d is None:
            return
        self._count(-len(d.lives), d.key)
        self.metrics.resumes.labels("expired").inc(len(d.lives))
        for live in d.lives.values():
            if not live.stream.finished:
                self.engine.abort(live.stream.request_id)
            if not live.ended:
                self._release(live)

    def _drop(self, session_id: str) -> ParkedSocket | None:
        d = self.sockets.pop(session_id, None)
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


class Resumer:
    """One socket's `resume` messages: take a parked request back (replaying what its
    client missed), wait for the old socket when the client is ahead of the server
    noticing its drop, or continue a request this server does not hold."""

    def __init__(self, session: Session) -> None:
        self.session, self.gw = session, session.gw
        self.waiting: set[asyncio.Task[None]] = set()  # resumes waiting for a socket to close

    def resume(self, msg: dict[str, Any]) -> None:
        s = self.session
        r = parse_resume(msg)
        s.admission.check_room(r.id)
        old = self.gw.open_session(r.session_id)
        if old is not None and old is not s and old.principal.key == s.principal.key:
            # The client reconnected before this server saw its old socket close (its
            # requests are not parked yet): the resume waits for that close.
            task = asyncio.create_task(self._after_close(old, r))
            self.waiting.add(task)
            task.add_done_callback(self.waiting.discard)
            return
        self._take(r)

    async def _after_close(self, old: Session, r: Resume) -> None:
        s = self.session
        try:
            try:
                await asyncio.wait_for(old.closed.wait(), RESUME_WAIT_SECONDS)
            except asyncio.TimeoutError:
                raise ProtocolError("invalid_request", f"session {r.session_id!r} is still open "
                                    "on another socket: resume it after that one closes",
                                    r.id) from None
            s.check_open()
            s.admission.check_room(r.id)
            self._take(r)
        except ProtocolError as e:
            s.error(e)

    def _take(self, r: Resume) -> None:
        s = self.session
        try:
            live = self.gw.parked.take(r.session_id, s.principal.key, r.id, r.after_seq)
        except ProtocolError:
            if r.request is None:
                raise
            self._continue(r)  # not held here: continue it from what the client has
            return
        s.frame({"type": "resumed", "id": r.id, "after_seq": r.after_seq})
        for frame in replay(live, r.after_seq):
            s.frame(frame)
        if live.ended:
            for frame in live.tail:
                s.frame(frame)
            return
        s.streams.live[r.id] = live
        live.stream.listener = partial(s.sender.notify, live)
        s.sender.notify(live)  # whatever arrived while it was parked

    def _continue(self, r: Resume) -> None:
        """A resume this server cannot take back, carrying its request: a new request
        under this socket's key, continuing from the token ids the client received
        (recomputed with the prompt, mostly prefix hits, then sampled as if never
        interrupted: greedy and seeded output are exactly the uninterrupted run's)."""
        assert r.request is not None
        s = self.session
        body = dict(r.request, id=r.id)  # the generate it was (a message, not a frame)
        g = parse_generate(body, self.gw.sampling_defaults)
        if g.tools is not None:
            raise ProtocolError("invalid_request", "a request with tools can only be resumed "
                                "on the server that ran it", r.id)
        if g.params.n != 1:
            raise ProtocolError("invalid_request", "a request with n > 1 can only be resumed "
                                "on the server that ran it", r.id)
        if r.after_seq > len(r.token_ids) + 1:  # a delta carries a token, but for a last
            raise ProtocolError("invalid_request", f"after_seq {r.after_seq} is more deltas "
                                f"than the {len(r.token_ids)} token_ids given could fill", r.id)
        s.admission.admit(g, r)

"""A socket's requests as plain data: the ones in flight (`live`), the ones ended whose
done frame is not written yet (`unsent`), and the ones whose done was written lately
(`recent`); the frames each stream has produced since its last pull, its end (errors,
then done), and which requests a dropped socket keeps resumable. No socket here: the
Session and its Sender call in, and tests/test_session_unit.py drives it with fakes.

Why `recent`: a frame written to the transport is not received, and a connection that
dies takes what was in flight with it. So a request whose done was written in the last
RECENT_DONE_SECONDS (at most RECENT_DONES per socket) is kept resumable too."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from service.delivery import Live, done_frame, step_frames
from service.protocol import ProtocolError

if TYPE_CHECKING:
    from service.gateway import Gateway

# How long, and for how many requests, a socket keeps its ended requests resumable after
# their done was written (see the module docstring).
RECENT_DONE_SECONDS = 10.0
RECENT_DONES = 64


def counted(gw: Gateway, e: ProtocolError) -> dict[str, Any]:
    """An error's frame, counted in the errors metric."""
    gw.metrics.errors.labels(e.code).inc()
    return e.frame()


class Streams:
    """The requests of one socket, by client id (see the module docstring)."""

    clock = staticmethod(time.monotonic)  # (tests replace it on an instance)

    def __init__(self, gateway: Gateway) -> None:
        self.gw, self.engine = gateway, gateway.engine
        self.live: dict[str, Live] = {}
        self.unsent: dict[str, Live] = {}  # ended, but the done frame is not written yet
        # ended, done written lately (by when): kept resumable after a drop too
        self.recent: dict[str, tuple[Live, float]] = {}
        self._log_tokens = gateway.log_tokens  # bound once: called per stream per step

    def pull(self, live: Live) -> list[dict[str, Any]]:
        """Frames for everything the stream has produced since the last pull."""
        frames = step_frames(live, self._log_tokens)
        if live.stream.finished:
            frames += self._end(live)
        return frames

    def _end(self, live: Live) -> list[dict[str, Any]]:
        """The stream has finished: its error (if any) and done frames, which wait in
        `unsent` until written."""
        last = live.last
        reason = (last.finish_reason if last else None) or "error"
        frames = []
        if live.failure is not None:
            reason = "error"
            frames.append(counted(self.gw, live.failure))
        elif reason == "error":  # the engine failed this request (its thread died)
            frames.append(counted(self.gw, ProtocolError(
                "internal_error", (last.error if last else None) or "engine failure", live.rid)))
        self.release(live, reason)
        frames.append(done_frame(live, reason))
        live.ended, live.tail = True, frames
        self.unsent[live.rid] = live
        return frames

    def release(self, live: Live, reason: str) -> None:
        """The request leaves this socket: no more outputs are pulled for it, and the
        gateway's end-of-request bookkeeping runs (once)."""
        live.stream.listener = None
        if self.live.pop(live.rid, None) is not None:
            self.gw.release(live.adm, reason)

    def delivered(self, live: Live) -> None:
        """Every frame pulled for the stream is written: an ended one moves from
        `unsent` to `recent`."""
        if live.ended and self.unsent.get(live.rid) is live:
            del self.unsent[live.rid]  # its done is written to the transport
            self.recent.pop(live.rid, None)
            self.recent[live.rid] = (live, self.clock())
            if len(self.recent) > RECENT_DONES:
                del self.recent[next(iter(self.recent))]
            self.expire_recent()

    def expire_recent(self) -> None:
        """Forget the ends written over RECENT_DONE_SECONDS ago (oldest first: `recent` is
        in write order). Kept past that they served no resume and held every request's
        output (64 a socket: a soak's heap grew with them)."""
        recent, since = self.recent, self.clock() - RECENT_DONE_SECONDS
        while recent:
            rid = next(iter(recent))
            if recent[rid][1] >= since:
                break
            del recent[rid]

    def fail_all(self, failure: ProtocolError) -> None:
        """Abort every request in flight that has no failure yet, reporting `failure`
        (with its id) ahead of its done."""
        for live in self.live.values():
            if live.failure is None:
                live.failure = ProtocolError(failure.code, failure.message, live.rid)
                self.engine.abort(live.stream.request_id)

    def close(self) -> None:
        """The socket is closing: no stream pulls or queues again."""
        for live in self.live.values():
            live.stream.listener = None
            live.queued = False

    def resumable(self) -> dict[str, Live]:
        """What a dropped socket keeps for a resume: the unfinished first (they go first
        when the parking space runs out), then the unsent, then the lately written."""
        keep = dict(self.live)
        for rid, live in self.unsent.items():
            keep.setdefault(rid, live)
        since = self.clock() - RECENT_DONE_SECONDS
        for rid, (live, when) in self.recent.items():
            if when >= since:
                keep.setdefault(rid, live)
        return keep

    def abort(self, lives: list[Live]) -> None:
        """End these requests here (the unended ones: aborted, then released)."""
        for live in lives:
            if not live.ended:
                self.engine.abort(live.stream.request_id)
                self.release(live, "abort")

    def clear(self) -> None:
        self.live.clear()
        self.unsent.clear()
        self.recent.clear()

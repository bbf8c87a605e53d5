"""The one writer of a WebSocket: every frame a session sends goes through its Sender,
in order.

Two paths. The engine's per-step dispatch (on the loop thread) calls `notify` for a
stream with output: when nothing is queued or in flight on this socket, its frames are
written right there, synchronously (`try_write` on the server's transport when the
server offers it, else the ASGI send, run up to its first suspension), so each socket
costs one pass through the send path and no task wake-up. Otherwise, or if a send does
suspend (flow control), the frames wait in the send queue for the writer task.

The send queue holds control frames and at most one "pull" marker per stream (the
stream's steps that queued up meanwhile are merged into one delta when it is pulled,
never dropped), so it stays small. Past `limits.send_queue` entries the session stops
reading the client (`drained`) until the writer has caught up."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from service.config import Limits
from service.delivery import Live
from service.protocol import Codec
from service.transport import SENT, asgi_send_of, drive_send, frame_writer_of, start_send

_CLOSE = object()  # send-queue sentinel: the writer stops
_GONE = (WebSocketDisconnect, RuntimeError, OSError)  # what a send to a closed socket raises


@dataclass(eq=False)
class _SuspendedSend:
    """A frame whose send suspended in dispatch (flow control), and the frames after it."""

    coro: Any
    awaiting: Any
    msg: dict[str, Any]
    rest: list[dict[str, Any]]
    live: Live


class Sender:
    def __init__(self, ws: WebSocket, codec: Codec, limits: Limits,
                 pull: Callable[[Live], list[dict[str, Any]]],
                 delivered: Callable[[Live], None],
                 log_delivery: Callable[[float], None]) -> None:
        """`pull(live)`: the stream's frames since its last pull; `delivered(live)`:
        called once they are all written; `log_delivery(seconds)`: sampled-to-written
        time of each delta."""
        self.codec, self.limits = codec, limits
        self._pull, self._delivered, self._log_delivery = pull, delivered, log_delivery
        # frames (dicts), Live markers (pull that stream now), or _CLOSE; in send order
        self.queue: deque[Any] = deque()
        self._wake = asyncio.Event()
        self.drained = asyncio.Event()  # the reader waits on it while the queue is over limit
        self.drained.set()
        self.sending_since: float | None = None  # a send has been blocked since (watchdog)
        self._busy = False  # the writer task has frames to send or a send in flight
        self.dead = False  # a send failed: the socket is gone
        self._asgi_send = asgi_send_of(ws)
        self._write_frame = frame_writer_of(ws)

    # -- queueing ------------------------------------------------------------------------------

    def frame(self, msg: dict[str, Any]) -> None:
        """Queue a control frame (ready, queued, error, pong...)."""
        self.queue.append(msg)
        self._wake.set()
        if len(self.queue) > self.limits.send_queue:
            self.drained.clear()  # stop reading this client until it reads its frames

    def notify(self, live: Live) -> None:
        """A stream has output: write its frames now if the socket is idle, else queue
        one pull marker for it (see the module docstring)."""
        if live.queued:
            return
        if self.queue or self._busy or self.dead:
            live.queued = True
            self.queue.append(live)
            self._wake.set()
            return
        frames = self._pull(live)
        for i, msg in enumerate(frames):
            sent = self._send_now(msg, live)
            if sent is True:
                continue
            if sent is not None:  # suspended mid-send: the writer finishes it, then the rest
                self._busy = True
                self.queue.append(_SuspendedSend(sent[0], sent[1], msg, frames[i + 1:], live))
                self._wake.set()
            return
        self._delivered(live)

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing being written."""
        return not self.queue and not self._busy

    def close(self) -> None:
        """Let the writer task end once it reaches this (after `discard`, at once)."""
        self.queue.append(_CLOSE)
        self._wake.set()

    def discard(self) -> None:
        """Forget queued frames and markers (a dead socket)."""
        self.queue.clear()

    # -- writing --------------------------------------------------------------------------------

    def try_write(self, data: bytes | str) -> bool:
        """Write an encoded frame straight to the server's transport, if it lets us."""
        return self._write_frame is not None and self._write_frame(data)

    def _encode(self, msg: dict[str, Any], live: Live | None) -> bytes | str | None:
        """Encode a frame and write it directly if possible (None: written); else the
        encoded frame, for the ASGI send."""
        data = self.codec.encode(msg)
        if self.try_write(data):
            self._written(msg, live)
            return None
        return data

    def _send_now(self, msg: dict[str, Any], live: Live | None) -> Any:
        """Write one frame, or run its ASGI send up to its first suspension. True:
        written; None: the socket is gone; else (coroutine, what it awaits) to finish
        later."""
        data = self._encode(msg, live)
        if data is None:
            return True
        coro = self._asgi_send(_message(data))
        try:
            awaiting = start_send(coro)
        except _GONE:
            self.dead = True  # the reader sees the disconnect and parks or aborts everything
            return None
        if awaiting is SENT:
            self._written(msg, live)
            return True
        return coro, awaiting

    def _written(self, msg: dict[str, Any], live: Live | None) -> None:
        if live is not None and msg["type"] == "delta":
            self._log_delivery(time.monotonic() - live.adm.stream.sampled_at)

    async def run(self) -> None:
        """The writer task: sends what `notify` and `frame` queued, in order."""
        q, wake = self.queue, self._wake
        while True:
            while not q:
                self._busy = False
                wake.clear()
                await wake.wait()
            self._busy = True
            item = q.popleft()
            if item is _CLOSE:
                return
            if not self.drained.is_set() and len(q) <= self.limits.send_queue // 2:
                self.drained.set()
            if isinstance(item, _SuspendedSend):
                if not await self._finish(item.coro, item.awaiting):
                    return
                self._written(item.msg, item.live)
                frames, live = item.rest, item.live
            elif isinstance(item, Live):
                frames, live = self._pull(item), item
            else:
                frames, live = [item], None
            for msg in frames:
                if not await self._send(msg, live):
                    return
            if live is not None:
                self._delivered(live)

    async def _send(self, msg: dict[str, Any], live: Live | None) -> bool:
        data = self._encode(msg, live)
        if data is None:
            return True
        self.sending_since = time.monotonic()
        try:
            await self._asgi_send(_message(data))
        except _GONE:
            self.dead = True
            return False  # gone: the reader sees the disconnect and parks or aborts everything
        finally:
            self.sending_since = None
        self._written(msg, live)
        return True

    async def _finish(self, coro: Any, awaiting: Any) -> bool:
        """Drive a send that suspended in _send_now to its end."""
        self.sending_since = time.monotonic()
        try:
            await drive_send(coro, awaiting)
        except _GONE:
            self.dead = True
            return False
        finally:
            self.sending_since = None
        return True


def _message(data: bytes | str) -> dict[str, Any]:
    if isinstance(data, bytes):
        return {"type": "websocket.send", "bytes": data}
    return {"type": "websocket.send", "text": data}

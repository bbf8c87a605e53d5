"""The one writer of a WebSocket: every frame a session sends goes through its Sender,
in order, to the socket's FrameSink (service/sink.py).

Two paths. The engine's per-step dispatch (on the loop thread) calls `notify` for a
stream with output: when nothing is queued on this socket and its sink is OPEN, the
stream's frames are written right there (`FrameSink.try_write`), so each socket costs
one pass through the send path and no task wake-up. Otherwise, or if a write is left
half sent (flow control), the frames wait in the send queue for the writer task, the
sink's only awaiter.

The send queue holds control frames and at most one "pull" marker per stream (the
stream's steps that queued up meanwhile are merged into one delta when it is pulled,
never dropped), so it stays small. Past `limits.send_queue` entries the session stops
reading the client (`caught_up`) until the writer has caught up."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.config import Limits
from service.delivery import Live
from service.protocol import Codec
from service.sink import FrameSink, SocketState

_CLOSE = object()  # send-queue sentinel: the writer stops
_OPEN, _DRAINING = SocketState.OPEN, SocketState.DRAINING  # (read per stream per step)


@dataclass(eq=False)
class _HalfSent:
    """A stream's frame that the sink holds half sent (flow control), and its frames
    after it."""

    msg: dict[str, Any]
    rest: list[dict[str, Any]]
    live: Live


class Sender:
    def __init__(self, sink: FrameSink, codec: Codec, limits: Limits,
                 pull: Callable[[Live], list[dict[str, Any]]],
                 delivered: Callable[[Live], None],
                 log_delivery: Callable[[float], None]) -> None:
        """`pull(live)`: the stream's frames since its last pull; `delivered(live)`:
        called once they are all written; `log_delivery(seconds)`: sampled-to-written
        time of each delta."""
        self.sink, self.codec, self.limits = sink, codec, limits
        self._pull, self._delivered, self._log_delivery = pull, delivered, log_delivery
        # frames (dicts), Live markers (pull that stream now), _HalfSent, or _CLOSE; in
        # send order
        self.queue: deque[Any] = deque()
        self._wake = asyncio.Event()
        self.caught_up = asyncio.Event()  # the reader waits on it while the queue is over limit
        self.caught_up.set()

    # -- queueing ------------------------------------------------------------------------------

    def frame(self, msg: dict[str, Any]) -> None:
        """Queue a control frame (ready, queued, error, pong...)."""
        self.queue.append(msg)
        self._wake.set()
        if len(self.queue) > self.limits.send_queue:
            self.caught_up.clear()  # stop reading this client until it reads its frames

    def notify(self, live: Live) -> None:
        """A stream has output: write its frames now if the socket is idle, else queue
        one pull marker for it (see the module docstring)."""
        if live.queued:
            return
        sink = self.sink
        if self.queue or sink.state is not _OPEN:
            live.queued = True
            self.queue.append(live)
            self._wake.set()
            return
        frames = self._pull(live)
        for i, msg in enumerate(frames):
            if sink.try_write(self.codec.encode(msg)):
                self._written(msg, live)
                continue
            if sink.state is _DRAINING:  # the writer finishes it, then the rest
                self.queue.append(_HalfSent(msg, frames[i + 1:], live))
                self._wake.set()
            return  # (GONE: the reader sees the disconnect and parks or aborts everything)
        self._delivered(live)

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing being written."""
        return not self.queue and self.sink.state is not _DRAINING

    @property
    def blocked_since(self) -> float | None:
        """When the send under way began to wait on the client (None: none waits)."""
        return self.sink.blocked_since

    def close(self) -> None:
        """Let the writer task end once it reaches this (after `discard`, at once)."""
        self.queue.append(_CLOSE)
        self._wake.set()

    def discard(self) -> None:
        """Drop queued frames and markers (the socket is gone)."""
        self.queue.clear()

    # -- writing --------------------------------------------------------------------------------

    def _written(self, msg: dict[str, Any], live: Live | None) -> None:
        if live is not None and msg["type"] == "delta":
            self._log_delivery(time.monotonic() - live.stream.sampled_at)

    async def run(self) -> None:
        """The writer task: sends what `notify` and `frame` queued, in order. Ends at
        `close`, or when the socket is gone."""
        q, wake = self.queue, self._wake
        while True:
            while not q:
                wake.clear()
                await wake.wait()
            item = q.popleft()
            if item is _CLOSE:
                return
            if not self.caught_up.is_set() and len(q) <= self.limits.send_queue // 2:
                self.caught_up.set()
            if isinstance(item, _HalfSent):
                if not await self.sink.flush():
                    return
                self._written(item.msg, item.live)
                frames, live = item.rest, item.live
            elif isinstance(item, Live):
                frames, live = self._pull(item), item
            else:
                frames, live = [item], None
            for msg in frames:
                if not await self.sink.send(self.codec.encode(msg)):
                    return
                self._written(msg, live)
            if live is not None:
                self._delivered(live)

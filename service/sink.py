"""Where a WebSocket's encoded frames go: the socket's state (open, draining, gone) and
the one object that owns it, a `FrameSink`.

A sink takes a frame two ways: `try_write`, synchronous, for the engine's per-step
dispatch (a socket with nothing ahead of its frame costs one pass through the send path
and no task wake-up), and `send` / `flush`, awaited by the socket's writer task only
(service/sender.py). `AsgiSink` is the server's: uvicorn's frame writer when the server
offers it, else the ASGI send run by hand up to its first suspension. How either works
is service/transport.py's business; nothing outside this module calls it."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any, Protocol

from starlette.websockets import WebSocket, WebSocketDisconnect

from service.transport import SENT, asgi_send_of, drive_send, frame_writer_of, start_send

_GONE = (WebSocketDisconnect, RuntimeError, OSError)  # what a send to a closed socket raises


class SocketState(enum.Enum):
    """Where a socket's write side stands; only its sink changes it."""

    OPEN = "open"  # a frame can be written now
    DRAINING = "draining"  # a send waits on the transport (flow control): frames wait for it
    GONE = "gone"  # a send failed: the client is gone, and so is any frame written to it


class FrameSink(Protocol):
    """The write side of one socket. `try_write` never waits; `flush` and `send` are
    awaited by one task only (the socket's writer), never two at a time."""

    state: SocketState
    blocked_since: float | None  # an awaited send has waited since (the watchdog reads it)

    def try_write(self, data: bytes | str) -> bool:
        """Write an encoded frame now, with the state OPEN. True: written. False: not
        written yet: with the state now DRAINING the sink holds the frame half sent and
        `flush` finishes it; with the state GONE it is lost."""
        ...

    async def flush(self) -> bool:
        """Finish the frame `try_write` left half sent (if any); False: the socket is gone."""
        ...

    async def send(self, data: bytes | str) -> bool:
        """Write an encoded frame, waiting on flow control; False: the socket is gone."""
        ...


class AsgiSink:
    """The server's sink for a Starlette WebSocket (see the module docstring)."""

    def __init__(self, ws: WebSocket) -> None:
        self.state = SocketState.OPEN
        self.blocked_since: float | None = None
        self._asgi_send = asgi_send_of(ws)
        self._write_frame: Callable[[bytes | str], bool] | None = frame_writer_of(ws)
        self._half_sent: tuple[Any, Any] | None = None  # (send coroutine, what it awaits)

    def try_write(self, data: bytes | str) -> bool:
        write = self._write_frame  # straight to the server's transport, if it lets us
        if write is not None and write(data):
            return True
        coro = self._asgi_send(_message(data))
        try:
            awaiting = start_send(coro)
        except _GONE:
            self.state = SocketState.GONE  # the reader sees the disconnect and parks or aborts
            return False
        if awaiting is SENT:
            return True
        self._half_sent = (coro, awaiting)
        self.state = SocketState.DRAINING
        return False

    async def flush(self) -> bool:
        if self._half_sent is None:
            return self.state is not SocketState.GONE
        coro, awaiting = self._half_sent
        self._half_sent = None
        return await self._wait(drive_send(coro, awaiting))

    async def send(self, data: bytes | str) -> bool:
        if self.state is SocketState.GONE:
            return False
        write = self._write_frame
        if write is not None and write(data):
            return True
        return await self._wait(self._asgi_send(_message(data)))

    async def _wait(self, sending: Any) -> bool:
        self.state = SocketState.DRAINING
        self.blocked_since = time.monotonic()
        try:
            await sending
        except _GONE:
            self.state = SocketState.GONE  # the reader sees the disconnect and parks or aborts
            return False
        finally:
            self.blocked_since = None
        self.state = SocketState.OPEN
        return True


def _message(data: bytes | str) -> dict[str, Any]:
    if isinstance(data, bytes):
        return {"type": "websocket.send", "bytes": data}
    return {"type": "websocket.send", "text": data}

"""The adapter: every private name of uvicorn, websockets, Starlette and asyncio that
Tidewire's WebSocket path relies on, in one module. Checked against uvicorn 0.54.0,
websockets 17.4 and Starlette 1.10.0; each helper says what it falls back to when those
internals are not there (another server, another version), always the public ASGI path.

Server side (built into uvicorn by service/server.py):
- `FrameWriterProtocol` subclasses uvicorn's Sans-I/O websockets protocol
  (`WebSocketsSansIOProtocol`, its `conn`, `transport`, `close_sent`, `disconnected`)
  and offers `write_frame` to the app through a scope extension;
- `_TellingServerProtocol` is set as the class of the websockets `ServerProtocol` that
  uvicorn builds (`conn.__class__`), to send an error frame before a 1009 close.

App side (service/sink.py, AsgiSink: nothing else calls these):
- `RawSend`: the app's outermost ASGI layer (service.app.create_app), which stashes the
  server's own send in a WebSocket's scope;
- `asgi_send_of`: the server's ASGI send as RawSend stashed it (no Starlette
  per-message checks), else Starlette's public `WebSocket.send`;
- `frame_writer_of`: FrameWriterProtocol.write_frame, else None (the ASGI send only);
- `start_send` / `drive_send`: step an ASGI send coroutine by hand, the way an asyncio
  Task does (`_asyncio_future_blocking`), so a frame can go out synchronously inside
  the engine's dispatch and only a send that must wait becomes a task's business.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.websockets import WebSocket
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.frames import CloseCode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.server import ServerProtocol

from service.protocol import SUBPROTOCOL_JSON, Codec, ProtocolError

WRITE_FRAME = "tidewire.write_frame"  # the ASGI scope extension FrameWriterProtocol adds
_HEAD16, _HEAD64 = struct.Struct("!BBH"), struct.Struct("!BBQ")
_BINARY, _TEXT = 0x82, 0x81  # FIN + opcode: one unfragmented message per frame
# the 2-byte header of every payload length under 126, by opcode
_BINARY_HEADS = [bytes((_BINARY, n)) for n in range(126)]
_TEXT_HEADS = [bytes((_TEXT, n)) for n in range(126)]


class _TellingServerProtocol(ServerProtocol):
    """websockets' server protocol, which sends an error frame (message_too_big, in the
    socket's subprotocol) just ahead of the 1009 close for a message over the hard cap.

    websockets fails the connection from inside its parser as soon as a frame header
    says the message is too big; the app never sees the message, and without this the
    close would be all the client gets. uvicorn builds its ServerProtocol itself, so
    FrameWriterProtocol sets this class on that instance (no state added but `cap`)."""

    cap: int | None = None  # the max_size it was built with, for the message

    def send_response(self, response: Response) -> None:
        # uvicorn negotiates the subprotocol with the app, not with websockets: note the
        # one the accepted handshake names, which picks the error frame's encoding
        if response.status_code == 101:
            self.subprotocol = response.headers.get(  # type: ignore[assignment]  # a str
                "Sec-WebSocket-Protocol")
        super().send_response(response)

    def fail(self, code: CloseCode | int, reason: str = "") -> None:
        if (code == CloseCode.MESSAGE_TOO_BIG and self.state is State.OPEN
                and not self.expect_continuation_frame):
            self._send_too_big()
        super().fail(code, reason)

    def _send_too_big(self) -> None:
        error = ProtocolError("message_too_big",
                              f"message is over {self.cap} bytes, the server's hard cap: the "
                              "socket closes with 1009 (a message over max_message_bytes but "
                              "under the cap is refused with the socket left open)")
        data = Codec(self.subprotocol or SUBPROTOCOL_JSON).encode(error.frame())
        if isinstance(data, bytes):
            self.send_binary(data)
        else:
            self.send_text(data.encode())


class FrameWriterProtocol(WebSocketsSansIOProtocol):
    """uvicorn's Sans-I/O websockets protocol plus a synchronous writer of data frames,
    which the app finds in its scope as `scope["extensions"]["tidewire.write_frame"]`.

    Why: a step's fan-out writes one small frame to each of dozens of sockets, and the
    ASGI send wraps each in a coroutine, a websockets Frame object, its serializer and a
    join on top of the write itself. A server-to-client data frame with no extension
    negotiated is a 2-10 byte header (FIN + opcode, unmasked payload length) in front of
    the payload, so it is built and written here at once.

    The writer declines (returns False, writes nothing) whenever the ASGI send would do
    more than that or refuse: the connection is not OPEN (closing, closed) or the TCP
    connection is lost, we sent a close, permessage-deflate is on, or the transport is
    paused by flow control. The
    caller then awaits the ASGI send for that frame, and must send nothing else on the
    socket until that send returns (service.sink.AsgiSink keeps that order)."""

    _paused = False  # the transport is over its high-water mark (flow control)

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.conn.__class__ = _TellingServerProtocol  # see its docstring
        self.conn.cap = config.ws_max_size  # type: ignore[attr-defined]  # read by the subclass

    def pause_writing(self) -> None:
        self._paused = True  # a plain flag for write_frame, beside uvicorn's Event
        super().pause_writing()

    def resume_writing(self) -> None:
        self._paused = False
        super().resume_writing()

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # absent when the handshake was refused
        if scope is not None:
            scope["extensions"][WRITE_FRAME] = self.write_frame

    def write_frame(self, data: bytes | str) -> bool:
        """Write `data` as one binary (bytes) or text (str) message now; False if the
        ASGI send must carry it instead (see the class docstring)."""
        conn = self.conn
        if (self._paused or self.close_sent or self.disconnected
                or conn.state is not State.OPEN or conn.extensions
                or conn.expect_continuation_frame):
            return False
        if isinstance(data, str):
            payload, op, heads = data.encode(), _TEXT, _TEXT_HEADS
        else:
            payload, op, heads = data, _BINARY, _BINARY_HEADS
        n = len(payload)
        if n < 126:
            head = heads[n]
        elif n < 65536:
            head = _HEAD16.pack(op, 126, n)
        else:
            head = _HEAD64.pack(op, 127, n)
        self.transport.write(head + payload)
        return True



# -- the app's side ---------------------------------------------------------------------------

ASGI_SEND = "tidewire.asgi_send"  # the scope key RawSend stashes the send under


class RawSend:
    """Outermost ASGI layer: puts the server's own `send` into a WebSocket's scope, so
    the socket's hot path (a data frame per stream per step) can call it directly,
    without the per-message wrappers of Starlette's middleware stack."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.state = app.state

    async def __call__(self, scope: dict, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] == "websocket":
            scope[ASGI_SEND] = send
        await self.app(scope, receive, send)


def asgi_send_of(ws: WebSocket) -> Callable[[dict[str, Any]], Any]:
    """The server's own ASGI send for this socket, else Starlette's public send."""
    return ws.scope.get(ASGI_SEND) or ws.send


def frame_writer_of(ws: WebSocket) -> Callable[[bytes | str], bool] | None:
    """FrameWriterProtocol.write_frame for this socket, or None under another server."""
    return ws.scope.get("extensions", {}).get(WRITE_FRAME)


SENT = object()  # start_send: the send completed without suspending


def start_send(coro: Any) -> Any:
    """Run an ASGI send coroutine up to its first suspension: SENT if it completed,
    else what it awaits (a future, or None for a bare yield), for drive_send."""
    try:
        return coro.send(None)
    except StopIteration:
        return SENT


async def drive_send(coro: Any, awaiting: Any) -> None:
    """Finish a send that start_send left suspended: wait for what it awaits, then
    resume it, until it returns (or raises). Closes the coroutine either way."""
    try:
        while True:
            try:
                if awaiting is None:
                    await asyncio.sleep(0)  # a bare yield
                else:
                    # as a Task does with what its coroutine yields: clear the flag the
                    # future set when it was yielded, then wait for it
                    awaiting._asyncio_future_blocking = False
                    await awaiting
            except asyncio.CancelledError:
                if awaiting is None or not awaiting.cancelled():
                    raise  # we are cancelled, not what it awaited
            except Exception:  # noqa: BLE001 - it raises inside the send, below
                pass
            try:
                awaiting = coro.send(None)
            except StopIteration:
                return
    finally:
        coro.close()

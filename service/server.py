"""uvicorn with a graceful drain and a direct writer of WebSocket data frames.

On shutdown: stop taking requests, let in-flight streams finish (up to the grace
period), close sockets with 1001, then let uvicorn close connections and run the
lifespan shutdown."""

from __future__ import annotations

import socket
import struct
from typing import Any

import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.frames import CloseCode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.server import ServerProtocol

from service.app import create_app, drain
from service.config import Limits, ServiceConfig
from service.protocol import SUBPROTOCOL_JSON, Codec, ProtocolError

WRITE_FRAME = "tidewire.write_frame"  # the ASGI scope extension FrameWriterProtocol adds
HARD_CAP_FACTOR = 4  # the protocol layer's message size cap, in max_message_bytes
_HEAD16, _HEAD64 = struct.Struct("!BBH"), struct.Struct("!BBQ")
_BINARY, _TEXT = 0x82, 0x81  # FIN + opcode: one unfragmented message per frame
# the 2-byte header of every payload length under 126, by opcode
_BINARY_HEADS = [bytes((_BINARY, n)) for n in range(126)]
_TEXT_HEADS = [bytes((_TEXT, n)) for n in range(126)]


def hard_message_cap(limits: Limits) -> int:
    """uvicorn's ws_max_size: past it websockets closes the socket with 1009. Messages
    between limits.max_message_bytes and this reach the app, which answers
    message_too_big and keeps the socket open; the cap bounds what one message makes
    the server buffer (and parse, to name its request)."""
    return HARD_CAP_FACTOR * limits.max_message_bytes


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
    socket until that send returns (ws.Session keeps that order)."""

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


class TidewireServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace: float) -> None:
        super().__init__(config)
        self.grace = grace
        self.load_error: BaseException | None = None

    def load_failed(self, error: BaseException) -> None:
        """The model did not load: stop serving (the exit status says so)."""
        self.load_error = error
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        gateway = getattr(getattr(self.config.app, "state", None), "gateway", None)
        if gateway is not None:
            await drain(gateway, self.grace)
        await super().shutdown(sockets)


def build_server(config: ServiceConfig, host: str, port: int,
                 log_level: str = "info") -> TidewireServer:
    app = create_app(config)
    uv = uvicorn.Config(app, host=host, port=port, loop="uvloop", ws=FrameWriterProtocol,
                        ws_max_size=hard_message_cap(config.limits), log_level=log_level,
                        ws_per_message_deflate=config.ws_compression,
                        timeout_graceful_shutdown=int(config.shutdown_grace) + 5)
    server = TidewireServer(uv, config.shutdown_grace)
    app.state.on_load_failed = server.load_failed
    return server


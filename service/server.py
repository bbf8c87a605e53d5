"""uvicorn with a graceful drain and a direct writer of WebSocket data frames (the
protocol classes are in service/transport.py, the module that holds every private name
of the server libraries).

On shutdown: stop taking requests, let in-flight streams finish (up to the grace
period), close sockets with 1001, then let uvicorn close connections and run the
lifespan shutdown."""

from __future__ import annotations

import socket

import uvicorn

from service.app import create_app, drain
from service.config import Limits, ServiceConfig
from service.transport import WRITE_FRAME, FrameWriterProtocol  # noqa: F401 - re-exported

HARD_CAP_FACTOR = 4  # the protocol layer's message size cap, in max_message_bytes


def hard_message_cap(limits: Limits) -> int:
    """uvicorn's ws_max_size: past it websockets closes the socket with 1009. Messages
    between limits.max_message_bytes and this reach the app, which answers
    message_too_big and keeps the socket open; the cap bounds what one message makes
    the server buffer (and parse, to name its request)."""
    return HARD_CAP_FACTOR * limits.max_message_bytes


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


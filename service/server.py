"""uvicorn with a graceful drain: on shutdown, stop taking requests, let in-flight
streams finish (up to the grace period), close sockets with 1001, then let uvicorn
close connections and run the lifespan shutdown."""

from __future__ import annotations

import socket

import uvicorn

from service.app import create_app, drain
from service.config import ServiceConfig


class TidewireServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace: float) -> None:
        super().__init__(config)
        self.grace = grace

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        gateway = getattr(self.config.app.state, "gateway", None)
        if gateway is not None:
            await drain(gateway, self.grace)
        await super().shutdown(sockets)


def build_server(config: ServiceConfig, host: str, port: int,
                 log_level: str = "info") -> TidewireServer:
    app = create_app(config)
    uv = uvicorn.Config(app, host=host, port=port, loop="uvloop", ws="websockets-sansio",
                        ws_max_size=config.limits.max_message_bytes + 1024, log_level=log_level,
                        ws_per_message_deflate=config.ws_compression,
                        timeout_graceful_shutdown=int(config.shutdown_grace) + 5)
    return TidewireServer(uv, config.shutdown_grace)

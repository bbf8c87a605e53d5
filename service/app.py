"""The Starlette application: routes, a lifespan that owns the engine thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from engine import AsyncEngine
from service import openai_api
from service.config import ServiceConfig
from service.gateway import Gateway
from service.metrics import Metrics
from service.ws import websocket_endpoint

log = logging.getLogger("tidewire.service")
STATIC = Path(__file__).parent / "static"
# The JS SDK's ESM source, served at /sdk/ for the chat page (and any browser app).
JS_SDK = Path(os.environ.get("TIDEWIRE_JS_SDK",
                             Path(__file__).resolve().parents[1] / "clients" / "js" / "src"))


async def health(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    ok = gw.engine.running and gw.engine.dead is None
    return JSONResponse({"status": "ok" if ok else "engine_dead"}, status_code=200 if ok else 503)


async def ready(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    ok = gw.engine.running and gw.accepting
    return JSONResponse({"ready": ok, "model": gw.config.model_name},
                        status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    gw.metrics.observe_engine(gw.engine.engine)
    return PlainTextResponse(gw.metrics.render().decode(),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


async def drain(gw: Gateway, grace: float) -> None:
    """Stop accepting, let in-flight streams finish up to `grace` s, then close 1001."""
    gw.accepting = False
    gw.expire_all()  # parked requests of dropped sockets: nobody can resume them now
    deadline = asyncio.get_running_loop().time() + grace
    while gw.inflight_total and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    for session in list(gw.sessions):
        with contextlib.suppress(Exception):
            await session.ws.close(code=1001, reason="server shutting down")


class RawSend:
    """Outermost ASGI layer: puts the server's own `send` into a WebSocket's scope, so
    the socket's hot path (a data frame per stream per step) can call it directly,
    without the per-message wrappers of Starlette's middleware stack."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.state = app.state

    async def __call__(self, scope: dict, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] == "websocket":
            scope["tidewire.asgi_send"] = send
        await self.app(scope, receive, send)


def create_app(config: ServiceConfig) -> RawSend:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine = AsyncEngine(config.engine)
        await engine.start()  # loads the model on the engine thread
        app.state.gateway = Gateway(config, engine, Metrics())
        log.info("tidewire ready: %s", config.model_name)
        try:
            yield
        finally:
            await drain(app.state.gateway, config.shutdown_grace)
            await engine.shutdown()

    routes = [
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        Route("/v1/models", openai_api.models),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/warm", openai_api.warm, methods=["POST"]),
        WebSocketRoute("/v1/ws", websocket_endpoint),
        *([Mount("/sdk", StaticFiles(directory=JS_SDK), name="sdk")] if JS_SDK.is_dir() else []),
        Mount("/", StaticFiles(directory=STATIC, html=True), name="static"),
    ]
    return RawSend(Starlette(routes=routes, lifespan=lifespan))

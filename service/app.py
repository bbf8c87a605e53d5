"""The Starlette application: routes, a lifespan that owns the engine thread."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from typing import Any
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Match, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocketClose

from engine import AsyncEngine
from service import anthropic_api, openai_api, openapi, responses_api, vllm_api
from service.config import ServiceConfig
from service.gateway import Gateway
from service.metrics import Metrics
from service.origins import origin_allowed
from service.protocol import ProtocolError
from service.transport import RawSend
from service.session import websocket_endpoint

log = logging.getLogger("tidewire.service")
STATIC = Path(__file__).parent / "static"
# The JS SDK's ESM source, served at /sdk/ for the chat page (and any browser app).
JS_SDK = Path(os.environ.get("TIDEWIRE_JS_SDK",
                             Path(__file__).resolve().parents[1] / "clients" / "js" / "src"))


def loading_state(state: Any) -> dict[str, Any] | None:
    """What /health says while there is no gateway yet: the model is loading (phase,
    seconds, estimate of what is left) or failed to load. None once it serves."""
    if getattr(state, "gateway", None) is not None:
        return None
    error = getattr(state, "load_error", None)
    if error is not None:
        return {"status": "failed", "error": f"{type(error).__name__}: {error}"}
    engine: AsyncEngine | None = getattr(state, "engine", None)
    snap = engine.progress.snapshot() if engine is not None else None
    return {"status": "loading",
            "progress": snap.as_dict(time.monotonic()) if snap is not None else None}


def _retry_after(loading: dict[str, Any]) -> dict[str, str]:
    eta = (loading.get("progress") or {}).get("eta_s")
    return {"Retry-After": str(max(1, math.ceil(eta or 2)))}


async def health(request: Request) -> Response:
    loading = loading_state(request.app.state)
    if loading is not None:
        return JSONResponse(loading, status_code=503, headers=_retry_after(loading))
    gw: Gateway = request.app.state.gateway
    ok = gw.engine.running and gw.engine.dead is None
    return JSONResponse({"status": "ok" if ok else "engine_dead"}, status_code=200 if ok else 503)


async def ready(request: Request) -> Response:
    loading = loading_state(request.app.state)
    if loading is not None:  # not yet: when it should be is in progress.eta_s
        return JSONResponse({"ready": False, "model": request.app.state.model_name, **loading},
                            status_code=503, headers=_retry_after(loading))
    gw: Gateway = request.app.state.gateway
    ok = gw.engine.running and gw.engine.dead is None and gw.accepting  # (dead is set
    # before the dying thread ends: /ready says so the moment /health does)
    return JSONResponse({"ready": ok, "model": gw.config.model_name},
                        status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    want = gw.config.metrics_key
    if want:
        got = request.headers.get("authorization", "")
        got = got[7:].strip() if got.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(got.encode(), want.encode()):
            return openai_api.error_response(ProtocolError("unauthorized",
                                                           "missing or invalid metrics key"))
    gw.metrics.observe_engine(gw.engine.stats)
    return PlainTextResponse(gw.metrics.render().decode(),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


async def drain(gw: Gateway, grace: float) -> None:
    """Stop accepting, let in-flight streams finish up to `grace` s; then end the HTTP
    requests still running with `overloaded` (an SSE error event, or the error as the
    response) and close the sockets with 1001 (their clients may resume elsewhere)."""
    gw.accepting = False
    gw.parked.expire_all()  # parked requests of dropped sockets: nobody can resume them now
    deadline = asyncio.get_running_loop().time() + grace
    closed: set[Any] = set()
    closing: list[asyncio.Task[None]] = []
    while True:
        # a socket with nothing in flight closes now (1001), and one whose requests have
        # all ended as soon as its last frame is written: its client reconnects, through
        # a load balancer, to a replica that takes requests, instead of being refused here
        for session in list(gw.sessions):
            if session.idle and session not in closed:
                closed.add(session)
                closing.append(asyncio.create_task(_going_away(session)))
        if not gw.inflight_total or asyncio.get_running_loop().time() >= deadline:
            break
        await asyncio.sleep(0.05)
    gw.fail_http(ProtocolError("overloaded", "the server is shutting down; retry the request"))
    for session in list(gw.sessions):
        if session not in closed:
            await _going_away(session)
    await asyncio.gather(*closing)


async def _going_away(session: Any) -> None:
    with contextlib.suppress(Exception):
        await session.ws.close(code=1001, reason="server shutting down")


class ReadOnlyFiles:
    """StaticFiles that owns GET and HEAD only. Another method is a 405 on a path that
    exists and a 404 on one that does not: StaticFiles alone answers 405 to any method
    but GET, so its mount at / made every unknown POST a 405. A WebSocket is closed
    (StaticFiles asserts on one)."""

    def __init__(self, directory: Path, html: bool = False) -> None:
        self.files = StaticFiles(directory=directory, html=html)

    async def __call__(self, scope: dict, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] != "http":
            await WebSocketClose()(scope, receive, send)
        elif scope["method"] in ("GET", "HEAD"):
            await self.files(scope, receive, send)
        elif await self._exists(scope):
            raise HTTPException(405, headers={"Allow": "GET, HEAD"})
        else:
            raise HTTPException(404)

    async def _exists(self, scope: dict) -> bool:
        try:
            _, found = await asyncio.to_thread(self.files.lookup_path, self.files.get_path(scope))
        except (OSError, ValueError):  # a name too long, a NUL byte: no such file
            return False
        return found is not None


class OriginCORS(CORSMiddleware):
    """CORS for the origins the WebSocket accepts, matched as service.origins matches
    them (case, a trailing slash, a default port do not matter). A same-origin page
    needs no grant, so none listed leaves the browser's same-origin rule as it is."""

    def __init__(self, app: Any, allowed: tuple[str, ...]) -> None:
        # Auth is a bearer header, not a cookie: no credentials mode. Any request
        # header, since SDKs add their own (x-stainless-*).
        super().__init__(app, allow_origins=list(allowed), allow_methods=["GET", "POST"],
                         allow_headers=["*"], expose_headers=["Retry-After"])
        self.allowed = allowed

    def is_allowed_origin(self, origin: str) -> bool:
        return origin_allowed(origin, None, self.allowed)

    async def __call__(self, scope: dict, receive, send) -> None:  # type: ignore[override]  # noqa: ANN001 - ASGI
        """CORS only withholds a response from the page; the request would still run
        (a "simple" POST needs no preflight). So an HTTP request from an origin the
        list refuses is answered 403 here, as the WebSocket handshake is, before it
        can generate anything. Preflights go to CORSMiddleware, which declines them."""
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            headers = Headers(scope=scope)
            if not origin_allowed(headers.get("origin"), headers.get("host"), self.allowed):
                response = openai_api.error_json(
                    403, "origin_not_allowed",
                    f"origin {headers.get('origin')!r} is not allowed (--allowed-origins)")
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


async def load(app: Starlette, config: ServiceConfig) -> None:
    """Load the model (on the engine thread); then serve, or report the failure and
    ask the server to stop (`app.state.on_load_failed`, set by service.server)."""
    try:
        await app.state.engine.start()
    except Exception as e:  # noqa: BLE001 - reported on /health and by the exit status
        log.error("the model did not load: %s: %s", type(e).__name__, e)
        app.state.load_error = e
        on_failed = getattr(app.state, "on_load_failed", None)
        if on_failed is not None:
            on_failed(e)
        return
    # the engine's byte table (chat logprobs' bytes), built now off the event loop
    await asyncio.to_thread(app.state.engine.byte_table, False)
    app.state.gateway = Gateway(config, app.state.engine, Metrics())
    log.info("tidewire ready: %s", config.model_name)


class LoadingGate:
    """Until the model has loaded, a route that needs the engine answers 503 `loading`
    (with Retry-After); a WebSocket handshake is refused with the same 503. /health,
    /ready and the page's files are served from the start. A middleware inside
    OriginCORS, so a page on an allowed origin can read the 503 too."""

    OPEN = frozenset({"/health", "/ready"})

    def __init__(self, app: Any) -> None:
        self.app = app  # the next layer; the Starlette app itself is scope["app"]

    async def __call__(self, scope: dict, receive, send) -> None:  # noqa: ANN001 - ASGI
        top: Starlette = scope.get("app")  # type: ignore[assignment]
        if (scope["type"] != "lifespan" and top is not None
                and getattr(top.state, "gateway", None) is None and self._gated(top, scope)):
            loading = loading_state(top.state) or {}
            failed = loading.get("status") == "failed"
            message = (f"the model failed to load: {loading.get('error')}" if failed else
                       "the model is loading; GET /health shows its progress")
            response = openai_api.error_json(503, "load_failed" if failed else "loading",
                                             message, None if failed else _retry_after(loading))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _gated(self, top: Starlette, scope: dict) -> bool:
        if scope["path"] in self.OPEN or scope.get("method") == "OPTIONS":
            return False  # a CORS preflight is answered by the middleware, loaded or not
        # endpoints, not the page's files (a Mount: /sdk serves the page's script)
        return any(r.matches(scope)[0] is not Match.NONE for r in top.router.routes
                   if isinstance(r, (Route, WebSocketRoute)))


def create_app(config: ServiceConfig) -> RawSend:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # The model loads in the background, so the port answers (/health: loading,
        # with progress) from the start; routes that need the engine wait for it.
        app.state.engine, app.state.model_name = AsyncEngine(config.engine), config.model_name
        app.state.gateway = app.state.load_error = None
        loader = asyncio.create_task(load(app, config))
        try:
            yield
        finally:
            if not loader.done():  # stopped while loading: let the load end first, or
                await asyncio.wait([loader], timeout=config.shutdown_grace)
                loader.cancel()  # give up on it (the engine thread stops once loaded)
                await asyncio.wait([loader])
            if app.state.gateway is not None:
                await drain(app.state.gateway, config.shutdown_grace)
                await app.state.engine.shutdown()
                app.state.gateway.close()

    routes = [
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        Route("/v1/models", openai_api.models),
        Route("/v1/models/{model:path}", openai_api.model),
        Route("/tokenize", vllm_api.tokenize, methods=["POST"]),
        Route("/detokenize", vllm_api.detokenize, methods=["POST"]),
        Route("/version", vllm_api.version),
        Route("/openapi.json", openapi.openapi),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/chat/completions/{id}/events", openai_api.stream_events),
        Route("/v1/completions/{id}/events", openai_api.stream_events),
        Route("/v1/chat/completions/{id}/events", openai_api.cancel_stream,
              methods=["DELETE"]),
        Route("/v1/completions/{id}/events", openai_api.cancel_stream, methods=["DELETE"]),
        Route("/v1/warm", openai_api.warm, methods=["POST"]),
        Route("/v1/messages", anthropic_api.messages, methods=["POST"]),
        Route("/v1/responses", responses_api.create, methods=["POST"]),
        WebSocketRoute("/v1/responses", responses_api.socket),
        Route("/v1/responses/{id}", responses_api.retrieve, methods=["GET"]),
        Route("/v1/responses/{id}", responses_api.delete, methods=["DELETE"]),
        Route("/v1/responses/{id}/cancel", responses_api.cancel, methods=["POST"]),
        WebSocketRoute("/v1/ws", websocket_endpoint),
        *([Mount("/sdk", ReadOnlyFiles(JS_SDK), name="sdk")]  # type: ignore[arg-type]  # ASGI app
          if JS_SDK.is_dir() else []),
    ]
    # CORS is pure ASGI and passes WebSocket scopes through untouched (session.py checks
    # their Origin); unknown paths and wrong methods answer in OpenAI's error shape.
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(OriginCORS, allowed=config.allowed_origins),
                                Middleware(LoadingGate)],
                    exception_handlers={HTTPException: openai_api.http_error})
    # The page's files are what no route matched, not a mount at /: a mount there
    # matches every path, so a wrong method on a known one would be a 404, not a 405.
    app.router.default = ReadOnlyFiles(STATIC, html=True)  # type: ignore[assignment]  # ASGI app
    return RawSend(app)

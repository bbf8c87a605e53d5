"""service/server.py: FrameWriterProtocol's direct frame writer under real uvicorn, with a
real websockets client on the other end; the access log's redaction of keys in query
strings, the warning about an open server on a public address, and `tidewire serve`
exiting once its engine died (a real process)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import threading
import time
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect

from engine import EngineConfig
from service.config import ServiceConfig
from service.server import build_server, redact_query
from service.transport import WRITE_FRAME, FrameWriterProtocol
from tests.servers import (ServeProcess, free_port, http_get, request_until, run_server,
                           uvicorn_logs_to)

SIZES = [0, 1, 125, 126, 127, 65535, 65536, 200_000]  # around each header-length switch


def payloads() -> list[bytes | str]:
    out: list[bytes | str] = []
    for n in SIZES:
        out.append(bytes(i % 251 for i in range(n)))
        out.append(("é" * n)[: max(0, n // 2)])  # 2 bytes a char: the header counts bytes
    return out


@contextlib.contextmanager
def serve(endpoint, compression: bool = False) -> Iterator[str]:  # noqa: ANN001
    app = Starlette(routes=[WebSocketRoute("/ws", endpoint)])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop="uvloop",
                                           ws=FrameWriterProtocol, log_level="warning",
                                           ws_max_size=1 << 22,
                                           ws_per_message_deflate=compression))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"ws://127.0.0.1:{port}/ws"
    finally:
        server.should_exit = True
        thread.join(10)


async def test_direct_frames_arrive_whole_and_in_order_with_asgi_sends() -> None:
    results: list[bool] = []

    async def endpoint(ws: WebSocket) -> None:
        await ws.accept()
        write = ws.scope["extensions"][WRITE_FRAME]
        for p in payloads():
            results.append(write(p))  # directly, then the same through the ASGI send
            await (ws.send_bytes(p) if isinstance(p, bytes) else ws.send_text(p))
        await ws.close()

    with serve(endpoint) as url:
        async with connect(url, max_size=None, compression=None) as client:
            got = [m async for m in client]
    assert results == [True] * len(payloads())
    assert got == [p for p in payloads() for _ in range(2)]


async def test_writer_declines_when_the_asgi_send_must_carry_the_frame() -> None:
    """Paused by flow control, compression negotiated, or after our close: it writes
    nothing and says so, and the ASGI send still delivers in order."""
    seen: dict[str, bool] = {}

    async def endpoint(ws: WebSocket) -> None:
        await ws.accept()
        write = ws.scope["extensions"][WRITE_FRAME]
        proto = write.__self__
        proto.pause_writing()  # what the transport does above its high-water mark
        seen["paused"] = write(b"held")
        await asyncio.get_running_loop().run_in_executor(None, time.sleep, 0.05)
        proto.resume_writing()
        seen["resumed"] = write(b"after")
        await ws.send_bytes(b"asgi")
        await ws.close()
        seen["closed"] = write(b"late")

    with serve(endpoint) as url:
        async with connect(url, compression=None) as client:
            got = [m async for m in client]
    assert seen == {"paused": False, "resumed": True, "closed": False}
    assert got == [b"after", b"asgi"]

    async def deflating(ws: WebSocket) -> None:
        await ws.accept()
        seen["deflate"] = ws.scope["extensions"][WRITE_FRAME](b"x" * 100)
        await ws.send_bytes(b"x" * 100)
        await ws.close()

    with serve(deflating, compression=True) as url:
        async with connect(url) as client:  # offers permessage-deflate
            assert client.protocol.extensions, "compression was not negotiated"
            got = [m async for m in client]
    assert seen["deflate"] is False and got == [b"x" * 100]


async def test_writer_declines_before_the_handshake_completes() -> None:
    seen: list[bool] = []

    async def endpoint(ws: WebSocket) -> None:
        write = ws.scope["extensions"][WRITE_FRAME]
        seen.append(write(b"too early"))  # the 101 response is not sent yet
        await ws.accept()
        seen.append(write(b"now"))
        await ws.close()

    with serve(endpoint) as url:
        async with connect(url, compression=None) as client:
            got = [m async for m in client]
    assert seen == [False, True] and got == [b"now"]


async def test_writer_declines_once_the_connection_is_lost() -> None:
    """A client that drops the TCP connection without a close frame: the ASGI send
    raises (the app learns the socket is gone) and the writer must decline likewise,
    not write into a dead transport."""
    seen: list[bool] = []

    async def endpoint(ws: WebSocket) -> None:
        await ws.accept()
        write = ws.scope["extensions"][WRITE_FRAME]
        seen.append(write(b"hello"))
        assert (await ws.receive())["type"] == "websocket.disconnect"
        seen.append(write(b"gone"))

    with serve(endpoint) as url:
        client = await connect(url, compression=None)
        assert await client.recv() == b"hello"
        client.transport.abort()  # no close frame
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    assert seen == [True, False]


# -- what the logs show --------------------------------------------------------------------


def test_redact_query_masks_key_and_api_key_values_only() -> None:
    assert redact_query("/?key=secret123&x=1") == "/?key=***&x=1"
    assert redact_query("/v1/models?api_key=sk-1&api_key=sk-2") == "/v1/models?api_key=***&api_key=***"
    assert redact_query("/v1/ws?affinity=c1&KEY=s&%6Bey=s2") == "/v1/ws?affinity=c1&KEY=***&%6Bey=***"
    assert redact_query("/?monkey=1&keys=2&key") == "/?monkey=1&keys=2&key"  # other names, no value
    assert redact_query("/?key=&x=") == "/?key=***&x="
    assert redact_query("/a&key=1") == "/a&key=1"  # no query string
    assert redact_query("/static/app.js") == "/static/app.js"


def tiny_config(model, **kw) -> ServiceConfig:  # noqa: ANN001
    return ServiceConfig(engine=EngineConfig(model=str(model), dtype="float32"),
                         model_name="tiny", **kw)


async def test_the_access_log_never_shows_a_key_from_a_query_string(tiny_chat_model,
                                                                    caplog) -> None:
    """The real app under uvicorn with its access log on: the lines for requests that
    carry key= / api_key= in the query show *** in their place, other parameters as
    they were; so does the WebSocket handshake's line (uvicorn's error log)."""
    with run_server(tiny_config(tiny_chat_model), log_level="info") as s, \
            uvicorn_logs_to(caplog.handler):
        assert http_get(s.url + "/?key=secret123&x=1")[0] == 200
        assert http_get(s.url + "/v1/models?api_key=sk-live-4242")[0] == 200
        async with connect(s.ws_url + "?affinity=c1&key=ws-secret-77") as ws:
            assert json.loads(await ws.recv())["type"] == "ready"
        deadline = time.monotonic() + 10
        while len([r for r in caplog.records if r.name.startswith("uvicorn.")]) < 3:
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("uvicorn.")]
    text = "\n".join(lines)
    assert '"GET /?key=***&x=1 HTTP/1.1" 200' in text, text
    assert '"GET /v1/models?api_key=*** HTTP/1.1" 200' in text, text
    assert '"WebSocket /v1/ws?affinity=c1&key=***" [accepted]' in text, text
    for secret in ("secret123", "sk-live-4242", "ws-secret-77"):
        assert secret not in caplog.text


def test_an_open_server_on_a_public_address_is_warned_about(caplog) -> None:
    """Not loopback and no --api-keys: a WARNING when the server is built (before the
    model loads); loopback addresses, or keys, are quiet."""
    def warned(host: str, keys: dict[str, str] | None = None) -> bool:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tidewire.service"):
            build_server(ServiceConfig(api_keys=keys or {}), host, free_port())
        return any("--api-keys" in r.getMessage() and r.levelno == logging.WARNING
                   for r in caplog.records)

    assert warned("0.0.0.0") and warned("::") and warned("192.0.2.7") and warned("")
    assert warned("tidewire.example")  # a name: it may be any interface
    assert not any(warned(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not warned("0.0.0.0", {"k": "tenant"})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tidewire.service"):
        build_server(ServiceConfig(), "0.0.0.0", free_port())
    assert "listening on 0.0.0.0" in caplog.text


# `tidewire serve`, with the chaos tests' fault (the runner's forward raises) armed by a
# file the test creates once the server is ready
FAULTY_SERVE = """
import sys
from pathlib import Path

from service import cli  # first: it bounds OpenMP's spinning before torch loads
from engine.runner import ModelRunner

ARMED = Path({armed!r})
forward = ModelRunner.execute


def execute(self, *args, **kw):
    if ARMED.exists():
        raise RuntimeError("injected: the forward failed")
    return forward(self, *args, **kw)


ModelRunner.execute = execute
sys.exit(cli.main(sys.argv[1:]))
"""


def test_serve_exits_with_status_1_once_its_engine_died(tiny_chat_model, tmp_path) -> None:
    """A fault in the shared forward kills the engine thread (/health: engine_dead); the
    process then stops by itself, exit status 1, for a restart policy or the kubelet to
    start it again."""
    armed = tmp_path / "armed"
    proc = ServeProcess("--model", str(tiny_chat_model), "--dtype", "float32",
                        "--served-model-name", "tiny",
                        python_args=("-c", FAULTY_SERVE.format(armed=str(armed))))
    with proc:
        assert http_get(proc.url + "/health")[0] == 200
        armed.touch()
        assert proc.proc is not None
        with contextlib.suppress(AssertionError):  # (the log says why, below)
            request_until(proc.ws_url, lambda: proc.proc.poll() is not None)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)  # the drain after the exit began
        assert proc.proc.returncode == 1, proc.log()[-3000:]
    log = proc.log()
    assert "injected: the forward failed" in log  # the engine's own report
    assert "the engine died (RuntimeError): stopping the server" in log
    assert "--api-keys" not in log  # loopback: no warning

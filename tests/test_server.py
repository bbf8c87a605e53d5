"""service/server.py: FrameWriterProtocol's direct frame writer under real uvicorn, with a
real websockets client on the other end."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect

from service.server import WRITE_FRAME, FrameWriterProtocol
from tests.servers import free_port

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

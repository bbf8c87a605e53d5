"""service/sink.py's AsgiSink over a scripted ASGI send and frame writer (no server):
which path a frame takes, and the state each outcome leaves."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from service.sink import AsgiSink, SocketState
from service.transport import ASGI_SEND, WRITE_FRAME


class Send:
    """An ASGI send that completes at once, waits on `gate`, or raises `error`."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gate: asyncio.Future[None] | None = None
        self.error: BaseException | None = None

    async def __call__(self, message: dict[str, Any]) -> None:
        if self.error is not None:
            raise self.error
        if self.gate is not None:
            await self.gate
        self.sent.append(message)


def sink_of(send: Send, writer: Any = None) -> AsgiSink:
    scope: dict[str, Any] = {ASGI_SEND: send, "extensions": {}}
    if writer is not None:
        scope["extensions"][WRITE_FRAME] = writer
    return AsgiSink(SimpleNamespace(scope=scope, send=None))  # type: ignore[arg-type]


async def test_a_send_that_completes_at_once_is_written_in_try_write() -> None:
    send = Send()
    sink = sink_of(send)
    assert sink.try_write("x") and sink.try_write(b"y")
    assert send.sent == [{"type": "websocket.send", "text": "x"},
                         {"type": "websocket.send", "bytes": b"y"}]
    assert sink.state is SocketState.OPEN


async def test_the_frame_writer_goes_first_and_the_send_carries_what_it_declines() -> None:
    send, written = Send(), []

    def writer(data: bytes | str) -> bool:
        written.append(data)
        return data != "big"

    sink = sink_of(send, writer)
    assert sink.try_write("small") and await sink.send("big")
    assert written == ["small", "big"] and send.sent == [{"type": "websocket.send", "text": "big"}]


async def test_a_send_that_waits_is_half_sent_until_flush() -> None:
    send = Send()
    send.gate = asyncio.get_running_loop().create_future()
    sink = sink_of(send)
    assert not sink.try_write("x")
    assert sink.state is SocketState.DRAINING and send.sent == []
    flushing = asyncio.create_task(sink.flush())
    await asyncio.sleep(0)
    assert sink.blocked_since is not None and sink.state is SocketState.DRAINING
    send.gate.set_result(None)
    assert await flushing
    assert sink.state is SocketState.OPEN and sink.blocked_since is None
    assert send.sent == [{"type": "websocket.send", "text": "x"}]


async def test_a_send_to_a_closed_socket_leaves_it_gone() -> None:
    send = Send()
    send.error = OSError("gone")
    sink = sink_of(send)
    assert not sink.try_write("x") and sink.state is SocketState.GONE
    send.error = None
    assert not await sink.send("y") and send.sent == []  # nothing goes to a gone socket
    assert await sink.flush() is False


async def test_an_awaited_send_that_fails_leaves_it_gone() -> None:
    send = Send()
    send.error = RuntimeError("closed")
    sink = sink_of(send)
    assert not await sink.send("x")
    assert sink.state is SocketState.GONE and sink.blocked_since is None

"""service/sender.py against a FakeSink (tests/fakes.py): the synchronous path, the
writer task's order, half-sent frames, backpressure and a sink that dies."""

from __future__ import annotations

import asyncio
from typing import Any

from engine import SamplingParams
from engine.request_stream import RequestStream
from engine.request import Request
from service.config import Limits
from service.delivery import Live, Timings
from service.gateway import Admission, Principal
from service.protocol import SUBPROTOCOL_JSON, Codec
from service.sender import Sender
from service.sink import SocketState
from tests.fakes import FakeSink


class Harness:
    """A Sender whose streams' frames are scripted: `pending[rid]` is what the next
    pull of that stream returns."""

    def __init__(self, send_queue: int = 256) -> None:
        self.sink = FakeSink(Codec(SUBPROTOCOL_JSON))
        self.pending: dict[str, list[dict[str, Any]]] = {}
        self.delivered: list[str] = []
        self.logged: list[float] = []
        self.sender = Sender(self.sink, Codec(SUBPROTOCOL_JSON), Limits(send_queue=send_queue),
                             self._pull, lambda live: self.delivered.append(live.rid),
                             self.logged.append)
        self.task = asyncio.create_task(self.sender.run())

    def _pull(self, live: Live) -> list[dict[str, Any]]:
        live.queued = False
        frames, self.pending[live.rid] = self.pending.get(live.rid, []), []
        return frames

    def live(self, rid: str) -> Live:
        stream = RequestStream(Request(rid, [1], SamplingParams(max_tokens=4)))
        return Live(rid, Admission(stream, 0.0, Principal(None, "")), False, Timings(0.0))

    def output(self, live: Live, *texts: str) -> None:
        self.pending.setdefault(live.rid, []).extend(
            {"type": "delta", "id": live.rid, "text": t} for t in texts)
        self.sender.notify(live)

    async def close(self) -> None:
        self.sender.close()
        await asyncio.wait_for(self.task, 5)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_an_idle_socket_writes_in_dispatch_without_the_writer() -> None:
    h = Harness()
    await settle()
    a = h.live("a")
    h.output(a, "x", "y")
    # written synchronously, inside notify: no task ran in between
    assert [f["text"] for f in h.sink.frames] == ["x", "y"] and h.delivered == ["a"]
    assert len(h.logged) == 2 and h.sender.idle
    await h.close()


async def test_frames_keep_their_order_behind_a_blocked_send() -> None:
    h = Harness()
    await settle()
    a, b = h.live("a"), h.live("b")
    h.sink.block()
    h.output(a, "a1", "a2")  # a1 is half sent; a2 waits behind it
    assert h.sink.state is SocketState.DRAINING and not h.sender.idle
    h.sender.frame({"type": "pong", "t": 1})
    h.output(b, "b1")
    h.output(a, "a3")  # a's second marker: merged into one pull with a3
    h.output(a, "a4")
    assert a.queued and len(h.sender.queue) == 4  # half sent, pong, b, a
    h.sink.unblock()
    await settle()
    assert [f.get("text", f["type"]) for f in h.sink.frames] == \
        ["a1", "a2", "pong", "b1", "a3", "a4"]
    assert h.delivered == ["a", "b", "a"]
    assert h.sink.states == [SocketState.DRAINING, SocketState.OPEN] and h.sender.idle
    await h.close()


async def test_past_send_queue_the_reader_is_paused_until_the_writer_catches_up() -> None:
    h = Harness(send_queue=2)
    await settle()
    h.sink.block()
    for t in range(4):
        h.sender.frame({"type": "pong", "t": t})
    await settle()
    assert not h.sender.caught_up.is_set()
    h.sink.unblock()
    await settle()
    assert h.sender.caught_up.is_set() and [f["t"] for f in h.sink.frames] == [0, 1, 2, 3]
    await h.close()


async def test_a_sink_that_dies_ends_the_writer_and_queues_what_follows() -> None:
    h = Harness()
    await settle()
    a = h.live("a")
    h.sink.block()
    h.output(a, "a1")
    h.sender.frame({"type": "pong", "t": 1})
    h.sink.die()
    await asyncio.wait_for(h.task, 5)  # the writer ended: the socket is gone
    assert h.sink.state is SocketState.GONE and h.sink.frames == [] and h.delivered == []
    h.output(a, "a2")  # not written: queued for a writer that is gone (the reader ends it)
    assert a.queued and h.sink.frames == []
    h.sender.discard()
    assert h.sender.idle  # (gone is not draining: closing it loses the client nothing)


async def test_a_write_that_fails_in_dispatch_leaves_the_socket_gone() -> None:
    h = Harness()
    await settle()
    a = h.live("a")
    h.sink.die()
    h.output(a, "a1", "a2")
    assert h.sink.state is SocketState.GONE and h.sink.frames == [] and h.delivered == []
    await h.close()

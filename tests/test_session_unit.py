"""Session without uvicorn or a model: a FakeSocket client, a FakeSink for the frames and
a FakeEngine that echoes prompts (tests/fakes.py). Frame order, one done per request,
the sink's state transitions, a sink that dies mid-stream, resume and slow consumers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from service.config import Limits, ServiceConfig
from service.gateway import Gateway
from service.metrics import Metrics
from service.protocol import SUBPROTOCOL_JSON, Codec
from service.session import Session
from service.sink import SocketState
from tests.fakes import FakeEngine, FakeSink, FakeSocket


@dataclass
class Conn:
    session: Session
    client: FakeSocket
    sink: FakeSink
    task: asyncio.Task[None]

    def of(self, rid: str) -> list[dict[str, Any]]:
        return [f for f in self.sink.frames if f.get("id") == rid]

    def done(self, rid: str) -> bool:
        return any(f["type"] == "done" for f in self.of(rid))


async def until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


def gateway(**limits: Any) -> Gateway:
    return Gateway(ServiceConfig(limits=Limits(**limits)), FakeEngine(), Metrics())  # type: ignore[arg-type]


@asynccontextmanager
async def connect(gw: Gateway) -> AsyncIterator[Conn]:
    codec, client = Codec(SUBPROTOCOL_JSON), FakeSocket()
    sink = FakeSink(codec)
    session = Session(client, codec, gw, gw.authenticate(None), sink)  # type: ignore[arg-type]
    gw.add_session(session)
    conn = Conn(session, client, sink, asyncio.create_task(session.run()))
    await until(lambda: bool(sink.frames), "ready")
    try:
        yield conn
    finally:
        if not conn.task.done():
            client.drop()
        await asyncio.wait_for(conn.task, 5)
        gw.remove_session(session)


def gen(rid: str, tokens: int, prompt: list[int] | None = None) -> dict[str, Any]:
    return {"type": "generate", "id": rid, "prompt_token_ids": prompt or [5, 6, 7],
            "params": {"max_tokens": tokens}}


def tokens(frames: list[dict[str, Any]]) -> list[int]:
    return [t for f in frames if f["type"] == "delta" for t in f["token_ids"]]


async def test_a_stream_goes_out_in_order_with_one_done() -> None:
    gw = gateway()
    async with connect(gw) as c:
        assert c.sink.frames[0]["type"] == "ready"
        c.client.send(gen("a", 4))
        await until(lambda: c.done("a"), "done")
        frames = c.of("a")
        assert [f["type"] for f in frames] == ["start", "delta", "delta", "delta", "delta", "done"]
        assert [f["seq"] for f in frames if f["type"] == "delta"] == [1, 2, 3, 4]
        assert tokens(frames) == [5, 6, 7, 5]
        assert "".join(f["text"] for f in frames if f["type"] == "delta") == "5 6 7 5 "
        done = frames[-1]
        assert (done["status"], done["finish_reason"]) == ("completed", "length")
        assert done["usage"]["completion_tokens"] == 4
        await until(lambda: c.session.idle, "idle")
        assert "a" in c.session.streams.recent and not c.session.streams.live
        assert c.sink.states == []  # never blocked: every frame went out synchronously
    assert gw.inflight_total == 0


async def test_concurrent_requests_each_get_ordered_frames_and_exactly_one_done() -> None:
    gw = gateway()
    async with connect(gw) as c:
        for i, n in enumerate((3, 7, 5)):
            c.client.send(gen(f"r{i}", n, [10 + i, 20 + i]))
        await until(lambda: all(c.done(f"r{i}") for i in range(3)), "three dones")
        for i, n in enumerate((3, 7, 5)):
            frames = c.of(f"r{i}")
            assert frames[0]["type"] == "start" and frames[-1]["type"] == "done"
            assert [f["type"] for f in frames].count("done") == 1
            seqs = [f["seq"] for f in frames if f["type"] == "delta"]
            assert seqs == list(range(1, len(seqs) + 1))
            assert tokens(frames) == [[10 + i, 20 + i][k % 2] for k in range(n)]
    assert gw.inflight_total == 0


async def test_cancel_ends_with_one_cancelled_done_then_unknown_id() -> None:
    gw = gateway()
    async with connect(gw) as c:
        c.client.send(gen("a", 10_000))
        await until(lambda: any(f["type"] == "delta" for f in c.of("a")), "a delta")
        c.client.send({"type": "cancel", "id": "a"})
        await until(lambda: c.done("a"), "done")
        c.client.send({"type": "cancel", "id": "a"})
        await until(lambda: c.of("a")[-1]["type"] == "error", "unknown_id")
        frames = c.of("a")
        assert frames[-2]["type"] == "done" and frames[-2]["status"] == "cancelled"
        assert frames[-1]["code"] == "unknown_id"
        assert [f["type"] for f in frames].count("done") == 1
    assert gw.inflight_total == 0


async def test_a_blocked_sink_drains_merged_frames_in_order() -> None:
    gw = gateway()
    engine: FakeEngine = gw.engine  # type: ignore[assignment]
    async with connect(gw) as c:
        c.sink.block()
        c.client.send(gen("a", 6))
        await until(lambda: "a" in c.session.streams.live and not engine.streams,
                    "the engine to finish")
        assert c.sink.state is SocketState.DRAINING and not c.of("a")
        assert not c.session.sender.idle and not c.session.idle
        c.sink.unblock()
        await until(lambda: c.done("a"), "done")
        frames = c.of("a")
        deltas = [f for f in frames if f["type"] == "delta"]
        assert frames[0]["type"] == "start" and frames[-1]["type"] == "done"
        assert tokens(frames) == [5, 6, 7, 5, 6, 7]
        assert len(deltas) < 6  # the steps that queued up went as one delta
        assert [d["seq"] for d in deltas] == list(range(1, len(deltas) + 1))
        assert c.sink.states == [SocketState.DRAINING, SocketState.OPEN]
        await until(lambda: c.session.idle, "idle")


async def test_control_frames_keep_their_place_behind_a_blocked_send() -> None:
    gw = gateway()
    async with connect(gw) as c:
        c.sink.block()
        c.client.send({"type": "ping", "t": 1})
        c.client.send(gen("a", 2))
        c.client.send({"type": "ping", "t": 2})
        await until(lambda: len(c.session.sender.queue) >= 2, "frames queued")
        c.sink.unblock()
        await until(lambda: c.done("a") and len(c.sink.frames) >= 6, "everything")
        kinds = [(f["type"], f.get("t")) for f in c.sink.frames[1:]]
        assert kinds[0] == ("pong", 1) and ("pong", 2) in kinds
        assert kinds.index(("start", None)) < kinds.index(("done", None))


async def test_a_sink_that_dies_mid_stream_parks_the_request_for_a_resume() -> None:
    gw = gateway()
    engine: FakeEngine = gw.engine  # type: ignore[assignment]
    async with connect(gw) as c:
        sid = c.session.session_id
        c.client.send(gen("a", 40))
        await until(lambda: len(tokens(c.of("a"))) >= 2, "two tokens")
        c.sink.die()
        await until(lambda: c.sink.state is SocketState.GONE, "the sink gone")
        got = c.of("a")
        c.client.drop()
        await asyncio.wait_for(c.task, 5)
    assert gw.parked.count == 1 and any(op == "park" for op, _ in engine.calls)
    after = max(f["seq"] for f in got if f["type"] == "delta")
    async with connect(gw) as c2:
        c2.client.send({"type": "resume", "id": "a", "after_seq": after, "session_id": sid})
        await until(lambda: c2.done("a"), "done after the resume")
        frames = c2.of("a")
        assert frames[0] == {"type": "resumed", "id": "a", "after_seq": after}
        assert [f["type"] for f in frames].count("done") == 1
        assert tokens(got) + tokens(frames) == [[5, 6, 7][k % 3] for k in range(40)]
        seqs = [f["seq"] for f in frames if f["type"] == "delta"]
        assert seqs == list(range(after + 1, after + 1 + len(seqs)))
        assert gw.parked.count == 0 and gw.inflight_total == 0
    # its done was written just now: the second drop keeps it resumable for a while
    assert gw.parked.count == 1 and gw.inflight_total == 0
    gw.parked.expire_all()
    assert gw.parked.count == 0


async def test_a_drop_with_resume_off_aborts_everything() -> None:
    gw = gateway(resume_grace=0)
    engine: FakeEngine = gw.engine  # type: ignore[assignment]
    async with connect(gw) as c:
        c.client.send(gen("a", 10_000))
        c.client.send(gen("b", 10_000))
        await until(lambda: len(c.session.streams.live) == 2, "two streams")
        c.client.drop()
        await asyncio.wait_for(c.task, 5)
    assert sorted(op for op, _ in engine.calls) == ["abort", "abort"]
    assert gw.parked.count == 0 and gw.inflight_total == 0
    assert c.session.closing and c.session.closed.is_set()


async def test_a_client_that_stops_reading_is_failed_as_a_slow_consumer() -> None:
    gw = gateway(slow_consumer_timeout=0.2)
    async with connect(gw) as c:
        c.client.send(gen("a", 10_000))
        await until(lambda: bool(c.of("a")), "a frame")
        c.sink.block()
        await until(lambda: any(op == "abort" for op, _ in gw.engine.calls),  # type: ignore[attr-defined]
                    "the watchdog's abort")
        c.sink.unblock()
        await until(lambda: c.done("a"), "done")
        frames = c.of("a")
        assert frames[-2]["type"] == "error" and frames[-2]["code"] == "slow_consumer"
        assert frames[-1]["status"] == "failed"
    assert gw.inflight_total == 0


async def test_bad_messages_are_answered_and_the_socket_stays_open() -> None:
    gw = gateway(max_inflight_per_connection=1)
    async with connect(gw) as c:
        c.client.send({"type": "nope", "id": "x"})
        c.client.send(gen("a", 10_000))
        c.client.send(gen("a", 3))
        c.client.send(gen("b", 3))
        await until(lambda: len([f for f in c.sink.frames if f["type"] == "error"]) == 3,
                    "three errors")
        errors = [(f["code"], f.get("id")) for f in c.sink.frames if f["type"] == "error"]
        assert errors == [("invalid_request", "x"), ("duplicate_id", "a"),
                          ("too_many_inflight", "b")]
        c.client.send({"type": "ping", "t": 9})
        await until(lambda: {"type": "pong", "t": 9} in c.sink.frames, "pong")

"""The parts that let another replica follow and carry on a running stream
(service/live_record.py, service/responses_api.py, service/sse_resume.py): the Writer
rebuilt from recorded events; the live record's ownership on a real Redis (one owner; a
taker only once the owner's heartbeat has lapsed; an owner that lost the record stops
writing to it); a failed write showing every event; a follower elsewhere keeping a
stream alive past its grace; stored responses' per-tenant share. The whole path, with a
replica killed mid-stream, is in tests/test_replicas_resume.py."""

from __future__ import annotations

import copy
import time

import pytest

from service.chat_turn import ReasoningDelta, TextDelta
from service.live_record import ALIVE_TTL, TAKE, LiveRecord
from service.responses_api import LIVE_PREFIX, ResponseStore, Run, Writer, _snapshot
from service.shared_state import SharedState
from tests.servers import RedisServer, apoll


def _run() -> Run:
    return Run({"id": "resp_1", "status": "in_progress", "output": [], "store": True},
               "tenant", [])


def test_a_writer_replayed_from_events_carries_on_as_the_original() -> None:
    """A run's events, replayed into a fresh copy of its first object, give the same
    output and open item: the same deltas then make the same events (ids and all)."""
    run = _run()
    start = _snapshot(run.response)
    run.emit("response.created", {"response": _snapshot(run.response)})
    run.emit("response.in_progress", {"response": _snapshot(run.response)})
    writer = Writer(run)
    for e in (ReasoningDelta("let me "), ReasoningDelta("think"), TextDelta("The answer"),
              TextDelta(" is")):
        writer.add(e)
    again = Run(copy.deepcopy(start), "tenant", [], events=list(run.events))
    replayed = Writer.replayed(again)
    assert again.response["output"] == run.response["output"]
    assert replayed.item is again.response["output"][-1]  # the message is still open
    for w in (writer, replayed):
        w.add(TextDelta(" 42."))
        w.close()
    assert again.events == run.events
    assert again.response["output"][-1]["content"][0]["text"] == "The answer is 42."


def test_one_tenant_cannot_push_out_another_tenants_stored_responses() -> None:
    """Past its share (a quarter of the count and of the bytes) a tenant's own oldest
    ended responses go, not another tenant's; running ones are never dropped."""
    def ended(rid: str, tenant: str, size: int = 10) -> Run:
        return Run({"id": rid}, tenant, [], ended_at=time.monotonic(), size=size)

    store = ResponseStore(max_stored=8, max_bytes=400)  # a tenant: 2 responses, 100 bytes
    for rid in ("b1", "b2"):
        store.add(ended(rid, "b"))
    running = Run({"id": "a0"}, "a", [])
    store.add(running)
    for i in range(1, 6):
        store.add(ended(f"a{i}", "a"))
    assert list(store._runs) == ["b1", "b2", "a0", "a5"]
    store.add(ended("b3", "b", size=95))  # b over its 100 bytes: its oldest go
    assert list(store._runs) == ["a0", "a5", "b3"]


@pytest.fixture
def shared(redis_server):  # noqa: ANN001, ANN201 - a RedisServer
    return SharedState(redis_server.url, 2.0)


async def test_the_live_record_has_one_owner_and_changes_hands_only_when_it_lapses(
        shared: SharedState) -> None:
    run = _run()
    owner = LiveRecord(shared, LIVE_PREFIX, run.id, "replica-a", 600)
    assert await owner.open({"tenant": "tenant"})
    owner.beat.cancel()  # (heartbeats by hand below)
    run.shown = 0  # (as start() has it: followers get what is recorded)
    run.emit("response.created", {"response": {}})
    owner.record(run.events, [5, 6], 0, run.show)
    assert run.shown == 0  # not yet written
    await apoll(lambda: run.shown == 1, 10, "the step written")
    assert owner.tokens == 2
    keys = [owner.key(":owner"), owner.key(":alive")]
    # alive: nobody takes it
    assert await shared.run_script(TAKE, keys, ["replica-b", ALIVE_TTL]) == 0
    await shared.delete(owner.key(":alive"))  # (its heartbeat lapsed)
    assert await shared.run_script(TAKE, keys, ["replica-b", ALIVE_TTL]) == 1
    assert await shared.run_script(TAKE, keys, ["replica-c", ALIVE_TTL]) == 0  # one taker
    # the old owner's next step is refused; its events still go out (shown), unrecorded
    run.emit("response.in_progress", {"response": {}})
    owner.record(run.events, [5, 6, 7], 0, run.show)
    await apoll(lambda: not owner.owned, 10, "the step refused")
    assert run.shown == -1  # (every event goes out as it comes now)
    steps = await shared.get_with_list(owner.key(), owner.key(":steps"))
    assert steps is not None and steps[1] == [[[run.events[0]], [5, 6], 0]]
    assert await shared.client.get(owner.key(":owner")) == b"replica-b"
    await owner.close()  # not the owner: B's record stays
    assert await shared.exists(owner.key()) is True
    await shared.client.aclose()


async def test_a_write_that_fails_breaks_the_record_and_shows_everything() -> None:
    """Redis gone mid-stream: the step is not recorded, the record is marked broken (it
    will end at that gap), and the stream's followers get every event as it comes."""
    redis = RedisServer().start()
    shared = SharedState(redis.url, 0.5)
    try:
        run = _run()
        live = LiveRecord(shared, LIVE_PREFIX, run.id, "replica-a", 600)
        assert await live.open({"tenant": "tenant"})
        run.shown = 0
        run.emit("response.created", {"response": {}})
        live.record(run.events, [1], 0, run.show)
        await apoll(lambda: run.shown == 1, 10, "the first step written")
        redis.stop()
        run.emit("response.in_progress", {"response": {}})
        live.record(run.events, [1, 2], 0, run.show)
        await apoll(lambda: live.broken, 10, "the failed write seen")
        assert run.shown == -1 and live.owned  # (its beat ends the record at the gap)
        live.release()
    finally:
        redis.stop()
        await shared.client.aclose()


async def test_a_stream_followed_on_another_replica_outlives_its_grace(
        shared: SharedState) -> None:
    """A resumable stream whose client left runs on past its grace while a follower on
    another replica reads its live record (each read marks it watched), and stops a
    grace after the reads stop."""
    import asyncio

    from service.config import Limits
    from service.sse_resume import RECORD_PREFIX, SseStreams

    streams = SseStreams(Limits(resume_grace=0.3), shared)
    hold = asyncio.Event()

    async def endless():  # noqa: ANN202 - an event source that waits
        yield "data: {}\n\n", 1
        await hold.wait()

    live = streams.live("chatcmpl-w")
    assert await live.open({"tenant": ""})
    s = streams.start("chatcmpl-w", "", endless(), live, lambda: [7])
    async for _ in streams.follow(s, -1):
        break  # its client leaves after the first event: the grace starts
    elsewhere = LiveRecord(shared, RECORD_PREFIX, "chatcmpl-w", "replica-b", 60)
    for _ in range(12):  # 1.2 s of reads, four graces
        assert (await elsewhere.read(0)) is not None
        await asyncio.sleep(0.1)
    assert not s.task.done()  # kept running for the follower elsewhere
    await apoll(lambda: s.task.done(), 10, "the stream stopped once nobody read it")
    assert s.ended or (await apoll(lambda: s.ended, 10, "its end recorded"))
    await shared.client.aclose()

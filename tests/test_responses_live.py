"""The parts that let another replica carry on a running Response
(service/responses_api.py): the Writer rebuilt from recorded events, and the live
record's ownership on a real Redis (one owner; a taker only once the owner's heartbeat
has lapsed; an owner that lost the record stops writing to it). The whole path, with a
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
def shared():
    redis = RedisServer().start()
    try:
        yield SharedState(redis.url, 2.0)
    finally:
        redis.stop()


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

"""engine/outbox.py: step outputs from a thread to the loop, one wake-up, in order."""

from __future__ import annotations

import asyncio
import gc
import threading

from engine.outbox import Outbox
from engine.outputs import StepOutput


def _out(rid: str) -> StepOutput:
    return StepOutput(request_id=rid, new_token_ids=[1])


async def test_lists_published_by_a_thread_are_delivered_on_the_loop_in_order() -> None:
    loop = asyncio.get_running_loop()
    got: list[tuple[list[str], bool, bool]] = []  # (ids, on the loop thread, gc on)
    done = asyncio.Event()

    def deliver(outs: list[StepOutput]) -> None:
        got.append(([o.request_id for o in outs],
                    threading.current_thread() is threading.main_thread(), gc.isenabled()))
        if len(got) == 3:
            done.set()

    box = Outbox(loop, deliver)

    def engine_thread() -> None:
        for rid in ("a", "b", "c"):
            box.publish([_out(rid)])
        box.publish([])  # nothing to send: no wake-up, no delivery

    t = threading.Thread(target=engine_thread)
    t.start()
    await asyncio.wait_for(done.wait(), 5)
    t.join()
    box.close()
    assert [ids for ids, _, _ in got] == [["a"], ["b"], ["c"]]
    assert all(on_loop for _, on_loop, _ in got)
    assert not any(collecting for _, _, collecting in got)  # no gc inside a fan-out
    assert box.closed


async def test_the_hand_off_waits_until_the_woken_tasks_have_run() -> None:
    """wait_taken returns once the loop has delivered and run what the delivery woke
    (a writer task here); it times out when the loop does not take the outputs."""
    loop = asyncio.get_running_loop()
    order: list[str] = []
    woken = asyncio.Event()

    async def writer() -> None:
        await woken.wait()
        order.append("written")

    box = Outbox(loop, lambda outs: woken.set())
    task = asyncio.create_task(writer())
    await asyncio.sleep(0)  # the writer waits

    def engine_thread() -> None:
        box.publish([_out("a")])
        order.append(f"taken={box.wait_taken(5.0)}")

    t = threading.Thread(target=engine_thread)
    t.start()
    await asyncio.to_thread(t.join)
    await task
    assert order == ["written", "taken=True"]
    box.close()
    box.publish([_out("late")])  # after close: the wake-up is lost, nothing raises
    assert not box.wait_taken(0.01)

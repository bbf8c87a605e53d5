"""engine/engine_thread.py: the inbox, the step pipeline and the hand-off, over a fake
LLMEngine that records which thread calls it (no model)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.engine_thread import Add, Control, EngineThread, Stop
from engine.outbox import Outbox
from engine.outputs import StepOutput
from engine.progress import LoadProgress
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats


class FakeEngine:
    """Each added request produces one token per step and finishes after `steps`."""

    def __init__(self, steps: int = 2) -> None:
        self.steps = steps
        self.left: dict[str, int] = {}
        self.calls: list[tuple[str, int]] = []  # (method, thread ident)
        self.num_steps = 0
        self.closed = False

    def __getattribute__(self, name: str) -> Any:
        attr = object.__getattribute__(self, name)
        if callable(attr) and not name.startswith("_"):
            object.__getattribute__(self, "calls").append((name, threading.get_ident()))
        return attr

    def stats(self, adds_taken: int = 0) -> EngineStats:
        return EngineStats(step=self.num_steps, running=len(self.left), adds_taken=adds_taken)

    def has_unfinished(self) -> bool:
        return bool(self.left)

    def warm_up(self) -> float:
        return 0.0

    def add(self, req: Request) -> list[StepOutput]:
        if req.request_id in self.left:
            raise ValueError(f"request {req.request_id!r} is in flight")
        self.left[req.request_id] = self.steps
        return []

    def abort(self, ids: list[str], status: Any = None) -> list[StepOutput]:
        return [StepOutput(request_id=i, new_token_ids=[], finished=True,
                           finish_reason="abort") for i in ids if self.left.pop(i, None)]

    def park(self, ids: list[str]) -> int:
        raise KeyError("injected")  # a fault in one request's control: it fails alone

    def fail(self, rid: str, error: str) -> list[StepOutput]:
        self.left.pop(rid, None)
        return [StepOutput(request_id=rid, new_token_ids=[], finished=True,
                           finish_reason="error", error=error)]

    def step(self, publish: Any = None, launched: Any = None) -> list[StepOutput]:
        self.num_steps += 1
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            outs.append(StepOutput(request_id=rid, new_token_ids=[self.num_steps],
                                   finished=done, finish_reason="length" if done else None))
            if done:
                del self.left[rid]
        if publish is not None:
            publish(outs)
        return outs

    def request_ids(self) -> list[str]:
        return list(self.left)

    def close(self) -> None:
        self.closed = True

    @property
    def runner(self) -> Any:
        return type("Runner", (), {"overlaps": False})()


def _request(rid: str) -> Request:
    return Request(rid, [1, 2], SamplingParams(max_tokens=4))


async def _run(commands: list[Any], fake: FakeEngine, until: int) -> tuple[
        EngineThread, threading.Thread, list[StepOutput]]:
    """Start a thread over `fake`, send `commands`, collect outputs until `until`
    have arrived, then stop it."""
    loop = asyncio.get_running_loop()
    got: list[StepOutput] = []
    enough = asyncio.Event()

    def deliver(outs: list[StepOutput]) -> None:
        got.extend(outs)
        if len(got) >= until:
            enough.set()

    box = Outbox(loop, deliver)
    et = EngineThread(EngineConfig(), LoadProgress(), handoff=0.0, build=lambda c, p: fake)
    for cmd in commands:  # queued before the thread starts: its first drain takes all
        et.put(cmd)
    loaded: asyncio.Future[None] = loop.create_future()
    thread = et.start(loop, box, loaded, on_death=lambda message: None)
    await loaded
    await asyncio.wait_for(enough.wait(), 5)
    et.put(Stop())
    await asyncio.to_thread(thread.join)
    box.take()
    box.close()
    return et, thread, got


async def test_only_the_engine_thread_calls_the_engine() -> None:
    fake = FakeEngine(steps=2)
    et, thread, got = await _run([Add(_request("a")), Add(_request("b"))], fake, until=4)
    assert {ident for _, ident in fake.calls} == {thread.ident}
    assert {"add", "step", "stats", "close"} <= {name for name, _ in fake.calls}
    assert [(o.request_id, o.finished) for o in got] == [
        ("a", False), ("b", False), ("a", True), ("b", True)]
    assert et.adds_taken == 2 and et.stats.adds_taken == 2 and et.dead is None
    assert fake.closed


async def test_a_duplicate_add_and_a_failing_control_fail_their_request_alone() -> None:
    fake = FakeEngine(steps=50)
    cmds = [Add(_request("a")), Add(_request("a")), Control("park", "a"),
            Add(_request("b")), Control("abort", "b")]
    et, _, got = await _run(cmds, fake, until=3)
    assert [(o.request_id, o.finish_reason) for o in got] == [
        ("a", "error"), ("a", "error"), ("b", "abort")]
    assert got[0].error == "request 'a' is in flight"
    assert got[1].error == "internal error while park this request (KeyError); see the server log"
    assert et.dead is None and et.adds_taken == 3


async def test_a_step_that_raises_marks_the_thread_dead_and_tells_the_loop() -> None:
    fake = FakeEngine()
    fake.step = lambda publish=None, launched=None: (_ for _ in ()).throw(  # type: ignore[method-assign]
        RuntimeError("broken"))
    loop = asyncio.get_running_loop()
    died: asyncio.Future[str] = loop.create_future()
    box = Outbox(loop, lambda outs: None)
    et = EngineThread(EngineConfig(), LoadProgress(), handoff=0.0, build=lambda c, p: fake)
    loaded: asyncio.Future[None] = loop.create_future()
    thread = et.start(loop, box, loaded, on_death=died.set_result)
    await loaded
    et.put(Add(_request("a")))
    message = await asyncio.wait_for(died, 5)
    await asyncio.to_thread(thread.join)
    box.close()
    assert isinstance(et.dead, RuntimeError) and "broken" in message


async def test_a_build_that_fails_is_raised_to_the_starter() -> None:
    def build(config: EngineConfig, progress: LoadProgress) -> Any:
        raise FileNotFoundError("no model")

    loop = asyncio.get_running_loop()
    box = Outbox(loop, lambda outs: None)
    et = EngineThread(EngineConfig(), LoadProgress(), handoff=0.0, build=build)
    loaded: asyncio.Future[None] = loop.create_future()
    thread = et.start(loop, box, loaded, on_death=lambda message: None)
    with pytest.raises(FileNotFoundError):
        await loaded
    await asyncio.to_thread(thread.join)
    box.close()

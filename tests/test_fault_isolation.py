"""Fault isolation on the engine thread: a fault in one request's own work (adding it,
sampling it, detokenizing it, a control command) fails that request alone, frees its
blocks, and every other request and the engine go on. A fault in the shared forward
fails that batch only; the engine gives up (dead) only after MAX_STEP_FAULTS in a row."""

from __future__ import annotations

import asyncio

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.llm_engine import MAX_STEP_FAULTS
from tests.conftest import random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# a request that carries this top_k is the one whose sampling the tests make raise
MARKED = SamplingParams(max_tokens=12, temperature=1.0, top_k=13, ignore_eos=True, seed=1)


def config(path) -> EngineConfig:  # noqa: ANN001
    return EngineConfig(model=str(path), dtype="float32", debug=True,
                        cache=CacheConfig(block_size=4),
                        scheduler=SchedulerConfig(max_num_batched_tokens=64))


async def collect(engine: AsyncEngine, prompt, params: SamplingParams, rid: str):  # noqa: ANN001
    return [o async for o in engine.generate(prompt, params, rid)]


async def settled(engine: AsyncEngine, timeout: float = 10.0) -> None:
    """Until a published snapshot shows nothing running and no block in use."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.stats.running or engine.stats.waiting or engine.stats.kv_usage:
        assert loop.time() < deadline, engine.stats
        await asyncio.sleep(0.01)


def check_failed_alone(outs, phase: str) -> None:  # noqa: ANN001
    assert outs[-1].finished and outs[-1].finish_reason == "error", outs[-1]
    assert f"while {phase} this request" in outs[-1].error
    assert [o.finished for o in outs].count(True) == 1


async def test_a_sampling_fault_fails_that_request_alone(tiny_models) -> None:
    path = tiny_models("llama", 0)
    prompts = random_prompts(4, 6, 20, 320, seed=5)
    want = [o.token_ids for o in LLM(model=str(path), dtype="float32").generate(prompts, GREEDY)]
    engine = AsyncEngine(config(path))
    await engine.start()
    try:
        sampler = engine.engine.runner.sampler
        real = sampler.process

        def process(logits, batch):  # noqa: ANN001, ANN202
            if any(p.top_k == 13 for p in batch.params):
                raise OverflowError("injected: this request's parameters")
            return real(logits, batch)

        sampler.process = process  # type: ignore[method-assign]
        results = await asyncio.gather(collect(engine, prompts[0], MARKED, "bad"),
                                       *(collect(engine, p, GREEDY, f"r{i}")
                                         for i, p in enumerate(prompts)))
        check_failed_alone(results[0], "sampling")
        assert "OverflowError" in results[0][-1].error
        for outs, w in zip(results[1:], want):  # the bystanders, token for token
            assert outs[-1].finish_reason == "length" and outs[-1].token_ids == w
        assert engine.dead is None
        await settled(engine)
        engine.engine.kv.check_integrity()
        again = await collect(engine, prompts[1], GREEDY, "after")
        assert again[-1].token_ids == want[1]
    finally:
        await engine.shutdown()


async def test_a_detokenizer_fault_fails_that_request_alone(tiny_chat_model, monkeypatch) -> None:
    real = IncrementalDetokenizer.push

    def push(self, new_ids, final=False):  # noqa: ANN001, ANN202
        if "@@boom@@" in self.stop:
            raise MemoryError("injected: this request's stop strings")
        return real(self, new_ids, final)

    monkeypatch.setattr(IncrementalDetokenizer, "push", push)
    engine = AsyncEngine(config(tiny_chat_model))
    await engine.start()
    try:
        bad = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=["@@boom@@"])
        ok = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=["never"])
        results = await asyncio.gather(collect(engine, "Hello there", bad, "bad"),
                                       collect(engine, "Hello there", ok, "ok"),
                                       collect(engine, "Another one", GREEDY, "plain"))
        check_failed_alone(results[0], "detokenizing")
        assert results[1][-1].finish_reason == "length" and len(results[1][-1].token_ids) == 8
        assert results[2][-1].finish_reason == "length"
        assert engine.dead is None
        await settled(engine)
    finally:
        await engine.shutdown()


async def test_a_fault_while_adding_fails_that_request_alone(tiny_models) -> None:
    engine = AsyncEngine(config(tiny_models("llama", 0)))
    await engine.start()
    try:
        eng = engine.engine
        life = eng.lifecycle
        real = life._add

        def add_once(req):  # noqa: ANN001, ANN202
            life._add = real  # type: ignore[method-assign]
            real(req)  # half-registered, then the fault
            raise KeyError("injected")

        life._add = add_once  # type: ignore[method-assign]
        n3 = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=3)
        outs = await collect(engine, [5, 6, 7, 8, 9], n3, "bad")
        assert outs[-1].finished and [o.finished for o in outs].count(True) == 1
        assert [c.finish_reason for c in outs[-1].outputs] == ["error"] * 3
        assert "while adding this request" in outs[-1].error
        await settled(engine)
        eng.kv.check_integrity()
        ok = await collect(engine, [5, 6, 7, 8, 9], n3, "bad")  # its id is free again
        assert ok[-1].finished and all(len(c.token_ids) == 4 for c in ok[-1].outputs)
        assert engine.dead is None
    finally:
        await engine.shutdown()


async def test_a_forward_fault_fails_its_batch_and_the_engine_recovers(tiny_models) -> None:
    path = tiny_models("llama", 0)
    prompts = random_prompts(3, 6, 12, 320, seed=9)
    engine = AsyncEngine(config(path))
    await engine.start()
    try:
        runner = engine.engine.runner
        real = runner.execute
        faults = [1]  # the next call raises, once

        def execute(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            if faults[0]:
                faults[0] -= 1
                raise RuntimeError("injected: the forward failed")
            return real(*args, **kw)

        runner.execute = execute
        results = await asyncio.gather(*(collect(engine, p, GREEDY, f"r{i}")
                                         for i, p in enumerate(prompts)))
        failed = [r for r in results if r[-1].finish_reason == "error"]
        assert failed, "the faulty step's batch fails"
        assert all("model step (RuntimeError)" in r[-1].error for r in failed)
        assert all(r[-1].finish_reason in ("error", "length") for r in results)
        assert engine.dead is None
        await settled(engine)
        engine.engine.kv.check_integrity()
        ok = await collect(engine, prompts[0], GREEDY, "after")  # new requests are served
        assert ok[-1].finish_reason == "length" and len(ok[-1].token_ids) == 12

        faults[0] = 10**9  # a broken model: every step raises
        for i in range(MAX_STEP_FAULTS):
            outs = await collect(engine, prompts[0], GREEDY, f"broken{i}")
            assert outs[-1].finish_reason == "error"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while engine.dead is None:
            assert loop.time() < deadline
            await asyncio.sleep(0.01)
    finally:
        await engine.shutdown()


async def test_a_fault_in_a_control_command_fails_that_request_alone(tiny_models) -> None:
    engine = AsyncEngine(config(tiny_models("llama", 0)))
    await engine.start()
    try:
        eng = engine.engine

        def park(ids):  # noqa: ANN001, ANN202
            raise ValueError("injected: park")

        eng.park = park
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        stream = engine.add_request([5, 6, 7], long, "parked")
        other = asyncio.ensure_future(collect(engine, [8, 9, 10], GREEDY, "other"))
        first = await stream.__anext__()
        assert not first.finished
        engine.park("parked")
        outs = [first] + [o async for o in stream]
        check_failed_alone(outs, "park")
        assert (await other)[-1].finish_reason == "length"
        assert engine.dead is None
        await settled(engine)
    finally:
        await engine.shutdown()


async def test_a_fault_while_scheduling_one_request_fails_it_alone(tiny_models) -> None:
    path = tiny_models("llama", 0)
    prompts = random_prompts(3, 6, 20, 320, seed=13)
    want = [o.token_ids for o in LLM(model=str(path), dtype="float32").generate(prompts, GREEDY)]
    engine = AsyncEngine(config(path))
    await engine.start()
    try:
        kv = engine.engine.kv
        real = kv.get_computed_blocks

        def lookup(req):  # noqa: ANN001, ANN202
            if req.params.seed == 77:
                raise RuntimeError("injected: this request's prefix lookup")
            return real(req)

        kv.get_computed_blocks = lookup
        bad = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=77)
        results = await asyncio.gather(collect(engine, prompts[0], bad, "bad"),
                                       *(collect(engine, p, GREEDY, f"r{i}")
                                         for i, p in enumerate(prompts)))
        check_failed_alone(results[0], "scheduling")
        for outs, w in zip(results[1:], want):
            assert outs[-1].finish_reason == "length" and outs[-1].token_ids == w
        assert engine.dead is None
        await settled(engine)
        engine.engine.kv.check_integrity()
    finally:
        await engine.shutdown()

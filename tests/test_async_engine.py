"""AsyncEngine over a real engine thread: streams, per-step publishing, abort, stats."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from tests.conftest import random_prompts

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def config(path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", debug=True,
                        cache=CacheConfig(block_size=4),
                        scheduler=SchedulerConfig(max_num_batched_tokens=32), **kw)


async def collect(engine: AsyncEngine, prompt, params, rid: str):
    outs = [o async for o in engine.generate(prompt, params, rid)]
    return outs


async def test_concurrent_streams_match_offline(tiny_models) -> None:
    path = tiny_models("llama", 0)
    prompts = random_prompts(5, 5, 40, 320, seed=21)
    want = [o.token_ids for o in LLM(model=str(path), dtype="float32").generate(prompts, GREEDY)]
    engine = AsyncEngine(config(path))
    calls = 0
    dispatch = engine._dispatch

    def counting(outs):  # noqa: ANN001, ANN202 - one call per published output list
        nonlocal calls
        calls += 1
        return dispatch(outs)

    engine._dispatch = counting  # type: ignore[method-assign]
    await engine.start()
    try:
        results = await asyncio.gather(*(collect(engine, p, GREEDY, f"r{i}")
                                         for i, p in enumerate(prompts)))
    finally:
        await engine.shutdown()
    for outs, w in zip(results, want):
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in outs) == 16
        assert outs[-1].token_ids == w
        assert [o.finished for o in outs].count(True) == 1
    steps = engine.engine.num_steps
    assert 0 < calls <= steps  # one publish per step at most, never one per token
    assert calls < sum(len(w) for w in want)


async def test_abort_frees_blocks_within_one_step(tiny_models) -> None:
    path = tiny_models("llama", 0)
    engine = AsyncEngine(config(path))
    await engine.start()
    eng = engine.engine
    try:
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        prompt = random_prompts(1, 30, 30, 320, seed=22)[0]
        seen = 0
        async for out in engine.generate(prompt, long, "long"):
            seen += len(out.new_token_ids)
            if seen >= 3:
                steps_at_abort = eng.num_steps
                break  # leaving the iterator aborts
        for _ in range(200):
            if eng.kv.num_free_blocks == eng.num_blocks:
                break
            await asyncio.sleep(0.005)
        assert eng.kv.num_free_blocks == eng.num_blocks
        assert eng.num_steps - steps_at_abort <= 1
        assert not eng.has_unfinished()
        # The engine keeps serving after an abort.
        outs = await collect(engine, prompt, GREEDY, "after")
        assert outs[-1].finished and len(outs[-1].token_ids) == 16
    finally:
        await engine.shutdown()


async def test_explicit_abort_ends_stream_with_abort(tiny_models) -> None:
    path = tiny_models("llama", 0)
    engine = AsyncEngine(config(path))
    await engine.start()
    try:
        stream = engine.add_request([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True),
                                    "x")
        first = await stream.__anext__()
        assert not first.finished
        engine.abort("x")
        last = first
        async for out in stream:
            last = out
        assert last.finished and last.finish_reason == "abort"
    finally:
        await engine.shutdown()


async def test_bad_requests_raise_before_queueing(tiny_models) -> None:
    path = tiny_models("llama", 0)
    engine = AsyncEngine(config(path, max_model_len=64))
    await engine.start()
    try:
        with pytest.raises(ValueError, match="context window"):
            engine.add_request(list(range(3, 60)), SamplingParams(max_tokens=10))
        with pytest.raises(ValueError, match="no tokenizer"):
            engine.add_request("text prompt", GREEDY)
        with pytest.raises(ValueError, match="prompt_token_ids"):
            engine.add_request([5, 99999], GREEDY)
        engine.add_request([5, 6], GREEDY, "dup")
        with pytest.raises(ValueError, match="duplicate"):
            engine.add_request([5, 6], GREEDY, "dup")
    finally:
        await engine.shutdown()
    with pytest.raises(RuntimeError):
        engine.add_request([5, 6], GREEDY)


async def test_n_samples_stream_until_all_finish(tiny_models) -> None:
    path = tiny_models("llama", 0)
    engine = AsyncEngine(config(path))
    await engine.start()
    try:
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=3, ignore_eos=True)
        outs = [o async for o in engine.generate([5, 6, 7, 8, 9], params, "n3")]
        assert outs[-1].finished and [o.finished for o in outs].count(True) == 1
        assert {o.index for o in outs} == {0, 1, 2}
        assert all(len(c.token_ids) == 10 for c in outs[-1].outputs)
        per_index = {i: sum(len(o.new_token_ids) for o in outs if o.index == i) for i in range(3)}
        assert per_index == {0: 10, 1: 10, 2: 10}
    finally:
        await engine.shutdown()


async def test_a_request_the_engine_refuses_fails_alone(tiny_models) -> None:
    path = tiny_models("llama", 0)
    engine = AsyncEngine(config(path))
    await engine.start()
    try:
        real_add = engine.engine.add

        def refuse_once(req):
            engine.engine.add = real_add
            raise ValueError("refused")

        engine.engine.add = refuse_once
        outs = [o async for o in engine.generate([5, 6], GREEDY, "refused")]
        assert outs[-1].finished and outs[-1].finish_reason == "error"
        assert outs[-1].error == "refused"
        ok = [o async for o in engine.generate([5, 6], GREEDY, "next")]  # thread still alive
        assert ok[-1].finish_reason == "length" and engine.dead is None
    finally:
        await engine.shutdown()


async def test_a_model_that_fails_to_load_raises_and_releases_the_wake_socket(tmp_path) -> None:
    engine = AsyncEngine(EngineConfig(model=str(tmp_path / "missing")))
    with pytest.raises(FileNotFoundError):
        await engine.start()
    assert not engine.running
    assert engine._outbox is not None and engine._outbox.closed  # closed, unwatched
    await engine.shutdown()  # a no-op, not an error


@pytest.mark.parametrize("backend", [
    pytest.param("triton-interpret", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a GPU is present: the cuda case runs")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("async_output", [True, False])
async def test_async_output_sends_a_step_once_the_next_decode_graph_runs(
        tiny_models, async_output: bool, backend: str) -> None:
    """On the decode-graph path (the Triton interpreter here; captured graphs on a GPU),
    async_output publishes a step's outputs once the next step's graph is launched, so
    that the loop's fan-out overlaps the GPU; without it they go out before the next
    step starts. A request's last output goes out at once (no next step to wait for).
    The streams are the same either way, and equal the CPU backend's."""
    path = tiny_models("llama", 0)
    prompts = random_prompts(2, 6, 6, 320, seed=23)  # prefilled together in the first step
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(model=str(path), dtype="float32").generate(prompts, params)]
    engine = AsyncEngine(config(path, attention_backend=backend, async_output=async_output))
    await engine.start()
    graphs = engine.engine.runner.graphs
    replays = 0
    sent: dict[str, int] = {}
    seen: list[tuple[int, int, bool]] = []  # (tokens sent so far, replays then, finished)
    run, publish = graphs.run, engine._engine_thread._publish

    def counting_run(*args):  # noqa: ANN002, ANN202 - both wrappers run on the engine thread
        nonlocal replays
        replays += 1
        return run(*args)

    def recording_publish(outs) -> None:  # noqa: ANN001
        for o in outs:
            sent[o.request_id] = sent.get(o.request_id, 0) + len(o.new_token_ids)
            seen.append((sent[o.request_id], replays, o.finished))
        publish(outs)

    graphs.run = counting_run
    engine._engine_thread._publish = recording_publish  # type: ignore[method-assign]
    try:
        results = await asyncio.gather(*(collect(engine, p, params, f"g{i}")
                                         for i, p in enumerate(prompts)))
    finally:
        await engine.shutdown()
    assert [outs[-1].token_ids for outs in results] == want
    assert replays == 5  # one prefill step, then 5 decode steps from the graph path
    assert len(seen) == 12
    lag = 0 if async_output else 1
    for tokens, replays_then, finished in seen:
        # token t (t >= 2) comes from replay t - 1, the first from the eager prefill step
        assert replays_then == (tokens - 1 if finished else tokens - lag), seen


def test_cumulative_text_is_kept_as_deltas_and_joined_when_read() -> None:
    """RequestOutput.apply appends a step's text without rebuilding the whole string;
    reading `text` joins it (once: later reads only join what came after)."""
    from engine.outputs import CompletionOutput, RequestOutput, StepOutput

    out = RequestOutput("r", [1, 2], [CompletionOutput(0), CompletionOutput(1)])
    pieces = ["Hel", "", "lo", " wörld", "🌊"]
    for i, p in enumerate(pieces):
        out.apply(StepOutput(request_id="r", new_token_ids=[10 + i], text_delta=p, index=0))
    c = out.outputs[0]
    assert c.text_chunks == ["Hel", "lo", " wörld", "🌊"]  # nothing joined per delta
    assert c.text_len == len("Hello wörld🌊") and c.token_ids == [10, 11, 12, 13, 14]
    assert out.outputs[0].text == "Hello wörld🌊" and c.text_chunks == ["Hello wörld🌊"]
    out.apply(StepOutput(request_id="r", new_token_ids=[15], text_delta="!", finished=True,
                          finish_reason="stop", index=0))
    assert c.text == "Hello wörld🌊!" and c.text_len == len(c.text) and c.finished
    assert out.outputs[1].text == "" and out.outputs[1].text_len == 0
    assert not out.finished  # sample 1 is still running
    # equal outputs compare equal however their text is chunked
    other = CompletionOutput(0, list(c.token_ids), "stop", None)
    for piece in ("Hello ", "wörld🌊!"):
        other.add_text(piece)
    assert other.text_chunks != c.text_chunks and other == c
    other.add_text("?")
    assert other != c


# -- published stats: what the service reads instead of the scheduler -------------------


async def test_the_engine_publishes_a_frozen_stats_snapshot_each_step(tiny_models) -> None:
    import dataclasses

    from engine.stats import EngineStats

    engine = AsyncEngine(config(tiny_models("llama", 0)))
    await engine.start()
    try:
        first = engine.stats
        assert first.step == 0 and first.running == first.waiting == 0
        assert first.max_num_seqs == engine.config.scheduler.max_num_seqs
        assert engine.queued() == 0
        prompt = random_prompts(1, 20, 20, 320, seed=5)[0]
        seen: list[EngineStats] = []
        async for _ in engine.generate(prompt, GREEDY, "s"):
            seen.append(engine.stats)
        await _settled(engine)  # the step after the last output publishes too
        last = engine.stats
    finally:
        await engine.shutdown()
    assert any(s.running == 1 for s in seen)  # mid-generation, the request is in the batch
    assert last.step == engine.engine.num_steps > first.step
    assert last.running == last.waiting == 0 and last.adds_taken == 1
    assert last.prefix_queries >= 20 and 0.0 <= last.kv_usage <= 1.0
    assert last.offload is not None and [t.name for t in last.tiers] == ["memory"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        last.running = 3  # type: ignore[misc]


async def _settled(engine: AsyncEngine, timeout: float = 10.0) -> None:
    """Until the engine has published a snapshot with nothing running (deadline-bound)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.stats.running or engine.stats.waiting:
        assert loop.time() < deadline, engine.stats
        await asyncio.sleep(0.01)


def test_queued_adds_the_requests_the_engine_thread_has_not_taken() -> None:
    from engine.stats import EngineStats

    engine = AsyncEngine(EngineConfig())  # not started: only the loop-side arithmetic
    engine._engine_thread.stats = EngineStats(waiting=2, adds_taken=3)
    engine._adds_sent = 5  # two sent since the snapshot
    assert engine.queued() == 4


def test_metrics_read_only_the_published_stats() -> None:
    from engine.stats import EngineStats, OffloadCounters, TierCounters
    from service.metrics import Metrics

    m = Metrics()
    m.observe_engine(EngineStats(running=3, waiting=4, kv_usage=0.25, prefix_queries=100,
                                 prefix_hits=40, preemptions=2,
                                 offload=OffloadCounters(loads=5, written_blocks=7),
                                 tiers=(TierCounters("redis", lookups=9, errors=1,
                                                     breaker_open=True),)))
    text = m.render().decode()
    for line in ("tidewire_requests_running 3.0", "tidewire_requests_waiting 4.0",
                 'tidewire_kv_tier_loads{what="written_blocks"} 7.0',
                 'tidewire_kv_tier_ops{op="lookups",tier="redis"} 9.0',
                 'tidewire_kv_tier_breaker_open{tier="redis"} 1.0'):
        assert line in text, line


def test_the_service_never_reads_engine_internals() -> None:
    # the scheduler, the block manager and the tier belong to the engine thread; the
    # service reads AsyncEngine's properties and its published stats only
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "service"
    for path in root.glob("*.py"):
        text = path.read_text()
        for name in ("engine.engine", ".scheduler", "kv_offload", "engine.offload", "engine.kv."):
            assert name not in text, f"{path.name} reads {name}"

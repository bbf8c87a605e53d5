"""Greedy parity with HF transformers `generate` (fp32, same weights), token for token,
under every scheduling regime; block-manager integrity is checked after every step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.build import quant_cache_path
from tests.conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

REGIMES = {
    "one-big-batch": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=64),
    "block-size-1": dict(block_size=1),
    "block-size-32": dict(block_size=32),
}

MODELS = {
    "llama-gqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4)),
    # head_dim 32: the compiled CPU path's fused rope + cache write, norms and SiLU run too
    "llama-fused": ("llama", dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=1)),
    "llama-fused-tied": ("llama", dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=1,
                                       tie_word_embeddings=True)),
    "qwen2-fused-bias": ("qwen2", dict(hidden_size=64, num_attention_heads=2,
                                       num_key_value_heads=1)),
    "qwen2-bias": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1)),
    "mistral": ("mistral", dict(num_attention_heads=4, num_key_value_heads=2,
                                sliding_window=512)),
}
# every in_features a multiple of 256: int4 stores Q4_K blocks
INT4_MODELS = {**MODELS, "llama-256": ("llama", dict(hidden_size=256, intermediate_size=512,
                                                     num_attention_heads=4,
                                                     num_key_value_heads=2))}


def _check(llm: LLM, path, prompts: list[list[int]], params: SamplingParams = GREEDY) -> None:
    want = hf_greedy(path, prompts, params.max_tokens)
    got = llm.generate(prompts, params)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w, f"prompt {i} (len {len(prompts[i])}) diverged"
        assert g.finish_reason == "length"
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
    llm.engine.kv.check_integrity()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_parity(tiny_models, model: str, regime: str, seed: int) -> None:
    arch, cfg = MODELS[model]
    path = tiny_models(arch, seed, **cfg)
    llm = LLM(model=str(path), dtype="float32", debug=True, **REGIMES[regime])
    prompts = random_prompts(8, 3, 60, 320, seed=seed + 10)
    _check(llm, path, prompts)
    if regime == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


def test_shared_prefix_hits_cache_and_stays_exact(tiny_models) -> None:
    path = tiny_models("llama", 0)
    llm = LLM(model=str(path), dtype="float32", block_size=8, debug=True)
    system = random_prompts(1, 40, 40, 320, seed=3)[0]
    tails = random_prompts(6, 1, 20, 320, seed=4)
    first = llm.generate([system + tails[0]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    rest = [system + t for t in tails[1:]]
    want = hf_greedy(path, rest, GREEDY.max_tokens)
    got = llm.generate(rest, GREEDY)
    assert [g.token_ids for g in got] == want
    assert all(g.num_cached_tokens == 40 for g in got)  # 5 full blocks of the system prompt
    # A prompt identical to an earlier one (prompt + its output) is a full hit too.
    again = llm.generate([system + tails[0]], GREEDY)[0]
    n = len(system + tails[0])
    assert again.token_ids == first.token_ids and again.num_cached_tokens == (n - 1) // 8 * 8
    assert llm.engine.kv.num_hits > 0


def test_shared_prefix_attention_stays_exact(tiny_models, monkeypatch) -> None:
    """Shared-prefix (cascade) attention, forced on for every group (the cost rule's
    thresholds at zero): prompts behind one system prompt decode and prefill their tails
    against its blocks once a step, and greedy output still equals HF."""
    from engine.attention.cpu import CpuAttention
    from kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("no C++ compiler: the compiled CPU kernels are unavailable")
    monkeypatch.setattr(CpuAttention, "CASCADE_MIN_ROWS", 0)
    for name in ("CASCADE_MIN_SAVED_KEYS", "CASCADE_MIN_SAVED_KEYS_VECTOR",
                 "CASCADE_MIN_SHARED_KEYS_VECTOR"):
        monkeypatch.setattr(CpuAttention, name, 0)
    path = tiny_models("llama", 0)
    # eager: the compiled decode step (batches of 8 or fewer) has its own attention
    llm = LLM(model=str(path), dtype="float32", block_size=16, max_num_batched_tokens=64,
              enforce_eager=True)
    attn = llm.engine.runner.attn
    calls = []
    real = attn._cascade

    def spy(*args):  # noqa: ANN002, ANN202
        groups = real(*args)
        calls.append(groups is not None)
        return groups
    monkeypatch.setattr(attn, "_cascade", spy)
    system = random_prompts(1, 70, 70, 320, seed=8)[0]
    llm.generate([system + [7]], SamplingParams(max_tokens=1))  # its 4 blocks, cached
    prompts = [system + t for t in random_prompts(6, 1, 30, 320, seed=9)]
    _check(llm, path, prompts)
    assert sum(calls) >= GREEDY.max_tokens - 1  # a group in (almost) every step


def test_warm_up_runs_both_samplers_and_leaves_nothing_behind(tiny_models) -> None:
    """The server's warm-up before /ready (LLMEngine.warm_up): steps run, and afterwards
    every block is free, nothing is in the prefix cache, the counters the stats report
    read as before, and the engine's output is what it would have been."""
    path = tiny_models("llama", 0)
    llm = LLM(model=str(path), dtype="float32", debug=True)
    eng = llm.engine
    stepped = []
    real = eng.step
    eng.step = lambda *a, **k: stepped.append(1) or real(*a, **k)  # type: ignore[method-assign]
    assert eng.warm_up() > 0 and len(stepped) >= 3
    del eng.step
    assert eng.num_steps == 0 and eng.kv.num_queries == 0 and eng.kv.num_hits == 0
    assert eng.kv.num_free_blocks == eng.num_blocks and eng.kv.pool.cached == {}
    assert not eng.has_unfinished()
    prompts = random_prompts(3, 5, 30, 320, seed=12)
    _check(llm, path, prompts)


def test_prefix_caching_off_is_exact(tiny_models) -> None:
    path = tiny_models("llama", 0)
    llm = LLM(model=str(path), dtype="float32", enable_prefix_caching=False, debug=True)
    prompts = random_prompts(4, 20, 40, 320, seed=5)
    _check(llm, path, prompts + prompts)
    assert llm.engine.kv.pool.cached == {}


def test_bf16_runs_and_mostly_agrees(tiny_models) -> None:
    """bf16 is not bit-exact with fp32; it must still run every path and track it."""
    path = tiny_models("llama", 0)
    prompts = random_prompts(4, 5, 30, 320, seed=6)
    llm = LLM(model=str(path), dtype="bfloat16", max_num_batched_tokens=16, debug=True)
    got = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    want = hf_greedy(path, prompts, 8)
    first_tokens = [g.token_ids[0] == w[0] for g, w in zip(got, want)]
    assert sum(first_tokens) >= 3


def test_eos_stops_unless_ignored(tiny_models) -> None:
    path = tiny_models("llama", 0)
    llm = LLM(model=str(path), dtype="float32")
    prompt = random_prompts(1, 10, 10, 320, seed=7)[0]
    free_run = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0,
                                                     ignore_eos=True))[0].token_ids
    eos = free_run[5]  # pretend the 6th token is EOS
    llm.engine.inputs.eos_token_ids = frozenset({eos})
    stopped = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))[0]
    first = free_run.index(eos)
    assert stopped.token_ids == free_run[: first + 1] and stopped.finish_reason == "stop"
    ignored = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0,
                                                    ignore_eos=True))[0]
    assert ignored.token_ids == free_run and ignored.finish_reason == "length"


def test_a_sliding_window_model_holds_only_its_window(tiny_models) -> None:
    """Mistral with a 32-token window on every layer: a 600-token prompt (many windows
    long) is served exactly (HF equal) in 64-token chunks, while the request never holds
    more than its window, one chunk and a block of slack in blocks (the rest went back
    to the pool behind the window); the context is the model's, not the window."""
    path = tiny_models("mistral", 0, num_attention_heads=4, num_key_value_heads=2,
                       sliding_window=32)
    llm = LLM(model=str(path), dtype="float32", debug=True, block_size=16,
              max_num_batched_tokens=64)
    eng = llm.engine
    assert eng.max_model_len == 1024 and eng.kv.window == 32
    prompt = random_prompts(1, 600, 600, 320, seed=12)[0]
    eng.add(eng.make_request(prompt, GREEDY, "long"))
    held, toks = [], []
    while eng.has_unfinished():
        for out in eng.step():
            toks += out.new_token_ids
        table = eng.kv.tables.get("long", [])
        held.append(sum(b.ref_cnt > 0 for b in table))
    assert toks == hf_greedy(path, [prompt], GREEDY.max_tokens)[0]
    assert max(held) <= -(-(32 + 64) // 16) + 1, held
    assert eng.kv.num_released >= (600 - 32 - 64) // 16
    assert eng.kv.num_free_blocks == eng.num_blocks


def _drive(llm: LLM, reqs, park_at: int | None = None, parked=(), hold: int = 0) -> dict:
    """Step the engine to completion; optionally park `parked` after `park_at` steps and
    unpark them `hold` steps later. Returns {id: (token ids, text)}."""
    eng = llm.engine
    toks: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    text: dict[str, str] = {r.request_id: "" for r in reqs}
    for r in reqs:
        eng.add(r)
    steps = 0
    while eng.has_unfinished() or eng.scheduler.parked:
        if steps == park_at:
            assert eng.park(list(parked)) == len(parked)
            # Their blocks are free at once: nothing of theirs is left in the block tables.
            assert not set(parked) & set(eng.kv.tables)
        if park_at is not None and steps == park_at + hold:
            assert eng.unpark(list(parked)) == len(parked)
        for out in eng.step():
            toks[out.request_id] += out.new_token_ids
            text[out.request_id] += out.text_delta
        steps += 1
    return {rid: (toks[rid], text[rid]) for rid in toks}


def test_parked_requests_resume_exactly(tiny_models) -> None:
    """A parked request (its client reconnecting) frees its blocks, sits out while the
    batch goes on, then recomputes its prompt and outputs (prefix-cache hits) and goes
    on exactly: greedy equals HF, a seeded sample equals its uninterrupted run."""
    path = tiny_models("llama", 0)
    prompts = random_prompts(4, 20, 60, 320, seed=31)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    kw = dict(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=32,
              debug=True)

    def requests(llm: LLM):
        return [llm.engine.make_request(p, seeded if i == 3 else GREEDY, f"r{i}")
                for i, p in enumerate(prompts)]

    base = LLM(**kw)
    plain = _drive(base, requests(base))
    llm = LLM(**kw)
    hits_before = llm.engine.kv.num_hits
    parked = _drive(llm, requests(llm), park_at=6, parked=("r0", "r3"), hold=5)
    want = hf_greedy(path, prompts[:3], GREEDY.max_tokens)
    assert [parked[f"r{i}"][0] for i in range(3)] == want
    assert parked["r3"] == plain["r3"] and len(parked["r3"][0]) == 24
    assert llm.engine.kv.num_hits > hits_before  # the resumed ones found their blocks
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
    assert not llm.engine.scheduler.parked and not llm.engine.scheduler.requests


def test_aborting_a_parked_request_finishes_it(tiny_models) -> None:
    path = tiny_models("llama", 0)
    llm = LLM(model=str(path), dtype="float32", block_size=4, debug=True)
    eng = llm.engine
    eng.add(eng.make_request(random_prompts(1, 20, 20, 320, seed=32)[0], GREEDY, "a"))
    eng.step()
    eng.park(["a"])
    assert not eng.has_unfinished() and eng.num_blocks == eng.kv.num_free_blocks
    outs = eng.abort(["a"])
    assert [(o.finished, o.finish_reason) for o in outs] == [(True, "abort")]
    assert not eng.scheduler.parked and eng.request_ids() == []


def test_auto_dtype_follows_the_cpu(tiny_models) -> None:
    """auto = bfloat16 only where the CPU computes bf16 natively (AVX512-BF16 / AMX)."""
    from engine.platform import auto_dtype, read_cpu_flags

    flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    native = bool({"avx512_bf16", "amx_bf16"} & set(flags))
    assert auto_dtype("cpu", read_cpu_flags()) == ("bfloat16" if native else "float32")
    assert auto_dtype("cuda", read_cpu_flags()) == "bfloat16"
    llm = LLM(model=str(tiny_models("llama", 0)))
    assert llm.engine.dtype_name == auto_dtype("cpu", read_cpu_flags())
    assert str(llm.engine.dtype) == f"torch.{auto_dtype('cpu', read_cpu_flags())}"


def _dequantized_copy(src: Path, out: Path, roundtrip: Callable[[torch.Tensor], torch.Tensor]
                      ) -> Path:
    """A copy of the model directory `src` whose linears (engine/quant.py's names) went
    through a quantization and back: the HF reference of a quantized engine."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.quant import linear_weight_names

    shutil.copytree(src, out)
    weights = load_file(str(src / "model.safetensors"))
    for name in linear_weight_names(weights):
        weights[name] = roundtrip(weights[name])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("model", ["llama-gqa", "llama-fused", "qwen2-fused-bias"])
def test_int8_matches_hf_on_the_dequantized_weights(tiny_models, tmp_path, model) -> None:
    """Weight-only int8: greedy tokens equal HF transformers running the dequantized
    weights in fp32, through the compiled decode step, the eager int8 kernel (<= 4 rows)
    and the dense path (prefill chunks, 6-row eager decodes) alike; the quantized weights
    are cached and reused."""
    from engine.quant import dequantize_int8, quantize_int8
    from kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("no C++ compiler: int8 needs the compiled CPU kernels")
    arch, cfg = MODELS[model]
    src = tiny_models(arch, 5, **cfg)
    ref_dir = _dequantized_copy(src, tmp_path / "dequantized",
                                lambda w: dequantize_int8(*quantize_int8(w)))
    prompts = random_prompts(6, 3, 40, 320, seed=21)
    want = hf_greedy(ref_dir, prompts, GREEDY.max_tokens)
    for kw in (dict(), dict(enforce_eager=True, max_num_seqs=2), dict(enforce_eager=True),
               dict(max_num_batched_tokens=16)):  # chunks whose LM head has no row
        llm = LLM(model=str(src), dtype="float32", quantization="int8", debug=True, **kw)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    # the second LLM loaded the first's int8 file
    assert quant_cache_path(llm.engine.config, llm.engine.model_dir).exists()
    assert llm.engine.runner.model.layers[0].qkv.q.dtype == torch.int8


@pytest.mark.parametrize("model", ["llama-256", "qwen2-fused-bias"])
def test_int4_matches_hf_on_the_dequantized_weights(tiny_models, tmp_path, model) -> None:
    """Group-wise int4 (Q4_K blocks where in_features is a multiple of 256, as in
    llama-256; else Q4_1 blocks of 32): greedy tokens equal HF transformers running the
    dequantized weights in fp32, through the block kernel (<= 8 rows) and the
    dequantized tiles (prefill chunks, 12-row decodes); the blocks are cached and reused,
    and dequantize in the kernel exactly as engine/quant.py says."""
    from engine.gguf_weights import QuantWeight
    from engine.quant import dequantize_int4, quantize_int4
    from kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("no C++ compiler: int4 needs the compiled CPU kernels")
    arch, cfg = INT4_MODELS[model]
    src = tiny_models(arch, 5, **cfg)

    def roundtrip(w: torch.Tensor) -> torch.Tensor:
        qtype, blocks = quantize_int4(w)
        deq = dequantize_int4(qtype, blocks, w.shape[1])
        assert torch.equal(cpu_ops.gguf_dequant(blocks, qtype, w.shape[1], torch.float32), deq)
        if qtype == 3:
            groups = w.reshape(w.shape[0], -1, 32).float()
            step = (groups.amax(-1) - groups.amin(-1)) / 15
            assert ((deq.reshape(groups.shape) - groups).abs()
                    <= step[..., None] * 0.51 + 1e-3).all()  # half a step (fp16 d, m)
        return deq

    ref_dir = _dequantized_copy(src, tmp_path / "dequantized", roundtrip)
    prompts = random_prompts(12, 3, 40, 320, seed=21)
    want = hf_greedy(ref_dir, prompts, GREEDY.max_tokens)
    for kw in (dict(), dict(max_num_seqs=4, max_num_batched_tokens=16)):
        llm = LLM(model=str(src), dtype="float32", quantization="int4", debug=True, **kw)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert quant_cache_path(llm.engine.config, llm.engine.model_dir).exists()
    qkv = llm.engine.runner.model.layers[0].qkv
    want_type = 12 if model == "llama-256" else 3
    assert all(isinstance(p, QuantWeight) and p.qtype == want_type for p in qkv.parts)


def test_compiled_cpu_decode_step_is_exact_and_falls_back_past_eight_sequences(tiny_models):
    """The compiled decode step (engine/compiled_step.py) runs steps of 1-8 decodes; 12 at once
    run eagerly; both equal HF, and equal the step-by-step eager engine."""
    path = tiny_models("llama", 2, hidden_size=96, num_attention_heads=3, num_key_value_heads=1)
    llm = LLM(model=str(path), dtype="float32", debug=True)
    step = llm.engine.runner.compiled_step
    if step is None:
        pytest.skip("no C++ compiler: the compiled CPU kernels are unavailable")
    prompts = random_prompts(12, 3, 50, 320, seed=31)
    want = hf_greedy(path, prompts, GREEDY.max_tokens)
    assert [o.token_ids for o in llm.generate(prompts[:5], GREEDY)] == want[:5]
    assert step.steps == GREEDY.max_tokens - 1  # every decode step of the 5 ran compiled
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert step.steps == GREEDY.max_tokens - 1  # 12 decodes a step: all eager
    eager = LLM(model=str(path), dtype="float32", enforce_eager=True)
    assert eager.engine.runner.compiled_step is None
    assert [o.token_ids for o in eager.generate(prompts[:5], GREEDY)] == want[:5]


def test_compiled_decode_step_splits_a_long_context_and_merges_it_exactly(tiny_models) -> None:
    """One sequence past 1,024 tokens: too few work items for the threads, so the
    compiled step splits its context into parts and merges them by log-sum-exp."""
    path = tiny_models("llama", 4, hidden_size=96, num_attention_heads=3, num_key_value_heads=1,
                       max_position_embeddings=2048)
    llm = LLM(model=str(path), dtype="float32", debug=True)
    if llm.engine.runner.compiled_step is None:
        pytest.skip("no C++ compiler: the compiled CPU kernels are unavailable")
    prompt = random_prompts(1, 1500, 1500, 320, seed=41)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompt, params)] == hf_greedy(path, prompt, 6)
    assert llm.engine.runner.compiled_step.steps == 5


def test_bf16_prefill_on_the_matrix_unit_agrees_with_the_avx512_path(tiny_models) -> None:
    """bf16 prefill attention runs on AMX tiles where the CPU has them: the engine's greedy
    output with them and without them (TIDEWIRE_CPU_AMX=0's switch) agrees but for late
    rounding, over prompts of several query tiles and a chunked one."""
    from kernels import cpu_ops

    if not cpu_ops.amx():
        pytest.skip("AMX: not on this CPU, or Linux refused this process the tile state")
    path = tiny_models("llama", 2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    prompts = random_prompts(4, 60, 300, 320, seed=44)
    outs = {}
    try:
        for amx in (True, False):
            cpu_ops.amx(amx)
            llm = LLM(model=str(path), dtype="bfloat16", max_num_batched_tokens=128)
            outs[amx] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        cpu_ops.amx(True)
    same = sum(a == b for x, y in zip(outs[True], outs[False]) for a, b in zip(x, y))
    assert same >= 0.9 * sum(len(x) for x in outs[False])


def test_compiled_decode_step_in_bf16_agrees_with_the_eager_engine(tiny_models) -> None:
    path = tiny_models("llama", 2, hidden_size=96, num_attention_heads=3, num_key_value_heads=1)
    prompts = random_prompts(4, 5, 40, 320, seed=43)
    outs = {}
    for eager in (False, True):
        llm = LLM(model=str(path), dtype="bfloat16", enforce_eager=eager)
        outs[eager] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    same = sum(a == b for x, y in zip(outs[False], outs[True]) for a, b in zip(x, y))
    assert same >= 0.9 * sum(len(x) for x in outs[True])  # bf16: rounding may differ late

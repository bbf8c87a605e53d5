"""Every model family against HF transformers `generate` (fp32, the same random weights,
transformers' own classes): greedy tokens equal, token for token, on each engine path
(the compiled CPU kernels, the torch fallback, the Triton kernels under the interpreter)
and through the regimes that move KV around (chunked prefill, preemption, prefix-cache
hits, host-tier hits, speculative decoding, n > 1, a parked request resuming).

`make test` runs each family once per path with the regimes combined in one engine; the
full family x path x regime matrix (`TIDEWIRE_FAMILY_MATRIX=1`, `make families`) runs
each regime on its own."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from engine import LLM, SamplingParams
from engine.platform import COMPILED_STEP_FEATURES, Platform
from tests.conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
HEADS = dict(num_attention_heads=2, num_key_value_heads=1)  # head_dim 32: compiled ops too
WINDOW = 8  # the sliding-window families' window: prompts run several windows long

FAMILIES: dict[str, tuple[str, dict]] = {
    "llama3-rope": ("llama", dict(HEADS, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2-yarn": ("qwen2", dict(HEADS, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 256})),
    "mistral-window": ("mistral", dict(HEADS, sliding_window=WINDOW)),
    "qwen3": ("qwen3", dict(HEADS, head_dim=32)),
    "smollm3-nope": ("smollm3", dict(HEADS, num_hidden_layers=4)),
    "phi3-partial": ("phi3", dict(HEADS, hidden_size=128, partial_rotary_factor=0.5)),
    "gemma3": ("gemma3", dict(HEADS, head_dim=32, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention"],
                              query_pre_attn_scalar=24, final_logit_softcapping=30.0)),
    "qwen3-moe": ("qwen3_moe", dict(HEADS, head_dim=32, norm_topk_prob=True)),
    "mixtral": ("mixtral", dict(HEADS)),
    "olmoe": ("olmoe", dict(HEADS)),
}

# the engine paths: the cpu backend with and without its compiled kernels, and the
# Triton kernels under the interpreter (the CUDA backend's code, on the CPU)
PATHS = {
    "compiled": dict(attention_backend="cpu"),
    "torch": dict(attention_backend="cpu"),  # with the compiled kernels switched off
    "triton": dict(attention_backend="triton-interpret"),
}
if torch.cuda.is_available():  # the cuda backend itself (the interpreter's case is
    # left to machines without a GPU: it must come first in a process, engine/attention)
    PATHS = {"cuda": dict(attention_backend="cuda")}

# Each regime alone; COMBINED puts them in one engine: 4-token blocks in a pool too small
# for the batch (preemption; evicted prefixes go to the memory tier and come back),
# 16-token steps (chunked prefill), prompts sharing a prefix (prefix-cache hits).
REGIMES = {
    "one-big-batch": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=64),
    "speculative": dict(speculative="ngram", num_speculative_tokens=3,
                        speculative_min_acceptance=0.0),
}
COMBINED = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
# local and global layers (Gemma 3): 16 blocks with room in every layer, 32 more in the
# global layers only, which the blocks behind the window move to (block_manager.HybridPool)
HYBRID = dict(num_kv_blocks=48, num_full_kv_blocks=16)
FULL_MATRIX = os.environ.get("TIDEWIRE_FAMILY_MATRIX", "") not in ("", "0")
# the families `make triton` runs under the Triton interpreter (~10 s each; `make test`
# none): between them every switch of the model layer (windows, q/k norms, Gemma's norms,
# partial rotary, experts); `make families` runs them all
TRITON_FULL = os.environ.get("TIDEWIRE_TRITON_FULL", "") not in ("", "0")
TRITON_QUICK = ("gemma3", "phi3-partial", "qwen3-moe")


def _prompts(seed: int) -> list[list[int]]:
    """Prompts several windows long, half of them behind a shared 24-token prefix."""
    base = random_prompts(6, 10, 40, 320, seed=seed)
    prefix = random_prompts(1, 24, 24, 320, seed=seed + 100)[0]
    return [prefix + p if i % 2 else p for i, p in enumerate(base)]


def _llm(path, engine_path: str, monkeypatch, **kw) -> LLM:
    if engine_path == "torch":
        choose = Platform.choose.__func__  # type: ignore[attr-defined]
        monkeypatch.setattr(Platform, "choose", classmethod(
            lambda cls, *a, **k: dataclasses.replace(choose(cls, *a, **k),
                                                     cpu_kernels=lambda: False)))
    # debug: the block manager's integrity after every step (once per family is enough)
    llm = LLM(model=str(path), dtype="float32", debug=engine_path == "compiled",
              **PATHS[engine_path], **kw)
    if engine_path == "torch":
        assert not llm.engine.runner.plan.compiled_attention
    return llm


def _check(llm: LLM, path, prompts: list[list[int]], params: SamplingParams = GREEDY):
    want = hf_greedy(path, prompts, params.max_tokens)
    got = llm.generate(prompts, params)
    for i, (g, w) in enumerate(zip(got, want)):
        for sample in g.outputs:
            assert sample.token_ids == w, f"prompt {i} (len {len(prompts[i])}) diverged"
    pool = llm.engine.kv.pool  # every block free again (of either kind: HybridPool)
    assert len(pool.queued()) == pool.num_blocks == llm.engine.num_blocks
    llm.engine.kv.check_integrity()
    return got


@pytest.fixture
def family_model(tiny_models):
    def get(name: str):
        arch, cfg = FAMILIES[name]
        return tiny_models(arch, 3, **cfg)
    return get


@pytest.mark.parametrize("engine_path", list(PATHS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_parity_regimes_combined(family_model, monkeypatch, family: str,
                                        engine_path: str) -> None:
    """One engine per family and path with every regime at once; the same prompts twice
    (the second run hits the prefix cache and the host tier)."""
    if engine_path == "triton" and not FULL_MATRIX and not (TRITON_FULL and
                                                             family in TRITON_QUICK):
        pytest.skip("the Triton interpreter runs families in `make triton` and `make families`")
    path = family_model(family)
    prompts = _prompts(7)
    if engine_path == "triton":  # the interpreter is slow: fewer prompts (one of them
        prompts = prompts[:2]  # behind the shared prefix)
    hybrid = family == "gemma3"
    llm = _llm(path, engine_path, monkeypatch, **COMBINED | (HYBRID if hybrid else {}))
    first = _check(llm, path, prompts)
    kv = llm.engine.kv
    assert bool(kv.local_window) == hybrid
    if kv.window:  # blocks behind the window went back to the pool as requests grew
        assert kv.num_released > 0
    elif hybrid:  # (and to global-only blocks: the local layers hold the window only)
        runner = llm.engine.runner
        assert kv.num_moved > 0 and runner.kv_local is not None
        # per layer, a local cache holds 16 blocks, a global one 48
        assert runner.kv_local.numel() // len(runner.kv_local) * 3 == \
            runner.kv.numel() // len(runner.kv)
    else:
        assert llm.engine.scheduler.num_preemptions > 0 or engine_path == "triton"
    again = _check(llm, path, prompts)
    # (a windowed model's prompt blocks leave the pool behind the window, a prompt's first
    # ones soonest, and a hit needs the chain from the first: in this tiny pool it gets
    # fewer hits the second time, not more)
    if not kv.window:
        assert sum(o.num_cached_tokens for o in again) > sum(o.num_cached_tokens for o in first)
    if engine_path == "compiled" and not kv.window:
        assert sum(o.num_host_cached_tokens for o in again) > 0, "no host-tier hit"
        # the fused decode step runs Llama stacks (windows included), the rest eagerly
        step = llm.engine.runner.compiled_step
        arch = llm.engine.arch
        fused = arch.features <= COMPILED_STEP_FEATURES and arch.head_rotary_dim % 32 == 0
        assert (step is not None) == fused, arch.features
        assert step is None or step.steps > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_speculative_n2_and_resume(family_model, family: str) -> None:
    """Speculative decoding with the model as its own draft (the family's forward both
    proposes and verifies: every proposal is right) and n=2 samples a request; then a
    request parked mid-decode (its blocks freed) and resumed: each equals HF."""
    path = family_model(family)
    prompts = _prompts(8)[:4]
    llm = LLM(model=str(path), dtype="float32", debug=True, speculative="draft",
              draft_model=str(path), num_speculative_tokens=3, speculative_min_acceptance=0.0)
    got = _check(llm, path, prompts, dataclasses.replace(GREEDY, n=2))
    assert all(len(o.outputs) == 2 for o in got)
    spec = [o.spec for o in got if o.spec]
    assert spec and sum(s[2] for s in spec) == sum(s[1] for s in spec) > 0
    eng = llm.engine
    want = hf_greedy(path, prompts[:2], GREEDY.max_tokens)
    reqs = [eng.make_request(p, GREEDY, f"r{i}") for i, p in enumerate(prompts[:2])]
    toks: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        eng.add(r)
    steps = 0
    while eng.has_unfinished() or eng.scheduler.parked:
        if steps == 3:
            assert eng.park(["r0"]) == 1
        if steps == 5:
            assert eng.unpark(["r0"]) == 1
        for out in eng.step():
            toks[out.request_id] += out.new_token_ids
        steps += 1
    assert [toks["r0"], toks["r1"]] == want


@pytest.mark.skipif(not FULL_MATRIX, reason="the full matrix: TIDEWIRE_FAMILY_MATRIX=1 "
                    "(make families)")
@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("engine_path", list(PATHS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_parity_matrix(family_model, monkeypatch, family: str, engine_path: str,
                              regime: str) -> None:
    path = family_model(family)
    prompts = _prompts(9)[: 3 if engine_path == "triton" else 6]
    kw = dict(REGIMES[regime])
    if engine_path == "triton" and regime == "preemption":  # half the prompts: half the pool
        kw["num_kv_blocks"] = 20
    llm = _llm(path, engine_path, monkeypatch, **kw)
    got = _check(llm, path, prompts)
    if regime == "preemption":  # (a windowed model gives blocks back instead)
        assert llm.engine.scheduler.num_preemptions > 0 or llm.engine.kv.num_released > 0
    if regime == "speculative":
        assert llm.engine.runner is not None and got


def test_bf16_tracks_fp32_for_every_family(family_model) -> None:
    """bf16 is not bit-exact with fp32: every family still runs and mostly agrees on the
    first tokens."""
    for name in FAMILIES:
        path = family_model(name)
        prompts = _prompts(10)[:4]
        llm = LLM(model=str(path), dtype="bfloat16", max_num_batched_tokens=16)
        got = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0,
                                                   ignore_eos=True))
        want = hf_greedy(path, prompts, 4)
        agree = sum(g.token_ids[0] == w[0] for g, w in zip(got, want))
        assert agree >= 3, f"{name}: bf16 first tokens agree on only {agree} of 4"


def test_attention_biases_all_four_projections(tmp_path) -> None:
    """`attention_bias`: q, k, v and o carry biases (Llama, Qwen3, ... in transformers);
    random non-zero ones (HF initializes them to zero) must all reach the output."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import make_tiny_model

    path = make_tiny_model(tmp_path / "qwen3-bias", "qwen3", 4, **HEADS, head_dim=32,
                           attention_bias=True)
    weights = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    biases = [k for k in weights if k.endswith("_proj.bias")]
    assert {k.split(".")[-2] for k in biases} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    for k in biases:
        weights[k] = torch.randn(weights[k].shape, generator=g)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    prompts = _prompts(11)[:3]
    llm = LLM(model=str(path), dtype="float32")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == \
        hf_greedy(path, prompts, GREEDY.max_tokens)

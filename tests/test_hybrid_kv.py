"""Models with local (sliding-window) and global layers keep only a window's worth of
blocks in their local layers (engine/block_manager.py HybridPool): greedy parity with HF
on the compiled decode step (whose caches then differ in size per layer) and the torch
fallback, with prompts many windows long
in a pool whose full blocks could not hold one of them; and the blocks a long context
holds."""

from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from engine.platform import Platform
from tests.conftest import hf_greedy, random_prompts

WINDOW = 8
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# Qwen2 with its sliding window on the layers from max_window_layers up: a Llama stack,
# so the compiled decode step runs it; Gemma 3 (5 local layers to a global one)
QWEN2 = dict(num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=4,
             use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
GEMMA3 = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=6,
              sliding_window=WINDOW, query_pre_attn_scalar=24)
# 12 blocks of 4 tokens with room in every layer: no prompt below fits them whole
POOL = dict(block_size=4, num_kv_blocks=160, num_full_kv_blocks=12,
            max_num_batched_tokens=16)


def _engine(path, monkeypatch, engine_path: str, **kw) -> LLM:
    if engine_path == "torch":
        choose = Platform.choose.__func__  # type: ignore[attr-defined]
        monkeypatch.setattr(Platform, "choose", classmethod(
            lambda cls, *a, **k: dataclasses.replace(choose(cls, *a, **k),
                                                     cpu_kernels=lambda: False)))
    return LLM(model=str(path), dtype="float32", debug=True, attention_backend="cpu",
               **POOL, **kw)


# (the Triton kernels run a hybrid Gemma 3 in tests/test_families.py, interpreted here
# and natively on a GPU)
@pytest.mark.parametrize("engine_path", ["compiled", "torch"])
@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_hybrid_parity_with_prompts_many_windows_long(tiny_models, monkeypatch, family: str,
                                                      engine_path: str) -> None:
    path = tiny_models(family, 5, **(QWEN2 if family == "qwen2" else GEMMA3))
    prompts = random_prompts(4, 60, 90, 320, seed=21)  # > 12 full blocks of 4 tokens
    llm = _engine(path, monkeypatch, engine_path)
    eng = llm.engine
    assert eng.kv.local_window == WINDOW and eng.kv.pool.num_full == 12
    got = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == hf_greedy(path, prompts, GREEDY.max_tokens)
    assert eng.kv.num_moved > 0
    if engine_path == "compiled" and family == "qwen2":  # caches of 12 and 160 blocks
        step = eng.runner.compiled_step
        assert step is not None and step.steps > 0
        assert {k.shape[1] for k, _ in eng.runner.kv_caches} == {12, 160}
    # the same prompts again: prefix hits served by the full blocks left as shadows
    # (or from the host tier), global-only blocks before them
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in got]
    assert sum(o.num_cached_tokens for o in again) > 0
    eng.kv.check_integrity()
    assert len(eng.kv.pool.queued()) == 160


def test_a_long_context_holds_a_window_of_full_blocks(tiny_models) -> None:
    """A 2,000-token prompt through a Gemma 3 with a 64-token window: the local layers
    hold at most the window plus a step's tokens at any time (here 20 + 1 blocks of the
    125 its context takes), while the global layers hold the whole context."""
    path = tiny_models("gemma3", 5, **dict(GEMMA3, sliding_window=64,
                                           max_position_embeddings=4096))
    llm = LLM(model=str(path), dtype="float32", block_size=16, num_kv_blocks=300,
              num_full_kv_blocks=40, max_num_batched_tokens=256)
    eng = llm.engine
    prompt = random_prompts(1, 2000, 2000, 320, seed=5)[0]
    req = eng.make_request(prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                                  ignore_eos=True), "long")
    eng.add(req)
    most_full = 0
    while eng.has_unfinished():
        eng.step()
        table = eng.kv.tables.get("long", [])
        most_full = max(most_full, sum(b.block_id < 40 for b in table))
    assert most_full <= (64 + 256) // 16 + 1
    assert eng.kv.num_moved >= (2000 - 64) // 16

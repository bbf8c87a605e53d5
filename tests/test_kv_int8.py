"""The int8 KV cache (`kv_cache_dtype="int8"`, the cpu backend's q8 cache): greedy tokens
equal HF transformers' when HF's own cache holds the same int8 values (each new K/V row
quantized once, as the engine's cache write does, and decode queries through int8
where the engine's decode kernel takes them so), under every scheduling regime; twice
the blocks per byte; the host tier round-trips the q8 blocks; unsupported setups are
refused with a clear error."""

from __future__ import annotations

import inspect
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from kernels import cpu_ops
from kernels import reference as ref
from tests.conftest import random_prompts

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason="no C++ compiler: the int8 KV cache needs the compiled "
                                       "CPU kernels")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

MODELS = {
    # head_dim 64: decodes take the integer kernel (where the CPU has AVX512-VNNI)
    "d64-gqa": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1),
    "d64-mha": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2),
    # head_dim 32: every item dequantizes tiles and computes in fp32
    "d32-gqa": dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=1),
}

REGIMES = {
    "one-big-batch": dict(),  # the compiled decode step (<= 8 sequences)
    "eager": dict(enforce_eager=True),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=64),
    "block-size-32": dict(block_size=32),
}


def _fake_q8(x: torch.Tensor) -> torch.Tensor:
    codes, scale = ref.quantize_kv_rows(x)
    return (codes.float() * scale[..., None]).to(x.dtype)


def decode_queries_int8(head_dim: int, group: int, block_size: int) -> bool:
    """Whether the engine's decode items take the integer kernel (attention_decode.h)."""
    return (cpu_ops.q8_decode_quantizes_queries() and head_dim % 64 == 0 and group <= 8
            and block_size % 16 == 0)


_HF_Q8: dict[tuple, list[int]] = {}


@torch.inference_mode()
def hf_greedy_q8(path, prompts: list[list[int]], max_new_tokens: int,
                 int8_queries: bool) -> list[list[int]]:
    """HF `generate` (fp32, greedy) whose KV cache stores each new row quantized and
    dequantized (ref.quantize_kv_rows), with one-token (decode) queries through int8 too
    when `int8_queries`."""
    from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Q8Cache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(_fake_q8(key_states), _fake_q8(value_states), layer_idx,
                                  *args, **kwargs)

    def attention(module, query, key, value, attention_mask, **kw):
        if int8_queries and query.shape[2] == 1:
            query = ref.quantize_queries(query).to(query.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("tidewire_q8_test", attention)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 attn_implementation="tidewire_q8_test").eval()
    # newer transformers 5.x name generate's cache `cache`, older ones `past_key_values`
    cache_kw = ("cache" if "cache" in inspect.signature(model.forward).parameters
                else "past_key_values")
    outs = []
    for p in prompts:
        key = (str(path), tuple(p), max_new_tokens, int8_queries)
        if key not in _HF_Q8:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0,
                                 eos_token_id=None, **{cache_kw: Q8Cache()})
            _HF_Q8[key] = out[0, len(p):].tolist()
        outs.append(_HF_Q8[key])
    return outs


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("regime", list(REGIMES))
def test_int8_kv_matches_hf_on_an_int8_cache(tiny_models, model: str, regime: str) -> None:
    cfg = MODELS[model]
    path = tiny_models("llama", 7, **cfg)
    kw = REGIMES[regime]
    llm = LLM(model=str(path), dtype="float32", kv_cache_dtype="int8", debug=True, **kw)
    assert llm.engine.runner.kv.dtype == torch.uint8
    if regime == "one-big-batch":
        assert llm.engine.runner.compiled_step is not None
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    group = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    prompts = random_prompts(6, 3, 60, 320, seed=17)
    want = hf_greedy_q8(path, prompts, GREEDY.max_tokens,
                        decode_queries_int8(head_dim, group, kw.get("block_size", 16)))
    got = llm.generate(prompts, GREEDY)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w, f"prompt {i} (len {len(prompts[i])}) diverged"
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
    if regime == "one-big-batch":  # 6 sequences: every decode step ran compiled
        assert llm.engine.runner.compiled_step.steps == GREEDY.max_tokens - 1
    if regime == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    llm.close()


def test_int8_kv_compiled_step_splits_a_long_context_and_matches_hf(tiny_models) -> None:
    """One sequence past 1,024 tokens: the compiled decode step splits its context into
    parts (integer kernel per part) and merges them by log-sum-exp."""
    cfg = dict(MODELS["d64-gqa"], max_position_embeddings=2048)
    path = tiny_models("llama", 8, **cfg)
    llm = LLM(model=str(path), dtype="float32", kv_cache_dtype="int8", debug=True)
    prompt = random_prompts(1, 1500, 1500, 320, seed=41)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = hf_greedy_q8(path, prompt, 6, decode_queries_int8(64, 2, 16))
    assert [o.token_ids for o in llm.generate(prompt, params)] == want
    assert llm.engine.runner.compiled_step.steps == 5
    llm.close()


def test_int8_kv_holds_about_twice_the_blocks(tiny_models) -> None:
    path = tiny_models("llama", 7, **MODELS["d64-gqa"])
    blocks = {}
    for kvd in ("auto", "int8"):
        llm = LLM(model=str(path), dtype="bfloat16", kv_cache_dtype=kvd,
                  kv_cache_memory=8 << 20, max_model_len=1024, max_num_seqs=256)
        blocks[kvd] = llm.engine.num_blocks
        llm.close()
    # bf16: 2 bytes a value; int8: 1 byte plus a 4-byte scale per 64-value row
    assert blocks["int8"] == pytest.approx(blocks["auto"] * 2 * 64 / 68, abs=1)


def test_int8_kv_blocks_go_through_the_host_tier_and_back(tiny_models) -> None:
    """Evicted q8 blocks are written to the memory tier and loaded back for a repeated
    prompt: the tokens equal those computed without any cache, and the tier's
    fingerprint is not the bf16 cache's."""
    path = tiny_models("llama", 7, **MODELS["d64-gqa"])
    prompts = random_prompts(4, 40, 60, 320, seed=23)
    cold = LLM(model=str(path), dtype="float32", kv_cache_dtype="int8",
               enable_prefix_caching=False)
    want = [o.token_ids for o in cold.generate(prompts, GREEDY)]
    cold.close()
    llm = LLM(model=str(path), dtype="float32", kv_cache_dtype="int8", num_kv_blocks=24,
              kv_tier="memory", debug=True)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    filler = random_prompts(4, 60, 60, 320, seed=29)  # evicts the first prompts' blocks
    llm.generate(filler, GREEDY)
    off = llm.engine.offload
    deadline = time.monotonic() + 30  # the tier's I/O thread writes what was evicted
    while (off.worker.pending_writes or not off.stats.written_blocks) and \
            time.monotonic() < deadline:
        time.sleep(0.005)
    assert off.stats.written_blocks > 0
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert llm.engine.offload.stats.load_blocks > 0
    bf16 = LLM(model=str(path), dtype="float32", kv_tier="memory")
    assert bf16.engine.kv_fingerprint != llm.engine.kv_fingerprint
    bf16.close()
    llm.close()


def test_int8_kv_is_refused_where_it_cannot_run(tiny_models) -> None:
    from engine.attention.cpu import CpuAttention

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(cache=EngineConfig().cache.__class__(dtype="fp8"))
    with pytest.raises(ValueError, match="compiled CPU kernels"):
        CpuAttention(4, 2, 64, 16, torch.float32, "int8", compiled=False)
    path = tiny_models("llama", 7, **MODELS["d64-gqa"])
    with pytest.raises(ValueError, match="not available on the triton-interpret"):
        LLM(model=str(path), dtype="float32", kv_cache_dtype="int8",
            attention_backend="triton-interpret")

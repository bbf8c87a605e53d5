"""Triton kernels against kernels/reference.py: compiled on a CUDA GPU when there is
one, else under TRITON_INTERPRET=1 (set by conftest). Small shapes: the interpreter runs
each program in numpy. The tests marked `gpu` need a GPU's memory and speed."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import reference as ref
from kernels.cascade_attention import CascadePrefix, cascade_attention, split_prefix
from kernels.fused_norm_rope_act import rms_norm, rope, silu_and_mul
from kernels.merge_attn_states import merge_attn_states
from kernels.paged_attention import paged_attention
from kernels.paged_decode_splitk import paged_decode_splitk
from kernels.reshape_and_cache import reshape_and_cache

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA GPU")
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def make_batch(q_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, d: int,
               bs: int, dtype: torch.dtype, num_blocks: int = 64, seed: int = 0,
               sparse_ids: bool = False):
    """Random caches and queries; each sequence gets its own random physical blocks
    (ids above 2^16 with sparse_ids, in a cache that is only touched where used)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in seq_lens]
    if sparse_ids:
        num_blocks = 70_001
        ids = torch.randperm(4_000, generator=g)[: sum(need)] + 66_000
    else:
        ids = torch.randperm(num_blocks, generator=g)[: sum(need)]
    # NaN wherever no sequence has a key (other blocks, the last block's tail): a kernel
    # must not load those slots (0 * NaN = NaN)
    kc = torch.full((num_blocks, bs, kv_heads, d), float("nan"), dtype=dtype)
    vc = torch.full((num_blocks, bs, kv_heads, d), float("nan"), dtype=dtype)
    kc[ids] = torch.randn(len(ids), bs, kv_heads, d, generator=g).to(dtype)
    vc[ids] = torch.randn(len(ids), bs, kv_heads, d, generator=g).to(dtype)
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    pos = 0
    for s, n in enumerate(need):
        table[s, :n] = ids[pos : pos + n].int()
        kc[table[s, n - 1], seq_lens[s] - (n - 1) * bs:] = float("nan")
        vc[table[s, n - 1], seq_lens[s] - (n - 1) * bs:] = float("nan")
        pos += n
    # q as a non-contiguous view (the q columns of a fused qkv projection)
    qkv = torch.randn(sum(q_lens), heads + 2 * kv_heads, d, generator=g).to(dtype).to(DEV)
    q = qkv[:, :heads]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return (q, *(t.to(DEV) for t in (kc, vc, table, lens, starts)))


BATCHES = {
    "prefill": ([7, 20], [7, 20]),
    "decode": ([1, 1, 1], [1, 17, 40]),
    "mixed": ([1, 1, 13, 5], [33, 16, 45, 5]),  # chunks after cached context, fresh prompt
}


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_attention_matches_reference(batch: str, group: int, dtype: torch.dtype) -> None:
    q_lens, seq_lens = BATCHES[batch]
    q, kc, vc, table, lens, starts = make_batch(q_lens, seq_lens, 2 * group, 2, 64, 16, dtype)
    out, lse = paged_attention(q, kc, vc, table, lens, starts, 0.125, max(q_lens),
                               return_lse=True)
    want, want_lse = ref.paged_attention(q, kc, vc, table, lens, starts, 0.125)
    close(out, want, dtype)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("bs,d", [(32, 64), (16, 128), (32, 128)])
def test_paged_attention_block_sizes_head_dims(bs: int, d: int) -> None:
    q_lens, seq_lens = BATCHES["mixed"]
    q, kc, vc, table, lens, starts = make_batch(q_lens, seq_lens, 6, 2, d, bs, torch.bfloat16)
    out = paged_attention(q, kc, vc, table, lens, starts, d**-0.5, max(q_lens))
    close(out, ref.paged_attention(q, kc, vc, table, lens, starts, d**-0.5)[0], torch.bfloat16)


def test_paged_attention_block_ids_above_2_16_in_a_sparse_cache() -> None:
    q_lens, seq_lens = [1, 9], [50, 30]
    q, kc, vc, table, lens, starts = make_batch(q_lens, seq_lens, 4, 1, 64, 16, torch.bfloat16,
                                                sparse_ids=True)
    assert int(table.max()) > 1 << 16
    out = paged_attention(q, kc, vc, table, lens, starts, 0.125, 9)
    close(out, ref.paged_attention(q, kc, vc, table, lens, starts, 0.125)[0], torch.bfloat16)


def poison_unseen_blocks(kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor,
                         q_lens: list[int], seq_lens: list[int], window: int) -> int:
    """NaN into each sequence's blocks that lie wholly before its first query's sliding
    window (a kernel that loads them fails: 0 * NaN); returns how many."""
    bs = kc.shape[1]
    ids = [int(table[s, b]) for s, (q, n) in enumerate(zip(q_lens, seq_lens))
           for b in range(max(0, n - q - window + 1) // bs)]
    kc[ids], vc[ids] = float("nan"), float("nan")
    return len(ids)


# decodes at positions 49 and 15, a 40-token chunk after 30 cached tokens (several
# programs of queries, each starting at its first query's window), a fresh prompt
WINDOW_BATCH = ([1, 1, 40, 5], [50, 16, 70, 5])


@pytest.mark.parametrize("bs,window,group,dtype", [
    (1, 1, 3, torch.float32), (16, 5, 3, torch.float32),
    (16, 16, 1, torch.float32), (16, 50, 8, torch.bfloat16), (32, 17, 3, torch.float32),
    (32, 100, 3, torch.float16)])
def test_paged_attention_sliding_window_matches_reference(bs: int, window: int, group: int,
                                                          dtype: torch.dtype) -> None:
    # windows of one key, off the block size, equal to a context (50) and past them all
    q_lens, seq_lens = WINDOW_BATCH
    q, kc, vc, table, lens, starts = make_batch(q_lens, seq_lens, 2 * group, 2, 64, bs, dtype,
                                                num_blocks=160, seed=window)
    want, want_lse = ref.paged_attention(q, kc, vc, table, lens, starts, 0.125, window=window)
    poisoned = poison_unseen_blocks(kc, vc, table, q_lens, seq_lens, window)
    assert poisoned > 0 or window >= 50
    out, lse = paged_attention(q, kc, vc, table, lens, starts, 0.125, max(q_lens),
                               return_lse=True, window=window)
    close(out, want, dtype)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("window,partition_blocks", [(1, 1), (20, 2), (40, 1), (45, 64)])
def test_split_k_decode_sliding_window_matches_reference(window: int,
                                                         partition_blocks: int) -> None:
    # partitions from the block where each sequence's window starts: fewer of them, none
    # reaching a block before the window
    seq_lens = [70, 3, 33, 16]
    q, kc, vc, table, lens, starts = make_batch([1] * 4, seq_lens, 6, 2, 64, 16, torch.float32,
                                                seed=window)
    want = ref.paged_attention(q, kc, vc, table, lens, starts, 0.125, window=window)[0]
    assert poison_unseen_blocks(kc, vc, table, [1] * 4, seq_lens, window) > 0
    out = paged_decode_splitk(q, kc, vc, table, lens, 0.125, max(seq_lens), partition_blocks,
                              window=window)
    close(out, want, torch.float32)


@pytest.mark.parametrize("window", [0, 5, 33])
def test_triton_backend_sliding_window_matches_reference(window: int) -> None:
    # forward(..., window=) of the backend over decodes, a chunk after cached context and
    # a fresh prompt (the step of tests/test_cpu_ops.py's CPU backend test)
    from engine.attention.triton import TritonAttention, TritonInterpretAttention
    from tests.test_cpu_ops import check_backend_window

    cls = TritonAttention if DEV == "cuda" else TritonInterpretAttention
    check_backend_window(cls(6, 2, 64, 16), window)


def test_triton_backend_takes_split_k_by_the_keys_a_decode_reads() -> None:
    """Split-K for a decode-only step whose decodes read SPLIT_K_MIN_CONTEXT keys or
    more: their context, or their window where that is shorter."""
    from engine.attention.triton import (SPLIT_K_MIN_CONTEXT, TritonInterpretAttention,
                                         TritonMetadata)

    attn = TritonInterpretAttention(4, 2, 64, 16)
    calls: list[tuple[str, int]] = []
    attn._paged = lambda *a, window: calls.append(("paged", window))  # type: ignore[assignment]
    attn._splitk = lambda *a, window: calls.append(("split", window))  # type: ignore[assignment]
    x = torch.zeros(1)
    for max_len, decode_only in ((SPLIT_K_MIN_CONTEXT + 900, True),
                                 (SPLIT_K_MIN_CONTEXT + 900, False)):
        meta = TritonMetadata(x, x, x, x, 1, max_len, decode_only)
        for window in (0, SPLIT_K_MIN_CONTEXT, SPLIT_K_MIN_CONTEXT - 1):
            attn.forward(x, x, x, x, x, meta, window=window)
    s = SPLIT_K_MIN_CONTEXT
    assert calls == [("split", 0), ("split", s), ("paged", s - 1),
                     ("paged", 0), ("paged", s), ("paged", s - 1)]


def test_paged_attention_rejects_bad_inputs() -> None:
    q, kc, vc, table, lens, starts = make_batch([1], [5], 2, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        paged_attention(q, kc, vc, table.long(), lens, starts, 0.1, 1)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q.to(torch.bfloat16), kc, vc, table, lens, starts, 0.1, 1)
    with pytest.raises(ValueError, match="powers of two"):
        paged_attention(q[..., :48], kc[..., :48], vc[..., :48], table, lens, starts, 0.1, 1)
    with pytest.raises(ValueError, match="window"):
        paged_attention(q, kc, vc, table, lens, starts, 0.1, 1, window=-1)
    with pytest.raises(ValueError, match="window"):
        paged_decode_splitk(q, kc, vc, table, lens, 0.1, 5, window=-1)


@pytest.mark.parametrize("partition_blocks", [1, 2, 64])  # many partitions ... one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_decode_matches_reference(partition_blocks: int, dtype: torch.dtype) -> None:
    seq_lens = [70, 3, 33, 16]
    q, kc, vc, table, lens, starts = make_batch([1] * 4, seq_lens, 6, 2, 64, 16, dtype)
    out = paged_decode_splitk(q, kc, vc, table, lens, 0.125, max(seq_lens), partition_blocks)
    close(out, ref.paged_attention(q, kc, vc, table, lens, starts, 0.125)[0], dtype)


@pytest.mark.parametrize("parts", [1, 2, 3])  # 3: an uneven split, a block left over
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_equals_plain_attention(dtype: torch.dtype, parts: int) -> None:
    """Three requests share a 64-token (4-block) cached prefix, then diverge; the prefix
    pass split into `parts` key partitions."""
    q_lens, seq_lens = [1, 6, 1], [72, 77, 65]
    q, kc, vc, table, lens, starts = make_batch(q_lens, seq_lens, 4, 2, 64, 16, dtype, seed=3)
    table[:, :4] = table[0, :4]  # the shared prefix: the same physical blocks
    plain = paged_attention(q, kc, vc, table, lens, starts, 0.125, max(q_lens))
    prefix = CascadePrefix.build(table[0, :4], 64, 16, q.shape[0], 4, 2, DEV, parts=parts)
    assert (prefix.parts, prefix.keys) == {1: (1, 64), 2: (2, 64), 3: (2, 64)}[parts]
    out = cascade_attention(q, kc, vc, prefix, table, lens, starts, 0.125, max(q_lens))
    close(out, plain, dtype)
    close(out, ref.paged_attention(q, kc, vc, table, lens, starts, 0.125)[0], dtype)
    # 3 of 4 blocks in the prefix pass: the fourth is read with each suffix
    odd = CascadePrefix.build(table[0, :3], 48, 16, q.shape[0], 4, 2, DEV, parts=3)
    close(cascade_attention(q, kc, vc, odd, table, lens, starts, 0.125, max(q_lens)), plain,
          dtype)
    too_long = CascadePrefix.build(table[0, :5], 80, 16, q.shape[0], 4, 2, DEV)
    with pytest.raises(ValueError, match="cover"):
        cascade_attention(q, kc, vc, too_long, table, lens, starts, 0.125, 6)
    with pytest.raises(ValueError, match="whole blocks"):
        CascadePrefix.build(table[0, :4], 60, 16, q.shape[0], 4, 2, DEV)


def test_split_prefix_takes_equal_partitions() -> None:
    assert split_prefix(124, 16) == (11, 11)  # 121 blocks in 11 parts, 3 left over
    assert split_prefix(128, 16) == (16, 8)
    assert split_prefix(7, 16) == (7, 1)  # never more partitions than blocks
    assert split_prefix(13, 1) == (1, 13)
    for blocks in range(1, 200):
        for want in (1, 5, 32):
            parts, per = split_prefix(blocks, want)
            assert 1 <= parts <= max(1, min(want, blocks)) and 0 <= blocks - parts * per < parts


def test_merge_attn_states_with_an_empty_part() -> None:
    g = torch.Generator().manual_seed(1)
    parts = torch.randn(3, 5, 4, 64, generator=g).to(DEV)
    lses = torch.randn(3, 5, 4, generator=g).to(DEV)
    lses[1, 2] = float("-inf")  # a partition that saw no key for token 2
    lses[:, 4] = float("-inf")  # a token that saw nothing at all
    out, lse = merge_attn_states(parts, lses, return_lse=True)
    want, want_lse = ref.merge_attn_states(parts, lses)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse)
    assert (out[4] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_skips_padding(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    k = torch.randn(6, 3, 64, generator=g).to(DEV, dtype)
    v = torch.randn(6, 3, 64, generator=g).to(DEV, dtype)
    slots = torch.tensor([5, 17, -1, 40, 41, -1], device=DEV)
    caches = [torch.zeros(4, 16, 3, 64, dtype=dtype, device=DEV) for _ in range(4)]
    reshape_and_cache(k, v, caches[0], caches[1], slots)
    ref.reshape_and_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].count_nonzero() == 4 * 3 * 64  # the -1 rows went nowhere


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_rope_silu_match_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 96, generator=g).to(DEV, dtype)
    res = torch.randn(5, 96, generator=g).to(DEV, dtype)
    w = (torch.rand(96, generator=g) + 0.5).to(DEV, dtype)
    for r in (None, res):
        got, got_res = rms_norm(x, w, 1e-5, r)
        want, want_res = ref.rms_norm(x, w, 1e-5, r)
        close(got, want, dtype)
        # (not bit-equal in bf16: the interpreter's fp32 -> bf16 cast truncates, a
        # GPU's rounds to nearest even, as torch does)
        close(got_res, want_res, dtype)
    cos, sin = (t.to(DEV) for t in ref.rope_cos_sin(64, 128, 10000.0))
    positions = torch.tensor([0, 3, 127, 64, 9], device=DEV)
    qk = torch.randn(5, 6, 64, generator=g).to(DEV, dtype)
    want = ref.rope(qk, *ref.rope_gather(cos, sin, positions, dtype))
    q, k = qk[:, :4], qk[:, 4:]  # views into one tensor, rotated in place
    rope(q, k, positions, cos, sin)
    close(qk, want, dtype)
    x2 = torch.randn(5, 2 * 80, generator=g).to(DEV, dtype)
    close(silu_and_mul(x2), ref.silu_and_mul(x2), dtype)


def test_gemma_norms_scale_in_fp32_before_the_cast_as_hf() -> None:
    """Gemma's (1 + w) RMSNorm in bf16: HF multiplies by the fp32 weight and rounds once;
    an fp32 weight makes every rms_norm do the same (the reference bit for bit with HF's
    module, the compiled CPU op through it, the Triton kernel to rounding), where a bf16
    (1 + w) multiplied after the cast rounds twice and differs."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from kernels import cpu_ops

    g = torch.Generator().manual_seed(6)
    x = (torch.randn(7, 96, generator=g) * 3).to(torch.bfloat16)
    res = torch.randn(7, 96, generator=g).to(torch.bfloat16)
    hf = Gemma3RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96, generator=g))
    hf = hf.to(torch.bfloat16)
    w32 = 1.0 + hf.weight.float()
    with torch.no_grad():
        want = hf(x + res)
    got, total = ref.rms_norm(x, w32, 1e-6, res)
    assert torch.equal(total, x + res) and torch.equal(got, want)
    twice, _ = ref.rms_norm(x, w32.to(torch.bfloat16), 1e-6, res)
    assert not torch.equal(twice, want)  # (what the bf16 weight gave)
    if cpu_ops.available():
        r = res.clone()
        got_cpu, new_res = cpu_ops.rms_norm(x, w32, 1e-6, r)
        assert torch.equal(got_cpu, want) and new_res is r and torch.equal(r, x + res)
    got_tr, _ = rms_norm(x.to(DEV), w32.to(DEV), 1e-6, res.to(DEV))
    close(got_tr.cpu(), want, torch.bfloat16)


def test_triton_backend_runs_a_shared_prefix_once_and_stays_exact(tiny_models,
                                                                   monkeypatch) -> None:
    """Steps whose sequences all share prefix blocks go through cascade_attention (the
    cost rule's thresholds lowered to this small step): greedy output equals HF. On a GPU
    eagerly, so that the decodes take it too (a captured decode graph never does)."""
    from engine import LLM, SamplingParams
    from engine.attention.triton import TritonAttention
    from tests.conftest import hf_greedy, random_prompts

    monkeypatch.setattr(TritonAttention, "CASCADE_MIN_SEQS", 2)
    monkeypatch.setattr(TritonAttention, "CASCADE_MIN_SAVED_BYTES", 0)
    path = tiny_models("llama", 0, head_dim=16)
    llm = LLM(model=str(path), dtype="float32", block_size=16, kv_tier="none",
              attention_backend="cuda" if DEV == "cuda" else "triton-interpret",
              enforce_eager=True)
    attn = llm.engine.runner.attn
    used = []
    real = attn._cascade
    monkeypatch.setattr(attn, "_cascade", lambda *a, **k: used.append(1) or real(*a, **k))
    system = random_prompts(1, 33, 33, 320, seed=21)[0]
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([system], SamplingParams(max_tokens=1))  # its 2 blocks, cached
    prompts = [system + t for t in random_prompts(3, 1, 6, 320, seed=22)]
    assert [o.token_ids for o in llm.generate(prompts, sp)] == hf_greedy(path, prompts, 3)
    assert used  # (the decode steps: every sequence behind the 32 shared keys)


def test_triton_cascade_rule_takes_only_steps_that_save_a_gigabyte() -> None:
    """The GPU cost rule (measured on an H200): a step goes through the cascade only when
    all its sequences share the prefix and the K/V reads it saves reach 1 GiB."""
    from engine.attention.triton import TritonAttention, TritonInterpretAttention

    backend = TritonAttention if DEV == "cuda" else TritonInterpretAttention

    def rows(n: int, shared: int, own: int = 64) -> list[tuple[int, int, list[int]]]:
        pb, ob = shared // 16, own // 16
        return [(1, shared + own, list(range(pb)) + list(range(pb + i * ob, pb + (i + 1) * ob)))
                for i in range(n)]

    small = backend(9, 3, 64, 16, torch.bfloat16)
    big = backend(32, 8, 64, 16, torch.bfloat16)
    assert small._prefix(rows(64, 1984)) is None  # chat-64 behind 2k tokens: 96 MB
    assert big._prefix(rows(256, 2048)) is None  # 0.53 GB
    plan = big._prefix(rows(256, 8192))  # 2.1 GB
    assert plan is not None and plan.keys == 8192
    assert big._prefix(rows(256, 8192)[:255] + [(1, 80, [9999] * 5)]) is None  # one apart


def test_engine_with_triton_interpret_backend_matches_cpu_backend(tiny_models) -> None:
    """The whole engine on the Triton kernels (attention, cache write, RMSNorm, RoPE,
    SiLU-mul) under the interpreter: the same greedy tokens as the CPU backend and HF,
    through chunked prefills mixed with decodes."""
    import random

    from engine import LLM, SamplingParams
    from tests.conftest import hf_greedy

    if DEV == "cuda":  # the kernels are compiled for the GPU in this process
        pytest.skip("a GPU is present: test_engine_on_cuda_matches_cpu_backend_and_hf")
    path = tiny_models("llama", 0, head_dim=16)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 23, 40)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("cpu", "triton-interpret"):
        llm = LLM(model=str(path), dtype="float32", block_size=16, max_num_batched_tokens=24,
                  attention_backend=backend, kv_tier="none", debug=True)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, sp)]
        if backend != "cpu":
            assert llm.engine.runner.kv_caches[0][0].shape[1:] == (16, 2, 16)  # its layout
            assert type(llm.engine.runner.model.ops).__name__ == "TritonOps"
    assert outs["triton-interpret"] == outs["cpu"] == hf_greedy(path, prompts, 6)


def test_decode_graph_path_matches_eager(tiny_models) -> None:
    """Decode steps through DecodeGraphs' static buffers (captured on a GPU; replayed
    eagerly under the interpreter): batches padded to the capture sizes (5 live
    sequences run as 8, then fewer as they finish), greedy, seeded sampling and logprobs
    (the CPU sampler on the graph's logits): the same tokens as the eager path, the CPU
    backend and, greedy, HF."""
    import random

    from engine import LLM, SamplingParams
    from engine.cuda_graphs import capture_sizes
    from tests.conftest import hf_greedy

    if DEV == "cuda":
        pytest.skip("a GPU is present: test_engine_on_cuda_matches_cpu_backend_and_hf")
    if os.environ.get("TIDEWIRE_TRITON_FULL", "") in ("", "0"):
        pytest.skip("three engines, two under the Triton interpreter: `make triton`")
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(6) == [1, 2, 4, 6] and capture_sizes(1) == [1]
    path = tiny_models("llama", 0, head_dim=16)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (3, 9, 17, 30, 4)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (7, 4, 2)]
    params += [SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
               SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, ignore_eos=True)]
    outs = {}
    for backend, eager in (("cpu", True), ("triton-interpret", True), ("triton-interpret", False)):
        llm = LLM(model=str(path), dtype="float32", block_size=4, num_kv_blocks=32, max_num_seqs=8,
                  max_num_batched_tokens=32, attention_backend=backend, kv_tier="none",
                  enforce_eager=eager, debug=True)
        res = llm.generate(prompts, params)
        outs[backend, eager] = [(o.token_ids, [(lp.token_id, [t for t, _ in lp.top])
                                               for lp in o.outputs[0].logprobs or []])
                                for o in res]
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        if graphs is not None:
            assert graphs.replays > 0
    assert outs["triton-interpret", False] == outs["triton-interpret", True] == outs["cpu", True]
    greedy = [p for p, sp in zip(prompts, params) if sp.temperature == 0.0]
    want = [hf_greedy(path, [p], sp.max_tokens)[0]
            for p, sp in zip(prompts, params) if sp.temperature == 0.0]
    assert [t for (t, _), sp in zip(outs["cpu", True], params) if sp.temperature == 0.0] == want
    assert len(greedy) == 4


def test_cuda_backend_refuses_clearly_without_a_gpu(tiny_models) -> None:
    from engine import LLM

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LLM(model=str(tiny_models("llama", 0)), dtype="float32", attention_backend="cuda",
            kv_tier="none")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_at_model_scale_on_gpu(dtype: torch.dtype) -> None:
    """Llama-3-8B heads (32 q, 8 KV, d128): a 512-token prefill chunk after 1.5k cached
    tokens, a fresh prompt, and decodes out to 4k, in one launch; the split-K decode at
    16k; both against the fp32 reference on the same 16-bit inputs."""
    q_lens, seq_lens = [512, 1, 1, 1, 37], [2048, 4000, 1, 777, 37]
    q, kc, vc, table, lens, starts = make_batch(q_lens, seq_lens, 32, 8, 128, 16, dtype,
                                                num_blocks=1024, seed=5)
    out = torch.full_like(q, float("nan"))  # every row must be written
    paged_attention(q, kc, vc, table, lens, starts, 128**-0.5, max(q_lens), out=out)
    close(out, ref.paged_attention(q, kc, vc, table, lens, starts, 128**-0.5)[0], dtype)
    seq_lens = [16384, 9000, 130, 2049]
    q, kc, vc, table, lens, starts = make_batch([1] * 4, seq_lens, 32, 8, 128, 16, dtype,
                                                num_blocks=2048, seed=6)
    got = paged_decode_splitk(q, kc, vc, table, lens, 128**-0.5, max(seq_lens), 32)
    close(got, ref.paged_attention(q, kc, vc, table, lens, starts, 128**-0.5)[0], dtype)


@gpu
def test_sliding_window_at_model_scale_on_gpu() -> None:
    """Mistral-7B heads (32 q, 8 KV, d128) in bf16, window 1000: a 512-token chunk after
    1.5k cached tokens, a fresh prompt and decodes out to 4k in one launch; the split-K
    decode at 16k with a window of 4096 (still split); blocks no window reaches are NaN."""
    q_lens, seq_lens = [512, 1, 1, 1, 37], [2048, 4000, 1, 777, 37]
    q, kc, vc, table, lens, starts = make_batch(q_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16,
                                                num_blocks=1024, seed=8)
    want = ref.paged_attention(q, kc, vc, table, lens, starts, 128**-0.5, window=1000)[0]
    assert poison_unseen_blocks(kc, vc, table, q_lens, seq_lens, 1000) > 100
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kc, vc, table, lens, starts, 128**-0.5, max(q_lens), out=out,
                    window=1000)
    close(out, want, torch.bfloat16)
    seq_lens = [16384, 9000, 130, 4097]
    q, kc, vc, table, lens, starts = make_batch([1] * 4, seq_lens, 32, 8, 128, 16,
                                                torch.bfloat16, num_blocks=2048, seed=9)
    want = ref.paged_attention(q, kc, vc, table, lens, starts, 128**-0.5, window=4096)[0]
    assert poison_unseen_blocks(kc, vc, table, [1] * 4, seq_lens, 4096) > 500
    got = paged_decode_splitk(q, kc, vc, table, lens, 128**-0.5, max(seq_lens), 32,
                              window=4096)
    close(got, want, torch.bfloat16)


@gpu
def test_kernels_address_a_cache_past_2_31_elements_on_gpu() -> None:
    """K/V caches of 2^31 + 2^21 bf16 elements each (~4.3 GB): the cache write, paged
    attention and split-K decode reach the blocks past element 2^31 (int64 offsets)."""
    bs, kvh, d, heads = 16, 8, 128, 32
    per_block = bs * kvh * d
    nb = (1 << 31) // per_block + 128
    kc = torch.empty(nb, bs, kvh, d, dtype=torch.bfloat16, device="cuda")
    vc = torch.empty_like(kc)
    g = torch.Generator(device="cuda").manual_seed(7)
    seq_lens = [300, 1000]  # 19 and 63 blocks, all of them past element 2^31
    high = torch.arange(nb - 128, nb, device="cuda", dtype=torch.int32)
    assert int(high[0]) * per_block >= 1 << 31
    table = torch.zeros(2, 63, dtype=torch.int32, device="cuda")
    table[0, :19], table[1] = high[:19], high[19:82]
    # write every token of both sequences through the kernel, then read it back
    slots = torch.cat([(table[s, : -(-n // bs)].long()[:, None] * bs
                        + torch.arange(bs, device="cuda")).flatten()[:n]
                       for s, n in enumerate(seq_lens)])
    k = torch.randn(len(slots), kvh, d, generator=g, device="cuda").bfloat16()
    v = torch.randn(len(slots), kvh, d, generator=g, device="cuda").bfloat16()
    reshape_and_cache(k, v, kc, vc, slots)
    assert torch.equal(kc.view(-1, kvh, d)[slots], k)
    assert torch.equal(vc.view(-1, kvh, d)[slots], v)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, 1, 41], dtype=torch.int32, device="cuda")  # a 40-token chunk
    q = torch.randn(41, heads, d, generator=g, device="cuda").bfloat16()
    want = ref.paged_attention(q, kc, vc, table, lens, starts, d**-0.5)[0]
    close(paged_attention(q, kc, vc, table, lens, starts, d**-0.5, 40), want, torch.bfloat16)
    q, starts = q[[0, 40]], torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    want = ref.paged_attention(q, kc, vc, table, lens, starts, d**-0.5)[0]
    close(paged_decode_splitk(q, kc, vc, table, lens, d**-0.5, max(seq_lens), 8), want,
          torch.bfloat16)

@gpu
@pytest.mark.parametrize("head_dim", [16, 64])
def test_engine_on_cuda_matches_cpu_backend_and_hf(tiny_models, head_dim: int) -> None:
    """The whole engine compiled for the GPU, fp32, eager and with CUDA graphs: the same
    greedy tokens as the CPU backend and HF, through chunked prefills (a 300-token prompt
    in 64-token chunks) mixed with decodes, graph-replayed decode steps, and split-K
    decodes past 2048 tokens of context (eager)."""
    import random

    from engine import LLM, SamplingParams
    from engine.attention.triton import SPLIT_K_MIN_CONTEXT
    from tests.conftest import hf_greedy

    path = tiny_models("llama", 0, head_dim=head_dim, max_position_embeddings=4096)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 23, 40, 300)]
    long = [[rng.randrange(3, 320) for _ in range(SPLIT_K_MIN_CONTEXT + 20)]]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend, eager in (("cpu", True), ("cuda", True), ("cuda", False)):
        llm = LLM(model=str(path), dtype="float32", block_size=16, max_num_batched_tokens=64,
                  max_num_seqs=8, attention_backend=backend, kv_tier="none",
                  enforce_eager=eager, debug=True)
        # the short ones alone (decode-only steps, graphs), then the long one (split-K)
        outs[backend, eager] = [o.token_ids for o in llm.generate(prompts, sp)] \
            + [o.token_ids for o in llm.generate(long, sp)]
        if backend == "cuda":
            assert llm.engine.runner.kv_caches[0][0].device.type == "cuda"
        if not eager:  # captured graphs, replayed for the decode-only steps
            graphs = llm.engine.runner.graphs
            assert sorted(graphs._graphs) == [1, 2, 4, 8] and graphs.replays > 0
    assert outs["cuda", False] == outs["cuda", True] == outs["cpu", True] \
        == hf_greedy(path, prompts + long, 16)


@pytest.mark.parametrize("backend", ["cpu", "triton-interpret", "cuda"])
def test_block_copies_round_trip_in_the_canonical_layout(tiny_models, backend: str) -> None:
    """The host tier's block copies (one gather / scatter over the whole cache) use the
    canonical layout [n, layers, 2, block_size, kv_heads, head_dim] whatever the
    backend's cache layout, touch only the named blocks, and (on a GPU) arrive through
    an asynchronous copy that BlockCopy.wait() completes; a snapshot taken before the
    blocks are overwritten keeps what they held."""
    from engine import LLM

    if backend == "cuda" and DEV != "cuda":
        pytest.skip("needs a CUDA GPU")
    if backend == "triton-interpret" and DEV == "cuda":
        pytest.skip("a GPU is present: the cuda case runs")
    llm = LLM(model=str(tiny_models("llama", 0)), dtype="float32", attention_backend=backend,
              kv_tier="none", enforce_eager=True)
    runner = llm.engine.runner
    ids = [5, 0, 2]
    data = torch.randn((len(ids), *runner.block_shape()), generator=torch.Generator().manual_seed(0))
    runner.write_blocks(ids, data)
    copy = runner.read_blocks(ids)
    assert (copy.done is not None) == (backend == "cuda")
    assert torch.equal(copy.wait(), data)
    for i, b in enumerate(ids):
        for layer, caches in enumerate(runner.kv_caches):
            for j, cache in enumerate(caches):  # K, then V
                block = cache[:, b].permute(1, 0, 2) if backend == "cpu" else cache[b]
                assert torch.equal(block.cpu(), data[i, layer, j])
    assert int(torch.count_nonzero(runner.kv)) == int(torch.count_nonzero(data))
    # A snapshot is the blocks as they were: a later write into them leaves it alone.
    snap = runner.snapshot_blocks(ids[::-1])
    runner.write_blocks(ids, torch.zeros_like(data))
    assert torch.equal(runner.to_host(snap).wait(), data.flip(0))
    assert int(torch.count_nonzero(runner.kv)) == 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_cpu_block_copies_of_many_blocks_round_trip_through_their_own_mapping(
        kv_cache_dtype: str) -> None:
    """A gather past HUGE_MIN_BYTES (a tier snapshot of many blocks) comes back in a
    mapping of its own, asked for transparent huge pages: the same blocks as a gather by
    index, scattered back bit for bit. Where the kernel gives huge pages only to memory
    that asks (THP `madvise`), touching it adds huge pages to the process."""
    from pathlib import Path

    from engine.attention.cpu import HUGE_MIN_BYTES, CpuAttention
    from kernels import cpu_ops

    q8 = kv_cache_dtype == "int8"
    if q8 and not cpu_ops.available():
        pytest.skip("the int8 cache needs the compiled CPU kernels")
    attn = CpuAttention(9, 3, 64, 16, torch.bfloat16, kv_cache_dtype, compiled=q8)
    layers, blocks = 6, 400
    kv = torch.empty((layers, 2, *attn.cache_shape(blocks)), dtype=attn.cache_dtype)
    kv.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(10, 10 + 300)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    rollup = Path("/proc/self/smaps_rollup")
    asks = thp.exists() and "[madvise]" in thp.read_text() and rollup.exists()

    def huge_kb() -> int:
        return sum(int(x.split()[1]) for x in rollup.read_text().splitlines()
                   if x.startswith("AnonHugePages")) if rollup.exists() else 0

    before = huge_kb()
    got = attn.gather_blocks(kv, ids)
    assert got.numel() * got.element_size() >= HUGE_MIN_BYTES
    assert tuple(got.shape) == (len(ids), *attn.block_shape(layers))
    if asks:
        assert huge_kb() > before
    by_index = kv.index_select(3, ids)  # [layers, 2, kv_heads, n, ...]
    want = by_index.permute(3, 0, 1, 2, 4) if attn.q8 else by_index.permute(3, 0, 1, 4, 2, 5)
    def raw(t: torch.Tensor) -> torch.Tensor:  # (random bytes: bf16 NaNs compare unequal)
        return t.contiguous().view(torch.uint8)

    assert torch.equal(raw(got), raw(want))
    dst = torch.zeros_like(kv)
    attn.scatter_blocks(dst, ids, got)
    assert torch.equal(raw(dst.index_select(3, ids)), raw(by_index))
    assert int(torch.count_nonzero(raw(dst))) == int(torch.count_nonzero(raw(by_index)))

"""The int8 KV cache ("q8", kernels/cpu/kv_q8.h) in the compiled CPU operators: the
quantizing cache write against kernels/reference.py bit for bit, and paged attention
over q8 caches against the fp32 reference run on the dequantized caches."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels import cpu_ops
from kernels import reference as ref
from tests.test_cpu_ops import unseen_blocks

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and not cpu_ops.available(),
                                reason="no C++ compiler here")


@pytest.fixture(autouse=True, scope="module")
def _kernels() -> None:
    assert cpu_ops.available()  # loads torch.ops.tidewire


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for ln in f if ln.startswith("flags") for w in ln.split()[2:]}
    except OSError:
        return set()


# the q8 decode kernel (quantized queries, integer dot products) needs AVX512-VNNI
VNNI = {"avx512_vnni", "avx512bw"} <= _cpu_flags()


def q8_cache(kv_heads: int, num_blocks: int, bs: int, d: int) -> torch.Tensor:
    return torch.zeros((kv_heads, num_blocks, bs * (d + 4)), dtype=torch.uint8)


def _q8_case(seqs, heads, kv_heads, d, bs, dtype, seed=0):
    """Random K/V for each (q_len, ctx) sequence written through ref.q8_write into
    shuffled physical blocks, every other byte 0xFF (NaN scales: what no sequence owns
    must never be read into a result); returns the q8 caches and their fp32
    dequantization in the reference's [num_blocks, block_size, kv_heads, d] layout."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-ctx // bs) for _, ctx in seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros((len(seqs), max(need)), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at : at + n]
        at += n
    kc = q8_cache(kv_heads, num_blocks, bs, d).fill_(0xFF)
    vc = q8_cache(kv_heads, num_blocks, bs, d).fill_(0xFF)
    slots = torch.tensor([int(table[i, p // bs]) * bs + p % bs
                          for i, (_, ctx) in enumerate(seqs) for p in range(ctx)])
    k = (torch.randn((len(slots), kv_heads, d), generator=g) * 2).to(dtype)
    v = torch.randn((len(slots), kv_heads, d), generator=g).to(dtype)
    ref.q8_write(kc, vc, k, v, slots)
    q_lens = [q for q, _ in seqs]
    q = torch.randn((sum(q_lens), heads, d), generator=g).to(dtype)
    qstart = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    lens = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    kf = ref.q8_dequantize(kc, d, biased=True).permute(1, 2, 0, 3)
    vf = ref.q8_dequantize(vc, d, biased=False).permute(1, 2, 0, 3)
    return q, kc, vc, kf, vf, table, lens, qstart


def _run(seqs, heads, kv_heads, d, bs, dtype, seed=0, num_decodes=None, window=0):
    """The kernel's output on a _q8_case; with a sliding window, blocks no window reaches
    are filled with 0xFF first (NaN scales: reading them shows)."""
    q, kc, vc, kf, vf, table, lens, qstart = _q8_case(seqs, heads, kv_heads, d, bs, dtype, seed)
    kf, vf = kf.nan_to_num(0.0), vf.nan_to_num(0.0)  # (the reference masks after the product)
    unseen = unseen_blocks(seqs, table, bs, window)
    kc[:, unseen], vc[:, unseen] = 0xFF, 0xFF
    out = torch.full_like(q, float("nan"))
    cpu_ops.paged_attention(out, q, kc, vc, table, lens, qstart, d**-0.5, num_decodes,
                            window=window)
    assert not out.isnan().any()
    return q, out.float(), kf, vf, table, lens, qstart


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_q8_rope_cache_writes_the_reference_codes_and_scales(dtype, head_dim) -> None:
    g = torch.Generator().manual_seed(5)
    heads, kvh, n, bs, nb = 6, 2, 13, 16, 5
    qkv = (torch.randn(n, (heads + 2 * kvh) * head_dim, generator=g) * 3).to(dtype)
    qkv[4, heads * head_dim : (heads + 1) * head_dim] = 0  # an all-zero K row: scale 0
    pos = torch.randint(0, 500, (n,), generator=g)
    cos, sin = ref.rope_cos_sin(head_dim, 512, 10000.0)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[3] = -1  # padding rows are not stored
    kc, vc = q8_cache(kvh, nb, bs, head_dim), q8_cache(kvh, nb, bs, head_dim)
    want_k, want_v = kc.clone(), vc.clone()
    roped = qkv.clone()
    cpu_ops.rope_cache(roped, pos, cos, sin, kc, vc, slots, heads)
    k = roped[:, heads * head_dim : (heads + kvh) * head_dim].view(n, kvh, head_dim)
    v = roped[:, (heads + kvh) * head_dim :].view(n, kvh, head_dim)
    ref.q8_write(want_k, want_v, k, v, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert int((kc != 0).sum()) > 0
    # the codes hold the rows to within half a step of their scale
    back = ref.q8_dequantize(kc, head_dim, biased=True).view(kvh, -1, head_dim)
    _, scales = ref.q8_views(kc, head_dim)
    for i in range(n):
        if i == 3:
            continue
        err = (back[:, slots[i]] - k[i].float()).abs().amax(-1)
        assert (err <= scales.reshape(kvh, -1)[:, slots[i]] * 0.5 + 1e-6).all()
    assert float(scales.reshape(kvh, -1)[0, slots[4]]) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [1, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (16, 2)])
def test_q8_prefill_chunks_match_the_dequantized_reference(dtype, bs, heads, kv_heads) -> None:
    # prefill chunks dequantize tiles and run fp32 (or bf16) arithmetic: they match the
    # reference on the dequantized cache as closely as a bf16/fp32 cache does, one-token
    # chunks (and one-token tails of a chunk's items) included
    seqs = [(1, 1), (1, 37), (5, 5), (70, 90), (33, 33), (2, 47), (1, 20)]
    q, out, kf, vf, table, lens, qstart = _run(seqs, heads, kv_heads, 64, bs, dtype,
                                               num_decodes=0)
    want, _ = ref.paged_attention(q.float(), kf, vf, table, lens, qstart, 64**-0.5)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    # the first two as decodes: their queries may go through int8 (the VNNI kernel), so
    # they are close, not exact; the chunks stay exact
    q, out, kf, vf, table, lens, qstart = _run(seqs, heads, kv_heads, 64, bs, dtype,
                                               num_decodes=2)
    rows = slice(2, None)
    torch.testing.assert_close(out[rows], want[rows], atol=tol, rtol=tol)
    torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not VNNI, reason="the q8 decode kernel needs AVX512-VNNI")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (16, 2), (6, 6)])
def test_q8_decodes_match_the_reference_with_int8_queries(dtype, d, heads, kv_heads) -> None:
    # the decode kernel: 16-key chunks in 64-key tiles, contexts on and either side of
    # those edges and of the blocks, prefetches running from item to item; it equals the
    # reference fed the same int8 queries (ref.quantize_queries) up to fp32 rounding
    lens = [1, 15, 16, 17, 31, 63, 64, 65, 127, 128, 129, 200, 1000, 2]
    for bs, order in ((16, 1), (32, -1)):
        seqs = [(1, n) for n in lens[::order]]
        q, out, kf, vf, table, lens_t, qstart = _run(seqs, heads, kv_heads, d, bs, dtype,
                                                     seed=d + heads + bs)
        want, _ = ref.paged_attention(ref.quantize_queries(q), kf, vf, table, lens_t, qstart,
                                      d**-0.5)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [1, 16, 32])
@pytest.mark.parametrize("window", [1, 17, 40, 300])
def test_q8_sliding_window_matches_the_dequantized_reference(dtype, bs, window) -> None:
    # windows of one key, off the block and chunk sizes, equal to a context (40) and past
    # all of them; chunks after cached context, a fresh prompt, and decodes through the
    # integer kernel (num_decodes=3: close) and the dequantizing tile loop (exact)
    seqs = [(1, 150), (1, 40), (1, 70), (5, 5), (70, 90), (2, 47), (1, 20)]
    q, out, kf, vf, table, lens, qstart = _run(seqs, 9, 3, 64, bs, dtype, seed=window,
                                               num_decodes=3, window=window)
    want, _ = ref.paged_attention(q.float(), kf, vf, table, lens, qstart, 64**-0.5,
                                  window=window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[3:], want[3:], atol=tol, rtol=tol)
    if VNNI and bs > 1:  # the integer kernel: exact against the same int8 queries
        want, _ = ref.paged_attention(ref.quantize_queries(q), kf, vf, table, lens, qstart,
                                      64**-0.5, window=window)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:3], want[:3], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_sliding_window_decodes_split_and_across_chunk_edges(dtype) -> None:
    # windows starting on and either side of 16-key chunks; a long context whose window
    # is split into parts
    lens = [1, 15, 16, 17, 63, 64, 65, 129, 200, 2]
    for window in (1, 16, 17, 65):
        q, out, kf, vf, table, lens_t, qstart = _run([(1, n) for n in lens], 8, 2, 128, 16,
                                                     dtype, seed=window, window=window)
        want, _ = ref.paged_attention(ref.quantize_queries(q) if VNNI else q.float(), kf, vf,
                                      table, lens_t, qstart, 128**-0.5, window=window)
        torch.testing.assert_close(out, want, atol=1e-4 if dtype == torch.float32 else 2e-2,
                                   rtol=2e-2)
    q, out, kf, vf, table, lens_t, qstart = _run([(1, 8192)], 9, 3, 64, 16, dtype, seed=3,
                                                 window=3000)
    want, _ = ref.paged_attention(ref.quantize_queries(q) if VNNI else q.float(), kf, vf, table,
                                  lens_t, qstart, 64**-0.5, window=3000)
    torch.testing.assert_close(out, want, atol=2e-3 if dtype == torch.float32 else 2e-2,
                               rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_32k_context_is_split_and_merged(dtype) -> None:
    seqs = [(1, 32768), (2, 3000)]
    q, out, kf, vf, table, lens, qstart = _run(seqs, 9, 3, 64, 16, dtype, seed=11)
    want, _ = ref.paged_attention(ref.quantize_queries(q) if VNNI else q.float(), kf, vf, table,
                                  lens, qstart, 64**-0.5)
    torch.testing.assert_close(out[:1], want[:1], atol=2e-3 if dtype == torch.float32 else 2e-2,
                               rtol=2e-2)
    torch.testing.assert_close(out[1:], want[1:], atol=3e-2, rtol=3e-2)


def test_q8_caches_are_checked() -> None:
    q, kc, vc, _, _, table, lens, qstart = _q8_case([(1, 20)], 4, 2, 64, 16, torch.float32)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="q8"):
        cpu_ops.paged_attention(out, q, kc[..., :-1].contiguous(), vc[..., :-1].contiguous(),
                                table, lens, qstart, 0.125)
    with pytest.raises(RuntimeError, match="alike"):
        cpu_ops.paged_attention(out, q, kc, vc.view(torch.int8), table, lens, qstart, 0.125)


def test_q8_block_sizes_other_than_16_and_mixed_decodes_stay_close() -> None:
    # block size 8: decodes cannot take the 16-key chunk kernel and dequantize instead
    seqs = [(1, 9), (1, 300), (3, 40)]
    q, out, kf, vf, table, lens, qstart = _run(seqs, 9, 3, 64, 8, torch.float32, seed=5,
                                               num_decodes=2)
    want, _ = ref.paged_attention(q.float(), kf, vf, table, lens, qstart, 64**-0.5)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)

"""Parity of the compiled CPU operators (kernels/cpu/*.cpp) with their torch references
(kernels/reference.py)."""

from __future__ import annotations

import contextlib
import shutil
from typing import Iterator

import pytest
import torch

from kernels import cpu_ops
from kernels import reference as ref

# Where a compiler exists the kernels must build: a broken build fails here, not skips.
pytestmark = pytest.mark.skipif(shutil.which("c++") is None and not cpu_ops.available(),
                                reason="no C++ compiler here")


@pytest.fixture(autouse=True, scope="module")
def _kernels() -> None:
    cpu_ops.available()  # loads torch.ops.tidewire (for tests run alone, -k)


def test_the_kernels_build_where_a_compiler_exists() -> None:
    assert cpu_ops.available()


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _paged_case(seqs: list[tuple[int, int]], heads: int, kv_heads: int, d: int, bs: int,
                dtype: torch.dtype, seed: int = 0):
    """Random caches holding each (q_len, ctx) sequence in shuffled physical blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-ctx // bs) for _, ctx in seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    width = max(need)
    table = torch.zeros((len(seqs), width), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at : at + n]
        at += n
    k_cache = torch.randn((kv_heads, num_blocks, bs, d), generator=g).to(dtype)
    v_cache = torch.randn((kv_heads, num_blocks, bs, d), generator=g).to(dtype)
    q_lens = [q for q, _ in seqs]
    q = torch.randn((sum(q_lens), heads, d), generator=g).to(dtype)
    qstart = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    lens = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    return q, k_cache, v_cache, table, lens, qstart


def unseen_blocks(seqs: list[tuple[int, int]], table: torch.Tensor, bs: int,
                  window: int) -> list[int]:
    """Physical blocks that no query of their sequence sees under a sliding window:
    whole blocks before the first query's window start (its position - window + 1)."""
    if window <= 0:
        return []
    return [int(table[i, b]) for i, (q_len, ctx) in enumerate(seqs)
            for b in range(max(0, ctx - q_len - window + 1) // bs)]


def _check_attention(seqs, heads, kv_heads, d, bs, dtype, seed=0, window=0):
    q, kc, vc, table, lens, qstart = _paged_case(seqs, heads, kv_heads, d, bs, dtype, seed)
    scale = d**-0.5
    # the reference reads [num_blocks, block_size, kv_heads, d]: a permuted view
    want, _ = ref.paged_attention(q.float(), kc.permute(1, 2, 0, 3).float(),
                                  vc.permute(1, 2, 0, 3).float(), table, lens, qstart, scale,
                                  window=window)
    # NaN in blocks outside every window: a kernel that reads them (0 * NaN) fails
    unseen = unseen_blocks(seqs, table, bs, window)
    kc[:, unseen], vc[:, unseen] = float("nan"), float("nan")
    out = torch.full_like(q, float("nan"))
    cpu_ops.paged_attention(out, q, kc, vc, table, lens, qstart, scale, window=window)
    torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    return len(unseen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [1, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (16, 2)])
def test_paged_attention_mixed_batch_matches_reference(dtype, bs, heads, kv_heads) -> None:
    # decodes (one query) with ragged contexts, then prefill chunks with and without cached
    # context; lengths not multiples of the block size
    seqs = [(1, 1), (1, 37), (1, 100), (1, 16), (5, 5), (70, 90), (33, 33), (2, 47)]
    _check_attention(seqs, heads, kv_heads, 64, bs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (16, 2), (6, 6)])
def test_paged_attention_decodes_across_chunk_tile_and_block_edges(dtype, d, heads,
                                                                   kv_heads) -> None:
    # the bf16 decode path reads keys by 16-key chunks in 64-key tiles: contexts on and
    # either side of those edges, in a batch long enough that each thread's prefetch
    # stream runs from one work item into the next
    lens = [1, 15, 16, 17, 31, 63, 64, 65, 127, 128, 129, 200, 1000, 2]
    _check_attention([(1, n) for n in lens], heads, kv_heads, d, 16, dtype, seed=d + heads)
    _check_attention([(1, n) for n in lens[::-1]], heads, kv_heads, d, 32, dtype, seed=d)


@pytest.mark.parametrize("d", [16, 32, 128])
def test_paged_attention_head_dims(d) -> None:
    _check_attention([(1, 20), (9, 40), (1, 3)], 8, 2, d, 16, torch.float32, seed=d)


def test_paged_attention_prefill_tiles_longer_than_a_work_item() -> None:
    # 300 query tokens with GQA 3: several query tiles per (sequence, KV head), causal
    # across tile edges
    _check_attention([(300, 300), (1, 5)], 9, 3, 64, 16, torch.float32, seed=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_32k_context_is_split_and_merged_exactly(dtype) -> None:
    # one long decode: too few work items for the threads, so the context is split into
    # parts whose results are merged by log-sum-exp
    _check_attention([(1, 32768)], 9, 3, 64, 16, dtype, seed=3)
    _check_attention([(1, 32768), (2, 3000)], 4, 4, 64, 32, dtype, seed=4)


MIXED = [(1, 1), (1, 37), (1, 100), (1, 16), (5, 5), (70, 90), (33, 33), (2, 47)]


@contextlib.contextmanager
def amx_as(on: bool) -> Iterator[None]:
    """The compiled kernels with their AMX paths on or off (skips where on is asked and
    the CPU has no AMX, or Linux refused the tile state)."""
    if on and not cpu_ops.amx():
        pytest.skip("AMX: not on this CPU, or Linux refused this process the tile state")
    was = cpu_ops.amx()
    try:
        assert cpu_ops.amx(on) == on
        yield
    finally:
        cpu_ops.amx(was)


# bf16 prefill rows on the matrix unit: head dims (a multiple of 32), GQA ratios, block
# sizes (one that splits a 16-key row block across blocks), query tiles of 8 to 64 rows
# (a verification of 5 tokens x 3 heads: 15) with and without cached context
AMX_SHAPES = [(64, 9, 3, 16), (64, 32, 8, 32), (96, 8, 8, 16), (128, 16, 2, 16),
              (128, 32, 8, 1), (256, 4, 1, 32), (64, 4, 4, 5)]
AMX_SEQS = [(1, 50), (40, 40), (70, 1000), (17, 100), (5, 300), (2, 2), (130, 130)]


@pytest.mark.parametrize("amx", [False, True], ids=["avx512", "amx"])
@pytest.mark.parametrize("d,heads,kv_heads,bs", AMX_SHAPES)
def test_paged_attention_prefill_rows_match_reference_with_and_without_amx(
        amx: bool, d: int, heads: int, kv_heads: int, bs: int) -> None:
    with amx_as(amx):
        _check_attention(AMX_SEQS, heads, kv_heads, d, bs, torch.bfloat16, seed=d + bs)


@pytest.mark.parametrize("amx", [False, True], ids=["avx512", "amx"])
def test_paged_attention_prefill_chunk_at_32k_and_windows_with_and_without_amx(amx) -> None:
    # a chunk at the end of a 32k context (keys past the first 64k tile boundaries and a
    # row block whose tokens straddle tiles), a chunk beside a decode split into parts;
    # sliding windows that start inside tiles and leave rows nothing in some
    with amx_as(amx):
        _check_attention([(40, 32768)], 9, 3, 64, 16, torch.bfloat16, seed=11)
        _check_attention([(1, 20000), (24, 3000)], 8, 2, 128, 32, torch.bfloat16, seed=12)
        for window in (5, 70):
            _check_attention([(300, 300), (1, 5), (40, 260)], 16, 2, 64, 16, torch.bfloat16,
                             seed=window, window=window)


def _cascade_case(dtype: torch.dtype, q8: bool, seed: int):
    """A step of 16 sequences in random sharing patterns: three groups whose members'
    block tables begin with the same blocks (8, 4 and 1 blocks of 16), one member whose
    whole context before its queries is the shared part, decodes and prefill chunks
    among the members, and sequences that share nothing."""
    g = torch.Generator().manual_seed(seed)
    bs, kvh, heads, d = 16, 2, 8, 64
    shared_blocks = [8, 4, 1]
    seqs, groups, nxt = [], [], 0  # (q_len, ctx, table)
    for gi, nb in enumerate(shared_blocks):
        prefix = list(range(nxt, nxt + nb))
        nxt += nb
        members = []
        for j in range(4 - gi):
            q_len = 1 if j % 2 == 0 else int(torch.randint(2, 20, (1,), generator=g))
            own = 0 if j == 1 else int(torch.randint(1, 60, (1,), generator=g))
            ctx = nb * bs + own + q_len
            extra = -(-ctx // bs) - nb
            members.append(len(seqs))
            seqs.append((q_len, ctx, prefix + list(range(nxt, nxt + extra))))
            nxt += extra
        groups.append((members, nb * bs))
    for _ in range(16 - len(seqs)):  # sharing nothing
        q_len = int(torch.randint(1, 9, (1,), generator=g))
        ctx = int(torch.randint(9, 150, (1,), generator=g))
        n = -(-ctx // bs)
        seqs.append((q_len, ctx, list(range(nxt, nxt + n))))
        nxt += n
    order = torch.randperm(len(seqs), generator=g).tolist()  # groups scattered in the batch
    where = {old: new for new, old in enumerate(order)}
    seqs = [seqs[i] for i in order]
    groups = [([where[m] for m in members], keys) for members, keys in groups]
    width = max(len(t) for _, _, t in seqs)
    table = torch.tensor([t + [0] * (width - len(t)) for _, _, t in seqs], dtype=torch.int32)
    lens = torch.tensor([c for _, c, _ in seqs], dtype=torch.int32)
    qstart = torch.tensor([0] + [q for q, _, _ in seqs]).cumsum(0).to(torch.int32)
    k = torch.randn(kvh, nxt, bs, d, generator=g).to(dtype)
    v = torch.randn(kvh, nxt, bs, d, generator=g).to(dtype)
    q = torch.randn(int(qstart[-1]), heads, d, generator=g).to(dtype)
    want, _ = ref.paged_attention(q.float(), k.permute(1, 2, 0, 3).float(),
                                  v.permute(1, 2, 0, 3).float(), table, lens, qstart, d**-0.5)
    if q8:
        kc = torch.empty(kvh, nxt, bs * (d + 4), dtype=torch.uint8)
        vc = torch.empty_like(kc)
        slots = torch.arange(nxt * bs)
        ref.q8_write(kc, vc, k.reshape(kvh, -1, d).transpose(0, 1),
                     v.reshape(kvh, -1, d).transpose(0, 1), slots)
    else:
        kc, vc = k, v
    members = torch.tensor([m for ms, _ in groups for m in ms], dtype=torch.int32)
    offsets = torch.tensor([0] + [len(ms) for ms, _ in groups]).cumsum(0).to(torch.int32)
    shared = torch.tensor([keys for _, keys in groups], dtype=torch.int32)
    return q, kc, vc, table, lens, qstart, want, (members, offsets, shared), d**-0.5


@pytest.mark.parametrize("amx", [False, True], ids=["avx512", "amx"])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "q8"])
def test_cascade_attention_equals_per_sequence_attention(kind: str, amx: bool) -> None:
    """Shared prefixes read once for their groups and merged by log-sum-exp give each row
    what attention over its whole context gives, to rounding; the rows of sequences that
    share nothing are the same as without the cascade."""
    if amx and kind == "float32":
        pytest.skip("fp32 never runs on the matrix unit")
    dtype = torch.float32 if kind == "float32" else torch.bfloat16
    with amx_as(amx):
        for seed in (1, 2, 3):
            q, kc, vc, table, lens, qstart, want, cascade, scale = _cascade_case(
                dtype, kind == "q8", seed)
            plain = torch.full_like(q, float("nan"))
            cpu_ops.paged_attention(plain, q, kc, vc, table, lens, qstart, scale)
            got = torch.full_like(q, float("nan"))
            cpu_ops.paged_attention(got, q, kc, vc, table, lens, qstart, scale, cascade=cascade)
            tol = 2e-5 if dtype == torch.float32 else (4e-2 if kind == "q8" else 2e-2)
            torch.testing.assert_close(got.float(), plain.float(), atol=tol, rtol=tol)
            if kind != "q8":  # (the q8 cache's own rounding is the reference's distance)
                torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
            alone = torch.ones(len(qstart) - 1, dtype=torch.bool)
            alone[cascade[0].long()] = False
            rows = torch.cat([torch.arange(int(qstart[s]), int(qstart[s + 1]))
                              for s in range(len(alone)) if alone[s]])
            assert torch.equal(got[rows], plain[rows])


def test_cascade_attention_refuses_what_it_cannot_merge() -> None:
    q, kc, vc, table, lens, qstart, _, (members, offsets, shared), scale = _cascade_case(
        torch.float32, False, 4)
    out = torch.empty_like(q)

    def run(m, o, s, window=0):  # noqa: ANN001, ANN202
        cpu_ops.paged_attention(out, q, kc, vc, table, lens, qstart, scale, window=window,
                                cascade=(m, o, s))
    with pytest.raises(RuntimeError, match="before every query"):
        run(members, offsets, shared + 10_000)
    with pytest.raises(RuntimeError, match="distinct"):
        run(torch.cat([members, members[:1]]), torch.cat([offsets[:-1], offsets[-1:] + 1]),
            shared)
    other = table.clone()
    other[int(members[0]), 0] = 10_000  # a member whose first block differs
    with pytest.raises(RuntimeError, match="share the blocks"):
        cpu_ops.paged_attention(out, q, kc, vc, other, lens, qstart, scale,
                                cascade=(members, offsets, shared))
    with pytest.raises(RuntimeError, match="sliding window"):
        run(members, offsets, shared, window=5)


def test_cascade_groups_find_shared_whole_blocks_before_every_query() -> None:
    from engine.attention.base import cascade_groups

    tables = [[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 7], [5, 6], [1, 2, 3, 4, 8], [5, 6, 10]]
    lens = [60, 60, 40, 30, 70, 33]
    q_lens = [1, 1, 1, 1, 40, 1]
    groups = cascade_groups(tables, lens, q_lens, 16)
    # sequences 0, 1, 2, 4 begin with blocks 1, 2 (32 keys; sequence 4's queries start at
    # 30, so its group's shared keys end at 16); 3 and 5 share block 5, 6 (32 keys, but 3's
    # query sits at 29: 16)
    assert sorted((sorted(m), k) for m, k in groups) == [([0, 1, 2, 4], 16), ([3, 5], 16)]
    assert cascade_groups([[1, 2], [3, 4]], [20, 20], [1, 1], 16) == []


def test_cascade_cost_rule_follows_the_matrix_unit() -> None:
    """The shared-prefix rule's thresholds, at the points `tidewire bench cascade` measured:
    with AMX tiles 8 members of 256 keys pay (1.26x there); on AVX-512 rows they lose
    (0.78x on a Zen 4) and need 256 shared keys and 3,072 saved."""
    from engine.attention.cpu import CpuAttention

    attn = CpuAttention(9, 3, 64, 16, torch.float32, compiled=False)
    pays = attn._cascade_pays  # (members, stacked rows, shared keys)
    for tiles, taken, left in (
            (True, [(8, 24, 256), (64, 192, 64), (16, 48, 128)], [(2, 6, 2048), (3, 9, 256)]),
            (False, [(16, 48, 256), (8, 24, 2048), (64, 192, 2048), (4, 12, 2048)],
             [(8, 24, 256), (64, 192, 64), (2, 6, 2048), (2, 8, 2048)])):
        attn._tiles = tiles
        assert all(pays(*g) for g in taken), (tiles, [g for g in taken if not pays(*g)])
        assert not any(pays(*g) for g in left), (tiles, [g for g in left if pays(*g)])


def test_paged_attention_amx_and_avx512_paths_agree() -> None:
    """The matrix unit sums the same bf16 products in another order: the two paths differ
    by rounding only (tighter than either's distance to the fp32 reference)."""
    if not cpu_ops.amx():
        pytest.skip("AMX: not on this CPU, or Linux refused this process the tile state")
    q, kc, vc, table, lens, qstart = _paged_case(AMX_SEQS, 32, 8, 128, 16, torch.bfloat16, 13)
    outs = []
    for amx in (False, True):
        with amx_as(amx):
            out = torch.full_like(q, float("nan"))
            cpu_ops.paged_attention(out, q, kc, vc, table, lens, qstart, 128**-0.5)
            outs.append(out.float())
    torch.testing.assert_close(outs[1], outs[0], atol=8e-3, rtol=8e-3)
    assert not torch.equal(outs[1], outs[0])  # (the switch reached the kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [1, 16, 32])
@pytest.mark.parametrize("window", [1, 7, 16, 33, 90, 500])
def test_paged_attention_sliding_window_matches_reference(dtype, bs, window) -> None:
    # windows of one key, not multiples of the block size, equal to a context (33, 90)
    # and past every one (500, full causal attention); decodes, a fresh prompt and chunks
    # after cached context (each query row with its own window start); blocks that no
    # window reaches hold NaN
    poisoned = _check_attention(MIXED, 9, 3, 64, bs, dtype, seed=window, window=window)
    assert poisoned > 0 or window > 33


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (16, 2)])
def test_paged_attention_sliding_window_gqa_and_long_prefills(heads, kv_heads) -> None:
    # 300-token prompts over several query tiles: later tiles start past the first's
    # window, rows see nothing in a tile's first keys; a window of 5 and one of 70
    for window in (5, 70):
        _check_attention([(300, 300), (1, 5), (40, 260)], heads, kv_heads, 64, 16,
                         torch.float32, seed=window, window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_sliding_window_decodes_across_chunk_and_tile_edges(dtype) -> None:
    # the bf16 decode kernel reads 16-key chunks: windows starting on and either side of
    # chunk, tile and block edges, for block sizes 16 and 32 and head dims 64 and 128
    lens = [1, 15, 16, 17, 31, 63, 64, 65, 127, 128, 129, 200, 1000, 2]
    for window in (1, 15, 16, 17, 64, 100):
        _check_attention([(1, n) for n in lens], 9, 3, 64, 16, dtype, seed=window,
                         window=window)
        _check_attention([(1, n) for n in lens[::-1]], 8, 1, 128, 32, dtype, seed=window,
                         window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_sliding_window_of_a_split_long_context(dtype) -> None:
    # one long decode: the window's keys (3000: more than two parts' worth) split into
    # parts from the window's start; 700 keys, beside a chunk, stay one item
    _check_attention([(1, 8192)], 9, 3, 64, 16, dtype, seed=5, window=3000)
    _check_attention([(1, 8192), (2, 3000)], 9, 3, 64, 16, dtype, seed=6, window=700)


def check_backend_window(attn, window: int, dtype: torch.dtype = torch.float32) -> None:
    """An attention backend's forward(..., window=) over one step against the reference:
    three decodes (one bucket, padded, for the torch fallback), a 20-token chunk after 30
    cached tokens and a fresh 12-token prompt, every key written through write_cache."""
    from engine.attention.base import PrefillSpec, StepLayout

    g = torch.Generator().manual_seed(window)
    bs, kvh, d, heads = attn.block_size, attn.num_kv_heads, attn.head_dim, attn.num_heads
    ctxs, q_lens = [70, 40, 9, 50, 12], [1, 1, 1, 20, 12]
    need = [-(-n // bs) for n in ctxs]
    perm = torch.randperm(sum(need) + 2, generator=g).tolist()
    ids = [perm[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(ctxs))]
    slots = [[ids[i][p // bs] * bs + p % bs for p in range(n)] for i, n in enumerate(ctxs)]
    k_all = torch.randn(sum(ctxs), kvh, d, generator=g).to(dtype)
    v_all = torch.randn(sum(ctxs), kvh, d, generator=g).to(dtype)
    dev = attn.device
    k_cache = torch.zeros(attn.cache_shape(len(perm)), dtype=attn.cache_dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    fill = StepLayout([x for sl in slots for x in sl], [], [], [])
    attn.write_cache(k_all.to(dev), v_all.to(dev), k_cache, v_cache, attn.build_metadata(fill))
    # the step's rows: each sequence's last q_len tokens
    rows = [sum(ctxs[:i]) + n - q + j for i, (n, q) in enumerate(zip(ctxs, q_lens))
            for j in range(q)]
    prefills = [PrefillSpec(3, 20, 50, ids[3]), PrefillSpec(23, 12, 12, ids[4])]
    layout = StepLayout([x for i, sl in enumerate(slots) for x in sl[ctxs[i] - q_lens[i]:]],
                        ctxs[:3], ids[:3], prefills)
    meta = attn.build_metadata(layout)
    q = torch.randn(len(rows), heads, d, generator=g).to(dtype)
    out = attn.forward(q.to(dev), k_all[rows].to(dev), v_all[rows].to(dev), k_cache, v_cache,
                       meta, window=window)
    ref_k = torch.zeros(len(perm) * bs, kvh, d)
    ref_v = torch.zeros_like(ref_k)
    flat = torch.tensor([x for sl in slots for x in sl])
    ref_k[flat], ref_v[flat] = k_all.float(), v_all.float()
    table = torch.zeros(len(ctxs), max(need), dtype=torch.int32)
    for i, b in enumerate(ids):
        table[i, : len(b)] = torch.tensor(b)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    want, _ = ref.paged_attention(q.float(), ref_k.view(-1, bs, kvh, d),
                                  ref_v.view(-1, bs, kvh, d), table,
                                  torch.tensor(ctxs, dtype=torch.int32), starts, attn.scale,
                                  window=window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("window", [0, 1, 5, 16, 33, 200])
def test_cpu_backend_sliding_window_matches_reference(compiled, window) -> None:
    # the torch fallback (SDPA over gathered blocks: the decode bucket's and each
    # chunk's mask, a fresh prompt's too) and the compiled kernel, block size 16
    from engine.attention.cpu import CpuAttention

    check_backend_window(CpuAttention(6, 2, 64, 16, compiled=compiled), window)


def _step_by_ops(x, positions, slots, table, lens, qstart, cos, sin, kcs, vcs, norms, linears,
                 eps, heads, windows):
    """decode_step's arithmetic (kernels/cpu/decode_step.h) one compiled op at a time,
    layer l attending through windows[l]: its reference."""
    rows, layers, d = x.shape[0], len(kcs), kcs[0].shape[-1]
    h, res = cpu_ops.rms_norm(x.clone(), norms[0], eps)
    for layer in range(layers):
        lin = linears[4 * layer : 4 * layer + 4]
        qkv = cpu_ops.linear_small(h, lin[0])
        cpu_ops.rope_cache(qkv, positions, cos, sin, kcs[layer], vcs[layer], slots, heads)
        att = torch.empty(rows, heads, d)
        cpu_ops.paged_attention(att, qkv[:, : heads * d].view(rows, heads, d), kcs[layer],
                                vcs[layer], table, lens, qstart, d**-0.5, window=windows[layer])
        h, res = cpu_ops.rms_norm(cpu_ops.linear_small(att.view(rows, -1), lin[1]),
                                  norms[2 * layer + 1], eps, res)
        mlp = cpu_ops.linear_small(cpu_ops.silu_and_mul(cpu_ops.linear_small(h, lin[2])), lin[3])
        # the next layer's input norm (after the last layer: the final norm)
        h, res = cpu_ops.rms_norm(mlp, norms[2 * layer + 2], eps, res)
    return cpu_ops.linear_small(h, linears[-1])


@pytest.mark.parametrize("windows", [[], [5, 0], [0, 17], [7, 7]])
def test_decode_step_attends_through_each_layers_window(windows) -> None:
    # two layers (heads 4, KV heads 2, d 32); a decode at position 39 and a 3-token chunk
    # at 22..24: decode_step with per-layer windows (empty: all full) equals the same
    # step composed from the compiled ops, and a window that cuts in changes the logits
    g = torch.Generator().manual_seed(len(windows) + sum(windows))
    layers, hidden, heads, kvh, d, inter, vocab, bs = 2, 64, 4, 2, 32, 64, 96, 16
    seqs = [(1, 40), (3, 25)]
    q, _, _, table, lens, qstart = _paged_case(seqs, heads, kvh, d, bs, torch.float32)
    nb = int(table.max()) + 1
    kcs = [torch.randn(kvh, nb, bs, d, generator=g) for _ in range(2 * layers)]
    kcs, vcs = kcs[:layers], kcs[layers:]
    positions = torch.tensor([39, 22, 23, 24])
    slots = torch.tensor([int(table[s, p // bs]) * bs + p % bs
                          for s, p in ((0, 39), (1, 22), (1, 23), (1, 24))])
    shapes = [((heads + 2 * kvh) * d, hidden), (hidden, heads * d), (2 * inter, hidden),
              (hidden, inter)] * layers + [(vocab, hidden)]
    linears = [torch.randn(s, generator=g) * 0.2 for s in shapes]
    norms = [torch.rand(hidden, generator=g) + 0.5 for _ in range(2 * layers + 1)]
    cos, sin = ref.rope_cos_sin(d, 64, 10000.0)
    x = torch.randn(4, hidden, generator=g)

    def step(wins: list[int], compiled: bool) -> torch.Tensor:
        ks, vs = [k.clone() for k in kcs], [v.clone() for v in vcs]
        if not compiled:
            return _step_by_ops(x, positions, slots, table, lens, qstart, cos, sin, ks, vs,
                                norms, linears, 1e-5, heads, wins or [0] * layers)
        logits, xs = torch.empty(4, vocab), x.clone()
        torch.ops.tidewire.decode_step(logits, xs, positions, slots, table, lens, qstart, cos,
                                       sin, ks, vs, norms, linears, [None] * len(linears),
                                       [None] * len(linears), 1e-5, d**-0.5, heads, wins, [])
        return logits

    got = step(windows, True)
    torch.testing.assert_close(got, step(windows, False), atol=1e-5, rtol=1e-5)
    assert torch.equal(got, step([0] * layers, True)) == (not any(windows))
    with pytest.raises(RuntimeError, match="window"):
        step([3], True)


def test_paged_attention_rejects_a_negative_window() -> None:
    q, kc, vc, table, lens, qstart = _paged_case([(1, 9)], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="window"):
        cpu_ops.paged_attention(torch.empty_like(q), q, kc, vc, table, lens, qstart, 0.125,
                                window=-1)


def test_paged_attention_reads_strided_queries_and_rejects_bad_layouts() -> None:
    q, kc, vc, table, lens, qstart = _paged_case([(3, 20), (1, 9)], 4, 2, 64, 16, torch.float32)
    wide = torch.randn(q.shape[0], 8, 64)  # q as a view into a wider row, like qkv
    wide[:, :4] = q
    out = torch.empty_like(q)
    cpu_ops.paged_attention(out, wide[:, :4], kc, vc, table, lens, qstart, 0.125)
    want, _ = ref.paged_attention(q, kc.permute(1, 2, 0, 3), vc.permute(1, 2, 0, 3), table,
                                  lens, qstart, 0.125)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_ops.paged_attention(out, q, kc, vc, table.long(), lens, qstart, 0.125)
    with pytest.raises(RuntimeError, match="head_dim"):
        bad = torch.randn(q.shape[0], 4, 24)
        cpu_ops.paged_attention(bad, bad, kc[..., :24].contiguous(), vc[..., :24].contiguous(),
                                table, lens, qstart, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm_matches_reference(dtype, add) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 576, generator=g).to(dtype)
    res = torch.randn(37, 576, generator=g).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    want, want_res = ref.rms_norm(x, w, 1e-5, res.clone() if add else None)
    got, got_res = cpu_ops.rms_norm(x, w, 1e-5, res.clone() if add else None)
    assert torch.equal(got_res, want_res)  # the residual sum rounds exactly as torch's add
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if dtype == torch.bfloat16:  # off by at most one bf16 rounding step, rarely
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_rope_cache_matches_reference_and_writes_slots(dtype, head_dim) -> None:
    g = torch.Generator().manual_seed(2)
    heads, kvh, n, bs, nb = 6, 2, 11, 16, 5
    qkv = torch.randn(n, (heads + 2 * kvh) * head_dim, generator=g).to(dtype)
    pos = torch.randint(0, 500, (n,), generator=g)
    cos, sin = ref.rope_cos_sin(head_dim, 512, 10000.0)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[3] = -1  # padding rows are not stored
    kc = torch.zeros(kvh, nb, bs, head_dim, dtype=dtype)
    vc = torch.zeros_like(kc)
    want = qkv.clone()
    qk = want[:, : (heads + kvh) * head_dim].view(n, -1, head_dim)
    qk.copy_(ref.rope(qk, *ref.rope_gather(cos, sin, pos, dtype)))
    cpu_ops.rope_cache(qkv, pos, cos, sin, kc, vc, slots, heads)
    tol = 1e-6 if dtype == torch.float32 else 0
    torch.testing.assert_close(qkv, want, atol=tol, rtol=tol)
    k = want[:, heads * head_dim : (heads + kvh) * head_dim].view(n, kvh, head_dim)
    v = want[:, (heads + kvh) * head_dim :].view(n, kvh, head_dim)
    flat_k, flat_v = kc.view(kvh, -1, head_dim), vc.view(kvh, -1, head_dim)
    for i in range(n):
        if i == 3:
            continue
        torch.testing.assert_close(flat_k[:, slots[i]], k[i], atol=tol, rtol=tol)
        assert torch.equal(flat_v[:, slots[i]], v[i])
    assert int((kc != 0).any(-1).sum()) == (n - 1) * kvh  # nothing else was written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype) -> None:
    x = (torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), ref.silu_and_mul(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_linear_small_matches_a_dense_matmul(rows, kind) -> None:
    from engine.quant import dequantize_int8, quantize_int8

    g = torch.Generator().manual_seed(rows)
    dtype = torch.float32 if kind == "float32" else torch.bfloat16
    w = torch.randn(197, 576, generator=g)  # an odd number of output rows
    x = torch.randn(rows, 576, generator=g).to(dtype)
    bias = torch.randn(197, generator=g).to(dtype)
    if kind == "int8":
        q, scale = quantize_int8(w)
        got = cpu_ops.linear_small(x, q, scale, bias)
        want = torch.nn.functional.linear(x.float(), dequantize_int8(q, scale), bias.float())
    else:
        got = cpu_ops.linear_small(x, w.to(dtype), None, bias)
        want = torch.nn.functional.linear(x.float(), w.to(dtype).float(), bias.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    wide = torch.zeros(rows, 640, dtype=dtype)  # rows of a wider tensor: strided x
    wide[:, :576] = x
    torch.testing.assert_close(cpu_ops.linear_small(wide[:, :576], w.to(dtype)),
                               cpu_ops.linear_small(x, w.to(dtype)))
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        cpu_ops.linear_small(torch.zeros(9, 576, dtype=dtype), w.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [320, 49152, 1000])  # 1000: a partial last word
def test_apply_token_bitmask_matches_reference(dtype: torch.dtype, vocab: int) -> None:
    """Random words, plus words of all ones and of zeros (the fast paths), on a subset
    of the rows; the other rows stay as they were. The reference is checked against a
    per-token loop too."""
    assert cpu_ops.available()
    g = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[:, ::3] = -1
    bitmask[:, 1::5] = 0
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    rows = [0, 2, 5]
    want, got = logits.clone(), logits.clone()
    ref.apply_token_bitmask(want, bitmask, rows)
    cpu_ops.apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, want)
    b = bitmask.to(torch.int64) & 0xFFFFFFFF
    for r in range(6):
        for t in range(0, vocab, 7):
            allowed = r not in rows or bool((int(b[r, t // 32]) >> (t % 32)) & 1)
            assert (want[r, t] == float("-inf")) != allowed or logits[r, t] == float("-inf")
            if allowed:
                assert want[r, t] == logits[r, t]


def test_the_tile_configuration_reaches_ldtilecfg_whole(tmp_path) -> None:
    """amx.h loads the tile configuration with an asm operand that names the whole
    64-byte struct. GCC 12's _tile_loadconfig names 8 bytes of it, and at -O3 the
    compiler then drops the stores of every tile's rows and bytes per row: the tiles
    come out 0 x 0 and the first tile instruction faults (SIGILL), on any AMX CPU.
    Compiled for Sapphire Rapids to assembly (no AMX CPU needed), the function that
    configures the tiles and the same function through _tile_loadconfig: ours stores at
    least as much before its ldtilecfg, and more than a zeroed struct and its palette
    byte (two stores); where this compiler drops the intrinsic's stores, strictly more."""
    import re
    import subprocess
    from pathlib import Path

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++")
    header = Path(cpu_ops.__file__).parent / "cpu" / "amx.h"

    def stores_before_ldtilecfg(body: str) -> int:
        src = tmp_path / "probe.cpp"
        src.write_text(f'#include "{header}"\n{body}\n')
        out = subprocess.run([gxx, "-O3", "-march=sapphirerapids", "-std=c++17", "-S", "-o", "-",
                              str(src)], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            pytest.skip(f"g++ cannot target sapphirerapids: {out.stderr[-300:]}")
        fn = out.stdout.split("_Z8probe_fnv:")[1].split("ldtilecfg")[0]
        # instructions that write memory other than through a push: AT&T syntax puts the
        # destination last, so a store ends in a memory operand "off(%reg)"
        return sum(1 for line in fn.splitlines()
                   if re.match(r"\s*v?mov", line) and re.search(r"\)\s*$", line))

    ours = stores_before_ldtilecfg("void probe_fn() { tw::amx_configure_full(); }")
    intrinsic = stores_before_ldtilecfg(
        "void probe_fn() { tw::TileConfig c; for (int t = 0; t < 8; ++t) "
        "{ c.colsb[t] = 64; c.rows[t] = 16; } _tile_loadconfig(&c); }")
    assert ours > 2 and ours >= intrinsic, (ours, intrinsic)
    if intrinsic <= 2:  # this compiler drops them: ours must not
        assert ours > intrinsic

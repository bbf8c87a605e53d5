"""Paged attention for a ragged batch of prefill chunks and decodes, in one kernel.

Layouts (last dimension contiguous):
    q           [num_tokens, num_heads, head_dim]      the step's queries, sequences back
                                                        to back (query_start_loc)
    k_cache     [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache     [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables[num_seqs, max_blocks] int32            logical block -> physical block
    seq_lens    [num_seqs] int32                        context after this step (cached + new)
    query_start_loc [num_seqs + 1] int32                cumulative query counts
    out         [num_tokens, num_heads, head_dim]
    lse         [num_tokens, num_heads] fp32            log-sum-exp of the scores (optional)

Query i of sequence s sits at absolute position seq_len - q_len + i and sees keys at
positions <= its own (causal with the cached context); with a sliding window W > 0 only
those above its position - W (W keys, its own included). `kv_start` / `kv_end` clip the
keys (cascade attention splits a shared prefix from the rest).

One program = (sequence, KV head, block of BLOCK_Q queries). The queries of every head
of the KV head's group are stacked as rows (BLOCK_Q * GROUP_PAD rows: 16 when the step
is all decodes, 64 when it has prefill chunks), so each K/V tile is loaded once per group
(GQA). Keys go by tiles of TILE tokens that may span several cache blocks (each token's
physical block is gathered from the table), so the tensor-core tiles stay wide when the
cache block is small (16 tokens: a 16-wide score tile ran prefill at ~16 TFLOP/s on an
H100). Softmax is online (FlashAttention) in fp32; block and token offsets are int64, so
caches past 2^31 elements address correctly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_cache, dot_fp32, dot_precision, next_pow2


@triton.jit
def key_tile(table_row_ptr, kpos, valid, BLOCK_SIZE: tl.constexpr):
    """Physical block (int64) and offset in it of each key position of a tile, from the
    sequence's block-table row (block 0 where not `valid`; attend_block loads nothing
    there)."""
    phys = tl.load(table_row_ptr + kpos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return phys, (kpos % BLOCK_SIZE).to(tl.int64)


@triton.jit
def attend_block(q, k_cache_ptr, v_cache_ptr, phys, toff, valid, kvh, stride_kb, stride_kt,
                 stride_kh, stride_vb, stride_vt, stride_vh, visible, m_i, l_i, acc, scale,
                 HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """One online-softmax step over a tile of keys (physical block `phys` and offset
    `toff` per key, int64 [TILE]; keys not `valid` are not loaded: a slot outside the
    sequence may hold anything, NaN included, and 0 * NaN would reach the output) for the
    query rows q [M, HEAD_DIM]; `visible` [M, TILE] says which scores count. Returns the
    updated (m_i, l_i, acc). Shared by the paged and split-K kernels."""
    d = tl.arange(0, HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + phys[:, None] * stride_kb + toff[:, None] * stride_kt
                + kvh * stride_kh + d, mask=valid[:, None], other=0.0)
    v = tl.load(v_cache_ptr + phys[:, None] * stride_vb + toff[:, None] * stride_vt
                + kvh * stride_vh + d, mask=valid[:, None], other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale, kv_start, kv_end, window,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_bt, stride_lt, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
    RETURN_LSE: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    SLIDING: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    qblk = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if qblk * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    qi = qblk * BLOCK_Q + rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    tok = (q_start + qi).to(tl.int64)
    head = (kvh * GROUP + g).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    qpos = ctx + qi

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)

    # keys this block of queries can see: [lo, min(kv_end, last query pos + 1)), lo being
    # kv_start or, with a sliding window, where the first query's window starts if later
    hi = tl.minimum(tl.minimum(ctx + (qblk + 1) * BLOCK_Q, seq_len), kv_end)
    lo = kv_start
    if SLIDING:
        lo = tl.maximum(lo, ctx + qblk * BLOCK_Q - window + 1)
    t = tl.arange(0, TILE)
    kvh64 = kvh.to(tl.int64)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range((lo // TILE) * TILE, hi, TILE):
        kpos = start + t
        in_range = (kpos >= lo) & (kpos < hi)
        phys, toff = key_tile(table_row, kpos, in_range, BLOCK_SIZE)
        visible = (kpos[None, :] <= qpos[:, None]) & in_range[None, :]
        if SLIDING:
            visible &= kpos[None, :] > qpos[:, None] - window
        m_i, l_i, acc = attend_block(q, k_cache_ptr, v_cache_ptr, phys, toff, in_range, kvh64,
                                     stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                     stride_vh, visible, m_i, l_i, acc, scale, HEAD_DIM,
                                     PRECISION, DOT_FP32)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if RETURN_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
        tl.store(lse_ptr + tok * stride_lt + head * stride_lh, lse, mask=row_ok)


def key_tile_size(block_size: int, dtype: torch.dtype) -> int:
    """Keys per tile: 64 (32 in fp32, whose tiles take twice the registers), never less
    than one cache block."""
    return max(block_size, 32 if dtype == torch.float32 else 64)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                    out: torch.Tensor | None = None, return_lse: bool = False,
                    kv_start: int = 0, kv_end: int = 2**31 - 1, window: int = 0,
                    lse_out: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a ragged batch over the paged cache (layouts in the module doc).
    Returns out, or (out, lse) with return_lse. A query that sees no key (only possible
    with kv_start / kv_end) gets zeros and lse = -inf. window > 0: sliding-window
    attention (the module doc), tiles before a program's first window never loaded;
    0: full causal attention (a separate compilation, so it pays nothing for windows).
    lse_out: where the log-sum-exp goes with return_lse ([num_tokens, num_heads] fp32,
    rows contiguous; allocated if None)."""
    if window < 0:
        raise ValueError(f"window must be 0 (full attention) or positive, not {window}")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = check_cache(k_cache, v_cache, head_dim)
    if q.stride(-1) != 1 or num_heads % num_kv_heads:
        raise ValueError("q needs a contiguous last dim and heads divisible by kv heads")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from the cache dtype {k_cache.dtype}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 \
            or query_start_loc.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError("block_tables (contiguous rows), seq_lens, query_start_loc: int32")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError("one block table row and seq_len per sequence, num_seqs + 1 starts")
    out = torch.empty_like(q) if out is None else out
    lse = out  # (a dummy pointer when unused)
    if return_lse:
        lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device) \
            if lse_out is None else lse_out
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    rows = 16 if max_query_len <= 1 else 64  # tl.dot needs >= 16; prefill fills 64
    block_q = max(1, rows // group_pad)
    grid = (num_seqs, num_kv_heads, triton.cdiv(max(max_query_len, 1), block_q))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, lse, block_tables, seq_lens, query_start_loc,
        scale, kv_start, kv_end, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0), lse.stride(0) if return_lse else 0,
        lse.stride(1) if return_lse else 0,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_SIZE=block_size,
        TILE=key_tile_size(block_size, q.dtype), HEAD_DIM=head_dim, RETURN_LSE=return_lse,
        PRECISION=dot_precision(q.dtype), DOT_FP32=dot_fp32(q.dtype), SLIDING=window > 0,
        num_warps=8 if block_q * group_pad >= 64 and head_dim >= 128 else 4, num_stages=2,
    )
    return (out, lse) if return_lse else out

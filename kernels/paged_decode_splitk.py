"""Split-K (flash-decoding) paged attention for decode-only batches with long contexts.

A batch of single-token decodes has too few (sequence, KV head) pairs to fill a GPU when
contexts are long, so each sequence's keys are cut into partitions of PARTITION_BLOCKS
cache blocks computed by separate programs; each writes its normalized partial output
and log-sum-exp, and merge_attn_states combines them exactly. With a sliding window W > 0
the partitions tile only the blocks the window reaches (from the block holding key
seq_len - W), and keys before the window are never loaded.

    q            [num_seqs, num_heads, head_dim]   one query token per sequence
    k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables [num_seqs, max_blocks] int32, seq_lens [num_seqs] int32
    partials     [num_partitions, num_seqs, num_heads, head_dim] fp32 (scratch)
    lses         [num_partitions, num_seqs, num_heads] fp32 (scratch; -inf = empty)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_cache, dot_fp32, dot_precision, next_pow2
from kernels.merge_attn_states import merge_attn_states
from kernels.paged_attention import attend_block, key_tile, key_tile_size


@triton.jit
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_ptr, lse_ptr, block_tables_ptr, seq_lens_ptr,
    scale, window,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_pp, stride_pt, stride_ph, stride_lp, stride_lt, stride_lh, stride_bt,
    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr, PARTITION_BLOCKS: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, SLIDING: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, ROWS)
    row_ok = g < GROUP
    head = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    t = tl.arange(0, TILE)
    first = part * (PARTITION_BLOCKS * BLOCK_SIZE)  # this partition's keys: [first, last)
    if SLIDING:  # partitions from the block where the window starts; keys from the window
        win = tl.maximum(seq_len - window, 0)
        first += (win // BLOCK_SIZE) * BLOCK_SIZE
    last = tl.minimum(first + PARTITION_BLOCKS * BLOCK_SIZE, seq_len)
    if SLIDING:
        first = tl.maximum(first, win)
    table_row = block_tables_ptr + seq * stride_bt
    for start in range(first, last, TILE):
        kpos = start + t
        in_range = kpos < last  # (a tile may overhang the partition: masked)
        phys, toff = key_tile(table_row, kpos, in_range, BLOCK_SIZE)
        m_i, l_i, acc = attend_block(q, k_cache_ptr, v_cache_ptr, phys, toff, in_range, kvh,
                                     stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                     stride_vh,
                                     in_range[None, :], m_i, l_i, acc, scale, HEAD_DIM,
                                     PRECISION, DOT_FP32)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(part_ptr + part * stride_pp + seq * stride_pt + head[:, None] * stride_ph
             + d[None, :], acc / l_safe[:, None], mask=row_ok[:, None])
    tl.store(lse_ptr + part * stride_lp + seq * stride_lt + head * stride_lh,
             tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe)), mask=row_ok)


def paged_decode_splitk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                        max_seq_len: int, partition_blocks: int = 16,
                        out: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Decode attention with the keys split into partitions of `partition_blocks`
    blocks (1 partition: plain decode) and merged by LSE. window > 0: sliding-window
    attention (the query at seq_len - 1 sees keys from seq_len - window); 0: full."""
    if window < 0:
        raise ValueError(f"window must be 0 (full attention) or positive, not {window}")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = check_cache(k_cache, v_cache, head_dim)
    if q.stride(-1) != 1 or num_heads % num_kv_heads or q.dtype != k_cache.dtype:
        raise ValueError("q: contiguous last dim, heads divisible by kv heads, cache dtype")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 \
            or block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError("one int32 block table row and seq_len per sequence")
    group = num_heads // num_kv_heads
    # keys a sequence's partitions cover: from the start of its window's first block
    span = min(max_seq_len, window + block_size - 1) if window > 0 else max_seq_len
    num_parts = triton.cdiv(triton.cdiv(max(span, 1), block_size), partition_blocks)
    partials = torch.empty((num_parts, num_seqs, num_heads, head_dim), dtype=torch.float32,
                           device=q.device)
    lses = torch.empty((num_parts, num_seqs, num_heads), dtype=torch.float32, device=q.device)
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_parts)](
        q, k_cache, v_cache, partials, lses, block_tables, seq_lens, scale, window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        partials.stride(0), partials.stride(1), partials.stride(2),
        lses.stride(0), lses.stride(1), lses.stride(2), block_tables.stride(0),
        GROUP=group, ROWS=max(16, next_pow2(group)), BLOCK_SIZE=block_size,
        TILE=min(key_tile_size(block_size, q.dtype), next_pow2(partition_blocks * block_size)),
        HEAD_DIM=head_dim,
        PARTITION_BLOCKS=partition_blocks, PRECISION=dot_precision(q.dtype),
        DOT_FP32=dot_fp32(q.dtype), SLIDING=window > 0,
        num_warps=4, num_stages=2)
    merged = merge_attn_states(partials, lses)
    assert isinstance(merged, torch.Tensor)  # (no lse asked for)
    out = torch.empty_like(q) if out is None else out
    out.copy_(merged)
    return out

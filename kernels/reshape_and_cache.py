"""Write a step's new K and V rows into the paged cache by slot mapping.

    k, v          [num_tokens, num_kv_heads, head_dim]   (last dim contiguous)
    k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping  [num_tokens] int64: block * block_size + offset; -1 = padding, skipped
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_cache, next_pow2


@triton.jit
def _reshape_and_cache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                              stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_cb, stride_ct, stride_ch, stride_db, stride_dt, stride_dh,
                              NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                              BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM)
    ok = (h < NUM_KV_HEADS)[:, None]
    h64 = h[:, None].to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + h64 * stride_kh + d[None, :], mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h64 * stride_vh + d[None, :], mask=ok)
    tl.store(k_cache_ptr + blk * stride_cb + off * stride_ct + h64 * stride_ch + d[None, :],
             k, mask=ok)
    tl.store(v_cache_ptr + blk * stride_db + off * stride_dt + h64 * stride_dh + d[None, :],
             v, mask=ok)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    _, block_size, cache_heads, _ = check_cache(k_cache, v_cache, head_dim)
    if v.shape != k.shape or cache_heads != num_kv_heads or k.dtype != k_cache.dtype \
            or v.dtype != k_cache.dtype or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k, v: [tokens, kv_heads, d] like the cache, contiguous last dim")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError("slot_mapping: one int slot per token")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=next_pow2(num_kv_heads), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, num_warps=1 if num_kv_heads * head_dim <= 512 else 4)

"""Shared checks for the kernel wrappers."""

from __future__ import annotations

import os

import torch


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def interpreting() -> bool:
    """Running under TRITON_INTERPRET=1 (tests on machines without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_fp32(dtype: torch.dtype) -> bool:
    """Whether the attention kernels upcast 16-bit tiles to fp32 before tl.dot. Only
    under the interpreter, whose tl.dot on bfloat16 returns garbage (Triton 3.9); on a
    GPU the 16-bit tiles go to the tensor cores as they are."""
    return interpreting() and dtype != torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep full precision in tl.dot (no TF32), as the reference does."""
    return "ieee" if dtype == torch.float32 or dot_fp32(dtype) else "tf32"


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor,
                head_dim: int) -> tuple[int, int, int, int]:
    """[num_blocks, block_size, num_kv_heads, head_dim], contiguous last dim, K and V
    alike, head_dim and block_size powers of two (tile shapes)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache: the same [num_blocks, block_size, kv_heads, "
                         "head_dim] shape and dtype")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches need a contiguous last dimension")
    nb, bs, kvh, d = k_cache.shape
    if d != head_dim or d & (d - 1) or bs & (bs - 1):
        raise ValueError(f"head_dim {d} (q has {head_dim}) and block_size {bs} must be "
                         "powers of two")
    if k_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported cache dtype {k_cache.dtype}")
    return nb, bs, kvh, d

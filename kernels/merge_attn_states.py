"""Exact merge of attention computed over disjoint key sets (split-K partitions, or a
shared prefix and each request's suffix), by log-sum-exp.

    parts  [num_parts, num_tokens, num_heads, head_dim]  each part's normalized output
    lses   [num_parts, num_tokens, num_heads] fp32       each part's log-sum-exp (-inf: empty)
    out    [num_tokens, num_heads, head_dim]
    lse    [num_tokens, num_heads] fp32 (optional)

out = sum_p exp(lse_p - M) * part_p / sum_p exp(lse_p - M), M = max_p lse_p: the same
result as one softmax over the union of the keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2


@triton.jit
def _merge_kernel(parts_ptr, lses_ptr, out_ptr, lse_out_ptr, num_parts,
                  stride_pp, stride_pt, stride_ph, stride_lp, stride_lt, stride_lh,
                  stride_ot, stride_oh, stride_qt, stride_qh,
                  PARTS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, RETURN_LSE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    p = tl.arange(0, PARTS_PAD)
    ok = p < num_parts
    lse = tl.load(lses_ptr + p.to(tl.int64) * stride_lp + t * stride_lt + h * stride_lh,
                  mask=ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, 0)
    d = tl.arange(0, HEAD_DIM)
    parts = tl.load(parts_ptr + p[:, None].to(tl.int64) * stride_pp + t * stride_pt
                    + h * stride_ph + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    out = tl.sum(w[:, None] * parts, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))
    if RETURN_LSE:
        tl.store(lse_out_ptr + t * stride_qt + h * stride_qh,
                 tl.where(total == 0.0, float("-inf"), m_safe + tl.log(total)))


def merge_attn_states(parts: torch.Tensor, lses: torch.Tensor, out: torch.Tensor | None = None,
                      return_lse: bool = False
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Merge `num_parts` partial attention results (layouts in the module doc)."""
    if parts.dim() != 4 or lses.shape != parts.shape[:3] or lses.dtype != torch.float32:
        raise ValueError("parts [P, tokens, heads, d] and fp32 lses [P, tokens, heads]")
    if parts.stride(-1) != 1 or parts.shape[-1] & (parts.shape[-1] - 1):
        raise ValueError("head_dim: a power of two, contiguous")
    num_parts, num_tokens, num_heads, head_dim = parts.shape
    out = torch.empty(parts.shape[1:], dtype=parts.dtype, device=parts.device) \
        if out is None else out
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=parts.device) \
        if return_lse else lses
    _merge_kernel[(num_tokens, num_heads)](
        parts, lses, out, lse, num_parts,
        parts.stride(0), parts.stride(1), parts.stride(2),
        lses.stride(0), lses.stride(1), lses.stride(2), out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        PARTS_PAD=next_pow2(num_parts), HEAD_DIM=head_dim, RETURN_LSE=return_lse,
        num_warps=1 if head_dim <= 64 else 2)
    return (out, lse) if return_lse else out

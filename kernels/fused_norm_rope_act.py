"""Fused elementwise kernels of a Llama layer, each against its kernels/reference.py twin.

rms_norm:      x, residual [num_tokens, hidden] (activation dtype), weight [hidden]
               -> (weight * rmsnorm(x + residual), x + residual); statistics in fp32.
rope:          q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim],
               rotated in place, neox style (first half of a head with the second), by
               positions [num_tokens] int64 into fp32 cos/sin tables [max_pos, head_dim/2].
silu_and_mul:  x [num_tokens, 2 * d] = [gate | up] -> silu(gate) * up [num_tokens, d].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     SCALE_FP32: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    # Arithmetic in fp32, each result rounded to the activation dtype where torch's
    # reference rounds (a 16-bit op computes in fp32 and rounds once, as torch does).
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if SCALE_FP32:  # an fp32 weight multiplies before the cast (Gemma's, as HF)
        h = xf * rstd
    else:  # one in the activations' dtype after it (Llama's, as HF)
        h = (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(x.dtype), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels.reference.rms_norm: returns (normed, new_residual)."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError("x [tokens, hidden] with a contiguous last dim, weight [hidden]")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError("residual must match x")
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    n = x.shape[1]
    _rms_norm_kernel[(x.shape[0],)](
        x, residual if residual is not None else x, weight, out, res_out, n, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        res_out.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(n),
        SCALE_FP32=weight.dtype == torch.float32, num_warps=4 if n <= 4096 else 8)
    return out, res_out


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, num_heads, stride_xt, stride_xh,
                 stride_c, HALF: tl.constexpr, HEADS_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF)
    c = tl.load(cos_ptr + pos * stride_c + i)
    s = tl.load(sin_ptr + pos * stride_c + i)
    h = tl.arange(0, HEADS_PAD)
    ok = (h < num_heads)[:, None]
    base = x_ptr + t * stride_xt + h[:, None].to(tl.int64) * stride_xh
    x1 = tl.load(base + i[None, :], mask=ok, other=0.0)
    x2 = tl.load(base + HALF + i[None, :], mask=ok, other=0.0)
    c = c.to(x1.dtype).to(tl.float32)[None, :]  # the tables in the activation dtype, as HF
    s = s.to(x1.dtype).to(tl.float32)[None, :]
    y1 = x1.to(tl.float32) * c - x2.to(tl.float32) * s
    y2 = x2.to(tl.float32) * c + x1.to(tl.float32) * s
    tl.store(base + i[None, :], y1.to(x1.dtype), mask=ok)
    tl.store(base + HALF + i[None, :], y2.to(x1.dtype), mask=ok)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> None:
    """Rotate q and k in place (layouts in the module doc)."""
    for x in (q, k):
        if x.dim() != 3 or x.stride(-1) != 1 or x.shape[0] != positions.shape[0]:
            raise ValueError("q, k: [tokens, heads, head_dim], contiguous last dim")
        half = x.shape[-1] // 2
        if cos.shape[-1] != half or sin.shape != cos.shape or half & (half - 1):
            raise ValueError("cos/sin tables [max_pos, head_dim / 2], head_dim a power of 2")
        if x.shape[0]:
            _rope_kernel[(x.shape[0],)](x, positions, cos, sin, x.shape[1], x.stride(0),
                                        x.stride(1), cos.stride(0), HALF=half,
                                        HEADS_PAD=next_pow2(x.shape[1]), num_warps=4)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < d
    gate = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + t * stride_x + d + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # rounded like F.silu's
    tl.store(out_ptr + t * stride_o + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError("x: [tokens, 2 * d], contiguous last dim")
    d = x.shape[1] // 2
    out = torch.empty((x.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(1024, next_pow2(d))
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, block))](
            x, out, d, x.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out

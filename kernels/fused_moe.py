"""Grouped expert GEMMs of a mixture-of-experts block (Triton), for CUDA; the torch
reference is engine/models/moe.py's grouped CPU path (tests/test_moe.py holds both to HF).

Layouts (T tokens, k experts a token, E experts, H hidden, I intermediate):
  x         [T, H], contiguous last dim, fp32/fp16/bf16
  gate_up   [E, 2I, H]: expert e's gate rows, then its up rows (HF 5's fused layout)
  down      [E, H, I]
  weights   [T, k] routing weights (fp32, or x's dtype), ids [T, k] expert ids
A (token, slot) pair is `pair = token * k + slot`, N = T * k pairs. `align_by_expert`
sorts the pairs by expert and pads each expert's run to a multiple of BLOCK_M with the
sentinel N, so every BLOCK_M rows of `sorted_pairs` belong to one expert
(`block_expert`). The worst case, N + min(E, N) * (BLOCK_M - 1) rows, sizes every
buffer and the grid: nothing depends on the routing's values on the host, so a decode
step stays capturable in a CUDA graph (no .item(), no nonzero); blocks past the real
padded length (`num_rows`, read on the device) return at once. Decode-sized batches
align in one small Triton program (a dozen torch ops cost 55 µs of a 99 µs T=1 step on
an H200; the program 7 µs).

One kernel, launched twice: x -> silu(gate) * up [N, I] (rows by pair), then
[N, I] -> down * weight [N, H]; the k rows of a token are summed in torch. Roundings
follow the torch path: each GEMM result, the SiLU, the product, the weighting each
round to the activation dtype, as torch's ops between them do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import dot_fp32, dot_precision, next_pow2


# Up to this many pairs one program aligns them (decode: a few µs where the torch ops
# below launch a dozen kernels); past it, its pair-by-expert compare grows too long.
ALIGN_KERNEL_MAX_PAIRS = 1024


def align_by_expert(ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_pairs [R] int32, block_expert [R / block_m] int32, num_rows [1] int32)
    for ids [T, k]: pairs grouped by expert in ascending order (token order within an
    expert), each group padded with N = T * k to a multiple of block_m; R the worst case
    (module doc). No host sync. Small batches: one Triton program; else torch ops
    (`align_by_expert_torch`, also its reference). Slots past num_rows are not written."""
    n = ids.numel()
    if n > ALIGN_KERNEL_MAX_PAIRS or n == 0:
        return align_by_expert_torch(ids, num_experts, block_m)
    num_blocks = _num_blocks(n, num_experts, block_m)
    sorted_pairs = torch.empty((num_blocks * block_m,), dtype=torch.int32, device=ids.device)
    block_expert = torch.empty((num_blocks,), dtype=torch.int32, device=ids.device)
    num_rows = torch.empty((1,), dtype=torch.int32, device=ids.device)
    e_pad = next_pow2(num_experts)
    _align_kernel[(1,)](ids.reshape(-1), sorted_pairs, block_expert, num_rows, n,
                        num_experts, num_blocks, BLOCK_M=block_m, E_PAD=e_pad,
                        CHUNK=max(16, 4096 // e_pad), num_warps=4)
    return sorted_pairs, block_expert, num_rows


def _num_blocks(n: int, num_experts: int, block_m: int) -> int:
    """The worst case: every expert that can get a pair padding block_m - 1 rows."""
    return triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m)


def align_by_expert_torch(ids: torch.Tensor, num_experts: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_by_expert as device-side torch ops (any size; slots past num_rows hold N)."""
    flat = ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    expert_of = flat[order]
    # a pair's place: its expert's padded start plus its rank among that expert's pairs
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[expert_of]
    num_blocks = _num_blocks(n, num_experts, block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, (ends - padded)[expert_of] + rank, order.int())
    starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_expert.int(), ends[-1:].int()


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, n, num_experts,
                  num_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                  CHUNK: tl.constexpr):
    """One program: count the pairs per expert, then place each at its expert's padded
    start plus its rank (a running one-hot prefix sum over CHUNK pairs at a time)."""
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, n, CHUNK):
        pairs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < n, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(num_rows_ptr, tl.sum(padded, 0))
    seen = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, n, CHUNK):
        pairs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < n, other=-1)
        hot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
        rank = tl.cumsum(hot, 0) - hot + seen[None, :]  # earlier pairs of the same expert
        dest = tl.sum(hot * (starts[None, :] + rank), 1)
        tl.store(sorted_ptr + dest, pairs, mask=pairs < n)
        seen += tl.sum(hot, 0)
    # each expert's padding (slots no pair takes: no race with the stores above)
    j = tl.arange(0, BLOCK_M)
    pad = (starts + counts)[:, None] + j[None, :]
    tl.store(sorted_ptr + pad, n, mask=j[None, :] < (padded - counts)[:, None])
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        expert = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + blocks, tl.minimum(expert, num_experts - 1),
                 mask=blocks < num_blocks)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _expert_gemm_kernel(a_ptr, w_ptr, out_ptr, rw_ptr, sorted_ptr, block_expert_ptr,
                        num_rows_ptr, num_pairs, a_div, n_out, k_dim,
                        stride_a, stride_we, stride_wn, stride_o,
                        GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """out[pair, cols] for one BLOCK_M run of sorted pairs (one expert) and BLOCK_N
    output columns. A's row of a pair is pair // a_div (k: x's token; 1: the pair's own
    row). GATED: W holds gate rows then up rows (n_out each); silu(gate) * up."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return  # past the padded length of this step's routing
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows).to(tl.int64)
    row_ok = pair < num_pairs  # the sentinel N pads each expert's run
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // a_div)[:, None] * stride_a + ks[None, :]
    # W^T tile [BLOCK_K, BLOCK_N] of the expert's [n_out (x2), k_dim] rows
    w_ptrs = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = ks < k_dim - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        acc = _dot(a, tl.load(w_ptrs, mask=w_ok, other=0.0), acc, PRECISION, DOT_FP32)
        if GATED:
            w_up = tl.load(w_ptrs + n_out * stride_wn, mask=w_ok, other=0.0)
            acc_up = _dot(a, w_up, acc_up, PRECISION, DOT_FP32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype)
    if GATED:
        g = y.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # rounded like F.silu's
        y = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
    if MUL_WEIGHT:
        rw = tl.load(rw_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) * rw[:, None]).to(dtype)
    out = out_ptr + pair[:, None] * stride_o + cols[None, :]
    tl.store(out, y, mask=row_ok[:, None] & col_ok[None, :])


def pick_blocks(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K). BLOCK_M about the pairs an expert gets on average
    (16 to 64): small blocks waste less padding at decode, big ones reuse each weight
    tile more. The rest as measured best on an H200 (E=128, H=2048, I=768): a longer K
    step for the few-row, weight-streaming blocks, wider N past 8k pairs."""
    block_m = min(64, max(16, next_pow2(-(-num_pairs // num_experts))))
    if block_m == 16:
        return block_m, 64, 128
    return block_m, 64 if num_pairs <= 8192 else 128, 64


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, rw: torch.Tensor,
            align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], a_div: int,
            gated: bool, blocks: tuple[int, int, int]) -> None:
    sorted_pairs, block_expert, num_rows = align
    block_m, block_n, block_k = blocks
    n_out = out.shape[1]
    grid = (block_expert.shape[0], triton.cdiv(n_out, block_n))
    _expert_gemm_kernel[grid](
        a, w, out, rw, sorted_pairs, block_expert, num_rows, out.shape[0], a_div, n_out,
        w.shape[2], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        GATED=gated, MUL_WEIGHT=not gated, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, PRECISION=dot_precision(a.dtype), DOT_FP32=dot_fp32(a.dtype),
        num_warps=4)


def _check(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
           weights: torch.Tensor, ids: torch.Tensor) -> None:
    """The layouts of the module doc."""
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError("x [T, H], gate_up [E, 2I, H], down [E, H, I]")
    e, two_i, h = gate_up.shape
    if x.shape[1] != h or down.shape != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} "
                         f"do not fit x {tuple(x.shape)}")
    if any(t.stride(-1) != 1 for t in (x, gate_up, down)):
        raise ValueError("x, gate_up and down need a contiguous last dimension")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError("the expert weights must be in x's dtype")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError("weights and ids: [T, k]")
    if weights.dtype not in (torch.float32, x.dtype):
        raise ValueError("routing weights: fp32 or x's dtype")


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              weights: torch.Tensor, ids: torch.Tensor,
              blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """sum over a token's k experts of weight * down(silu(gate) * up)(x): [T, H] in x's
    dtype (layouts in the module doc). `blocks`: (BLOCK_M, BLOCK_N, BLOCK_K), powers of
    two, BLOCK_M at least 16 (tl.dot); by default picked from the shapes."""
    _check(x, gate_up, down, weights, ids)
    (t, hidden), (num_experts, two_i, _) = x.shape, gate_up.shape
    k = ids.shape[1]
    n = t * k
    if n == 0:
        return torch.zeros_like(x)
    blocks = blocks or pick_blocks(n, num_experts)
    align = align_by_expert(ids, num_experts, blocks[0])
    rw = weights.reshape(-1).contiguous()
    inter = torch.empty((n, two_i // 2), dtype=x.dtype, device=x.device)
    _launch(x, gate_up, inter, rw, align, k, True, blocks)
    out_pairs = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    _launch(inter, down, out_pairs, rw, align, 1, False, blocks)
    return out_pairs.view(t, k, hidden).sum(dim=1)

"""Weight-only quantization of an HF checkpoint's linears, cached next to the converted
model, keyed by its checksum.

int8: symmetric, one fp32 scale per output channel. q = round(W / s) clamped to
[-127, 127] with s = max|W_row| / 127, so W ~ q * s. The model then computes
y = (x . q) * s, which equals x . (q * s) up to rounding: the dequantized weights are the
exact reference (tests load them into HF transformers).

int4: group-wise, asymmetric, 32 values a group with a scale and a minimum: W ~ s q + m
with q in [0, 15]. Stored as GGUF blocks, so the GGUF kernels run them as they are
(engine/models/layers.py GGUFLinear): Q4_K where in_features is a multiple of 256 (the
groups' scales and minimums in 6 bits under an fp16 pair per 256 values, 4.5 bits a
weight; each group's pair fitted by weighted least squares), else Q4_1 (fp16 scale and
minimum per group, 5 bits a weight).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.config import QUANTIZATIONS  # noqa: F401 - defined torch-free, re-exported

log = logging.getLogger("tidewire.engine")


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (q int8 [out, in], scale fp32 [out])."""
    w = w.float()
    scale = (w.abs().amax(1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weights an int8 layer computes with, in fp32."""
    return q.float() * scale[:, None]


INT4_GROUP = 32  # values a group: one GGUF Q4_1 block, one Q4_K sub-block
INT4_QTYPE = 3  # ggml's Q4_1: matrices whose in_features is not a multiple of 256
Q4_K_QTYPE = 12  # ggml's Q4_K: the rest
Q4_K_SUPER = 256  # values a Q4_K block: 8 sub-blocks of 32
Q4_K_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 of codes


def int4_qtype(cols: int) -> int:
    """The block type int4 stores a matrix of `cols` in_features as."""
    return Q4_K_QTYPE if cols % Q4_K_SUPER == 0 else INT4_QTYPE


def quantize_int4(w: torch.Tensor) -> tuple[int, torch.Tensor]:
    """W [out, in] (in a multiple of 32) -> (ggml type, uint8 [out, bytes a row]): GGUF
    Q4_K blocks where in is a multiple of 256 (4.5 bits a weight, the types' fastest
    kernels), else Q4_1 (5 bits)."""
    qtype = int4_qtype(w.shape[1])
    if qtype == Q4_K_QTYPE:
        rows = max(1, (1 << 18) // w.shape[1])  # ~1 MB of fp32 at a time: in cache
        return qtype, torch.cat([_quantize_q4_k(w[i:i + rows]) for i in range(0, len(w), rows)])
    return qtype, _quantize_q4_1(w)


def _quantize_q4_1(w: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks, each fp16 d, fp16 m and 16 bytes of 4-bit codes (value i in byte i's
    low nibble, value 16 + i in its high one), q = round((w - m) / d) with the stored
    (fp16) d and m."""
    rows, cols = w.shape
    if cols % INT4_GROUP:
        raise ValueError(f"int4 quantization needs in_features a multiple of {INT4_GROUP}")
    g = w.float().reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d16, m16 = ((hi - lo) / 15).to(torch.float16), lo.to(torch.float16)
    d, m = d16.float()[..., None], m16.float()[..., None]
    q = torch.where(d > 0, torch.round((g - m) / d.clamp_min(1e-30)), 0.0).clamp_(0, 15)
    q = q.to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    blocks = torch.cat([d16[..., None].view(torch.uint8), m16[..., None].view(torch.uint8),
                        nibbles], -1)
    return blocks.reshape(rows, -1).contiguous()


def _fit_subblocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [32, n]: n sub-blocks, a value of each per row (sums over the rows vectorize,
    over a short last dim they do not) -> (s >= 0, m <= 0) [n] with x ~ s q + m, q in
    0..15 (Q4_K's sub-blocks store -m, so m is at most 0). Code assignments from scales
    around the min/max one are each refitted by weighted least squares, the weights
    favouring large values (their error weighs most in a dot product); the fit with the
    least weighted error (from the sums, for that assignment) wins."""
    lo, hi = x.amin(0).clamp(max=0), x.amax(0)
    span = (hi - lo).clamp_min(1e-30)
    wt = x.abs().add_(x.square().mean(0).sqrt_())
    wx = wt * x
    sw, swx, swxx = wt.sum(0), wx.sum(0), (wx * x).sum(0)
    shifted = x - lo
    best_s, best_m = span / 15, lo
    best = torch.full_like(lo, float("inf"))
    for step in (0.0, -1.0, -0.5, 0.5, 1.0):
        q = (shifted * ((15 + step) / span)).round_().clamp_(0, 15)
        wq = wt * q
        swq, swqq, swqx = wq.sum(0), (wq * q).sum(0), (wq * x).sum(0)
        det = sw * swqq - swq * swq
        ok = det > 1e-12 * sw * swqq
        s = torch.where(ok, (sw * swqx - swq * swx) / det.clamp_min(1e-30), best_s)
        m = torch.where(ok, (swqq * swx - swq * swqx) / det.clamp_min(1e-30), best_m)
        pos = m > 0  # no room for a positive offset: the best scale with m = 0
        s = torch.where(pos, swqx / swqq.clamp_min(1e-30), s).clamp_min(0)
        m = torch.where(pos, torch.zeros_like(m), m)
        # sum w (s q + m - x)^2 for this assignment
        e = (s * s * swqq + 2 * s * m * swq + m * m * sw - 2 * s * swqx - 2 * m * swx + swxx)
        better = e < best
        best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
        best = torch.where(better, e, best)
    return best_s, best_m


def _quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks (ggml's layout): fp16 d and dmin; the 8 sub-blocks' 6-bit scales sc
    and mins mi packed in 12 bytes; 128 bytes of codes, 32 a pair of sub-blocks (value l
    of sub-block 2j in byte l's low nibble, of 2j + 1 in its high one). A value is
    d sc q - dmin mi."""
    rows, cols = w.shape
    x = w.float().reshape(rows, cols // Q4_K_SUPER, 8, INT4_GROUP)
    s, m = (t.reshape(x.shape[:-1])
            for t in _fit_subblocks(x.reshape(-1, INT4_GROUP).t().contiguous()))
    d16 = (s.amax(-1) / 63).to(torch.float16)
    dmin16 = ((-m).amax(-1) / 63).to(torch.float16)
    d, dmin = d16.float()[..., None], dmin16.float()[..., None]
    sc = torch.where(d > 0, torch.round(s / d.clamp_min(1e-30)), 0.0).clamp_(0, 63)
    mi = torch.where(dmin > 0, torch.round(-m / dmin.clamp_min(1e-30)), 0.0).clamp_(0, 63)
    step, off = (d * sc)[..., None], (dmin * mi)[..., None]
    q = torch.where(step > 0, torch.round((x + off) / step.clamp_min(1e-30)), 0.0)
    q = q.clamp_(0, 15).to(torch.uint8)  # [rows, blocks, 8, 32]
    codes = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(rows, -1, 128)
    sc, mi = sc.to(torch.uint8), mi.to(torch.uint8)
    packed = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
                        mi[..., :4] | ((mi[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 0xF) | ((mi[..., 4:] & 0xF) << 4)], -1)
    blocks = torch.cat([d16[..., None].view(torch.uint8), dmin16[..., None].view(torch.uint8),
                        packed, codes], -1)
    return blocks.reshape(rows, -1).contiguous()


def dequantize_int4(qtype: int, blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """The weights an int4 layer computes with, in fp32 (the reference of the kernels)."""
    rows = blocks.shape[0]
    if qtype == Q4_K_QTYPE:
        b = blocks.reshape(rows, cols // Q4_K_SUPER, Q4_K_BYTES)
        d = b[..., 0:2].contiguous().view(torch.float16).float()
        dmin = b[..., 2:4].contiguous().view(torch.float16).float()
        p = b[..., 4:16].to(torch.int32)
        sc = torch.cat([p[..., 0:4] & 63, (p[..., 8:12] & 0xF) | ((p[..., 0:4] >> 6) << 4)], -1)
        mi = torch.cat([p[..., 4:8] & 63, (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)], -1)
        codes = b[..., 16:].reshape(rows, -1, 4, 32)
        q = torch.stack([codes & 0xF, codes >> 4], 3).reshape(rows, -1, 8, 32).float()
        return (d[..., None] * sc[..., None] * q
                - dmin[..., None] * mi[..., None]).reshape(rows, cols)
    b = blocks.reshape(rows, cols // INT4_GROUP, 20)
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    nib = b[..., 4:]
    q = torch.cat([nib & 0xF, nib >> 4], -1).float()
    return (d * q + m).reshape(rows, cols)


def linear_weight_names(weights: dict[str, torch.Tensor]) -> list[str]:
    """The weights of the matmuls that int8 quantizes (every projection and the LM head;
    not the embedding table, which is a lookup)."""
    return [k for k in weights if k.endswith("_proj.weight") or k == "lm_head.weight"]


def quantized(weights: dict[str, torch.Tensor], names: list[str],
              cache_file: Path | None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(q, scale) of each named weight, from `cache_file` when it holds them, else
    computed and written there."""
    stored = _cached(cache_file, [f"{n}.{k}" for n in names for k in ("q", "scale")])
    if stored is not None:
        return {n: (stored[f"{n}.q"], stored[f"{n}.scale"]) for n in names}
    t0 = time.monotonic()
    out = {n: quantize_int8(weights[n]) for n in names}
    log.info("quantized %d weights to int8 in %.1fs", len(names), time.monotonic() - t0)
    _store(cache_file, {f"{n}.{k}": t for n, (q, s) in out.items()
                        for k, t in (("q", q), ("scale", s))})
    return out


def quantized_int4(weights: dict[str, torch.Tensor], names: list[str],
                   cache_file: Path | None) -> dict[str, tuple[int, torch.Tensor]]:
    """(ggml type, blocks) of each named weight (quantize_int4), cached as `quantized`
    (a key per type: a cache of an earlier layout is a miss)."""
    keys = {n: f"{n}.q4{'k' if int4_qtype(weights[n].shape[1]) == Q4_K_QTYPE else ''}"
            for n in names}
    stored = _cached(cache_file, list(keys.values()))
    if stored is not None:
        return {n: (int4_qtype(weights[n].shape[1]), stored[k]) for n, k in keys.items()}
    t0 = time.monotonic()
    out = {n: quantize_int4(weights[n]) for n in names}
    log.info("quantized %d weights to int4 in %.1fs", len(names), time.monotonic() - t0)
    _store(cache_file, {keys[n]: q for n, (_, q) in out.items()})
    return out


def _cached(cache_file: Path | None, keys: list[str]) -> dict[str, torch.Tensor] | None:
    """The cache file's tensors if it holds every key (a damaged file is a miss)."""
    if cache_file is None or not cache_file.exists():
        return None
    try:
        stored = load_file(str(cache_file))
    except Exception as e:  # quantize again and rewrite it
        log.warning("ignoring the quantized-weights cache %s (%s)", cache_file, e)
        return None
    return stored if all(k in stored for k in keys) else None


def _store(cache_file: Path | None, tensors: dict[str, torch.Tensor]) -> None:
    if cache_file is None:
        return
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    save_file(tensors, str(tmp))
    tmp.replace(cache_file)

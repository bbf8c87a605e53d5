"""Weight-only quantization of an HF checkpoint's linears, cached next to the converted
model, keyed by its checksum.

int8: symmetric, one fp32 scale per output channel. q = round(W / s) clamped to
[-127, 127] with s = max|W_row| / 127, so W ~ q * s. The model then computes
y = (x . q) * s, which equals x . (q * s) up to rounding: the dequantized weights are the
exact reference (tests load them into HF transformers).

int4: group-wise, asymmetric, 32 values a group with an fp16 scale and an fp16 minimum:
W ~ d q + m with q in [0, 15]. The groups are stored as GGUF's Q4_1 blocks, so the GGUF
kernels run them as they are (engine/models/layers.py GGUFLinear): 5 bits a weight.
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


INT4_GROUP = 32  # values a group: one GGUF Q4_1 block
INT4_QTYPE = 3  # ggml's Q4_1


def quantize_int4(w: torch.Tensor) -> torch.Tensor:
    """W [out, in] (in a multiple of 32) -> uint8 [out, in / 32 * 20]: Q4_1 blocks, each
    fp16 d, fp16 m and 16 bytes of 4-bit codes (value i in byte i's low nibble, value
    16 + i in its high one), q = round((w - m) / d) with the stored (fp16) d and m."""
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


def dequantize_int4(blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """The weights an int4 layer computes with, in fp32 (the reference of the kernels)."""
    rows = blocks.shape[0]
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
                   cache_file: Path | None) -> dict[str, torch.Tensor]:
    """The Q4_1 blocks of each named weight (quantize_int4), cached as `quantized`."""
    stored = _cached(cache_file, [f"{n}.q4" for n in names])
    if stored is not None:
        return {n: stored[f"{n}.q4"] for n in names}
    t0 = time.monotonic()
    out = {n: quantize_int4(weights[n]) for n in names}
    log.info("quantized %d weights to int4 in %.1fs", len(names), time.monotonic() - t0)
    _store(cache_file, {f"{n}.q4": q for n, q in out.items()})
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

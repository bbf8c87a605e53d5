"""Weight-only int8 quantization: symmetric, one fp32 scale per output channel.

q = round(W / s) clamped to [-127, 127] with s = max|W_row| / 127, so W ~ q * s. The
model then computes y = (x . q) * s, which equals x . (q * s) up to rounding: the
dequantized weights are the exact reference (tests load them into HF transformers).
Quantized weights are cached next to the converted model, keyed by its checksum.
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


def linear_weight_names(weights: dict[str, torch.Tensor]) -> list[str]:
    """The weights of the matmuls that int8 quantizes (every projection and the LM head;
    not the embedding table, which is a lookup)."""
    return [k for k in weights if k.endswith("_proj.weight") or k == "lm_head.weight"]


def quantized(weights: dict[str, torch.Tensor], names: list[str],
              cache_file: Path | None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(q, scale) of each named weight, from `cache_file` when it holds them, else
    computed and written there."""
    if cache_file is not None and cache_file.exists():
        try:
            stored = load_file(str(cache_file))
        except Exception as e:  # a damaged file is a miss: quantize again and rewrite it
            log.warning("ignoring the int8 cache %s (%s)", cache_file, e)
            stored = {}
        if all(f"{n}.q" in stored for n in names):
            return {n: (stored[f"{n}.q"], stored[f"{n}.scale"]) for n in names}
    t0 = time.monotonic()
    out = {n: quantize_int8(weights[n]) for n in names}
    log.info("quantized %d weights to int8 in %.1fs", len(names), time.monotonic() - t0)
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        save_file({f"{n}.{k}": t for n, (q, s) in out.items()
                   for k, t in (("q", q), ("scale", s))}, str(tmp))
        tmp.replace(cache_file)
    return out

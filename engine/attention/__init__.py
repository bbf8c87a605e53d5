"""Attention backends over the paged KV cache (see engine/attention/base.py).

- `base`: the backend-neutral parts (StepLayout, PrefillSpec, PagedMetadata, the
  AttentionBackend interface, `get_backend`); it imports no backend.
- `cpu`: the `cpu` backend (kernels/cpu_ops.py, torch fallback).
- `triton`: the `cuda` and `triton-interpret` backends (the Triton kernels in kernels/).

This package re-exports the backend-neutral names; the backends' names load on first
use, so importing one backend never imports the other. New code imports from the
modules directly.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.attention.base import (BACKENDS, AttentionBackend, PagedMetadata, PrefillSpec,
                                   StepLayout, get_backend)

_LAZY = {
    "CpuAttention": "cpu", "PAGED_HEAD_DIMS": "cpu", "bucket_decodes": "cpu",
    "CpuMetadata": "cpu", "CpuPrefill": "cpu", "DecodeBucket": "cpu",
    "TritonAttention": "triton", "TritonInterpretAttention": "triton",
    "TritonMetadata": "triton", "SPLIT_K_MIN_CONTEXT": "triton",
    "SPLIT_K_PARTITION_BLOCKS": "triton",
}

__all__ = ["BACKENDS", "AttentionBackend", "PagedMetadata", "PrefillSpec", "StepLayout",
           "get_backend", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'engine.attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"engine.attention.{_LAZY[name]}"), name)
    globals()[name] = value
    return value

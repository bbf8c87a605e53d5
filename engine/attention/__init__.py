"""Attention backends over the paged KV cache.

- `base`: the backend-neutral parts (StepLayout, PrefillSpec, PagedMetadata, the
  AttentionBackend interface).
- `cpu`: the `cpu` backend (the compiled kernels of kernels/cpu_ops.py, torch fallback).
- `triton`: the `cuda` and `triton-interpret` backends (the Triton kernels in kernels/).

engine/platform.py chooses and constructs the backend (ATTENTION_BACKENDS). Import the
names from the modules themselves.
"""

"""Attention backends over the paged KV cache.

A backend owns its cache layout and computes attention for one flattened step: the
rows of all decodes first (one query token each, sorted by context length, longest
first), then the prefill chunks (several query tokens each, possibly after cached
context). The runner describes the step once in a backend-neutral `StepLayout`; the
backend turns it into its own metadata, which every layer reuses.

This module is the backend-neutral part: the step description and the interface. The
backends are engine/attention/cpu.py and engine/attention/triton.py; engine/platform.py
chooses one (ATTENTION_BACKENDS) and constructs it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class PrefillSpec:
    q_start: int  # first row of this sequence's queries in the flat batch
    q_len: int  # query tokens this step
    ctx_len: int  # tokens of context after this step (cached + new)
    block_ids: list[int]  # blocks covering the ctx_len tokens


@dataclass
class StepLayout:
    """Backend-neutral description of a step, built on the host by the runner."""

    slot_mapping: list[int]  # row i's K/V go to block_id * block_size + offset
    decode_seq_lens: list[int]  # rows [0, num_decodes), non-increasing
    decode_block_ids: list[list[int]]
    prefills: list[PrefillSpec]


def cascade_groups(tables: list[list[int]], seq_lens: list[int],
                   q_lens: list[int], block_size: int) -> list[tuple[list[int], int]]:
    """Sequences of a step that share prefix blocks, for shared-prefix (cascade)
    attention: (members, shared keys) a group, each group's members being the sequences
    whose block-table rows begin with the same block, and its shared keys the whole
    blocks all of them hold at the start of their rows (the prefix cache hands the same
    physical blocks to every sequence with that prefix), cut to lie before each member's
    first query. Groups of one sequence are left out; whether a group is worth it is the
    backend's cost rule."""
    by_first: dict[int, list[int]] = {}
    for i, t in enumerate(tables):
        if t and seq_lens[i] - q_lens[i] >= block_size:
            by_first.setdefault(t[0], []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        rows = [tables[i] for i in members]
        common = 0
        for column in zip(*rows):
            if any(b != column[0] for b in column):
                break
            common += 1
        before = min(seq_lens[i] - q_lens[i] for i in members)
        shared = min(common * block_size, before // block_size * block_size)
        if shared > 0:
            groups.append((members, shared))
    return groups


class AttentionBackend(ABC):
    """Interface: a cache layout, metadata, a cache write and paged attention."""

    name = "abstract"
    # Where the weights, the KV cache and the step's tensors live (sampling stays on
    # the CPU: the logits rows come back once per step).
    device = "cpu"

    # what `kv_cache_dtype` may be: "auto" is the activations' dtype
    kv_cache_dtypes: tuple[str, ...] = ("auto",)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto"):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = dtype  # the activations' dtype (and the KV cache's, with "auto")
        if kv_cache_dtype not in self.kv_cache_dtypes:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not available on the "
                             f"{self.name} attention backend (it takes "
                             f"{', '.join(self.kv_cache_dtypes)})")
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_dtype = dtype  # what the KV pool is allocated as
        self.block_size = block_size
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def block_shape(self, num_layers: int) -> tuple[int, ...]:
        """One block of every layer's K and V in gather_blocks' canonical layout."""
        return (num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @abstractmethod
    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's K (and V) cache tensor for `num_blocks` blocks."""

    @abstractmethod
    def build_metadata(self, layout: StepLayout) -> object:
        """Tensors this backend needs for the step, built once and shared by all layers."""

    @abstractmethod
    def write_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: object) -> None:
        """Store this step's k, v [num_tokens, kv_heads, head_dim] at their slots."""

    @abstractmethod
    def gather_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Whole blocks of every layer's K and V, from the model's cache `kv` [layers, 2,
        *cache_shape], in the canonical layout [len(block_ids), *block_shape(layers)]
        ([n, layers, 2, block_size, kv_heads, head_dim]: what the host tier stores,
        whatever this backend's cache layout; an int8 cache has its own, which the tier
        fingerprint tells apart). One gather for all layers into a new tensor, never a view of the cache
        (later writes to the cache leave it alone); the result may be a permuted view of
        that tensor."""

    @abstractmethod
    def scatter_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor,
                       data: torch.Tensor) -> None:
        """The inverse of gather_blocks: store whole blocks given in the canonical layout
        (on the cache's device)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: object, window: int = 0) -> torch.Tensor:
        """Causal paged attention of q [num_tokens, heads, head_dim] over each row's
        context (k, v: this step's rows, already written to the cache); returns
        [num_tokens, heads, head_dim]. window > 0: sliding-window attention (Mistral,
        Gemma's local layers), the row at position p sees keys at positions (p - window,
        p], window keys with its own, as HF transformers' `sliding_window`; 0: every key
        up to its own. A per-call argument (layers of one model may differ); the step's
        metadata serves every window."""


@dataclass
class PagedMetadata:
    """The compiled kernel's view of a step: every sequence (decodes, then prefill chunks)
    in one ragged batch (kernels.cpu_ops.paged_attention)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: context after this step
    query_start: torch.Tensor  # [num_seqs + 1] int32
    num_decodes: int = 0  # sequences [0, num_decodes) are decode steps
    # shared-prefix groups (cpu_ops.paged_attention's cascade: members, offsets, shared)
    cascade: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


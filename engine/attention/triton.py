"""The Triton attention backends: `cuda` (the kernels compiled for the GPU) and
`triton-interpret` (the same kernels under Triton's interpreter, on CPU tensors, for
tests on machines without a GPU).

Cache layout (per layer, K and V alike): [num_blocks, block_size, num_kv_heads,
head_dim], the layout of kernels/paged_attention.py, and already the host tier's
canonical block layout, so reading and writing whole blocks is plain indexing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend, StepLayout, cascade_groups

if TYPE_CHECKING:  # (Triton itself is imported where a backend first runs a kernel: the
    # engine imports this module on every machine, and Triton costs ~70 MB resident)
    from kernels.cascade_attention import CascadePrefix

# A decode-only step whose longest context reaches this many tokens splits each
# sequence's keys into partitions (flash-decoding): few long sequences would otherwise
# leave most of a GPU's SMs idle.
SPLIT_K_MIN_CONTEXT = 2048
SPLIT_K_PARTITION_BLOCKS = 32


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 (decodes first, then prefills)
    seq_lens: torch.Tensor  # [num_seqs] int32: context after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    decode_only: bool
    # a prefix every sequence of the step shares, planned for kernels/cascade_attention.py
    # once per step; None: none, or not worth it
    prefix: CascadePrefix | None = None


class TritonAttention(AttentionBackend):
    name = "cuda"
    device = "cuda"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto"):
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, dtype, kv_cache_dtype)
        self._check_device()
        from kernels import paged_attention, paged_decode_splitk, reshape_and_cache

        from kernels import cascade_attention

        self._paged = paged_attention.paged_attention
        self._splitk = paged_decode_splitk.paged_decode_splitk
        self._cascade = cascade_attention.cascade_attention
        self._cache_write = reshape_and_cache.reshape_and_cache
        # shared-prefix attention where every sequence of a step shares prefix blocks and
        # the rule below says it pays (TIDEWIRE_CASCADE=0: never)
        self.cascade = os.environ.get("TIDEWIRE_CASCADE", "1") not in ("0", "false", "")
        self.cascade_steps = 0  # steps that took it (`tidewire bench cascade` reports it)

    # The kernel takes one prefix for the whole step (kernels/cascade_attention.py), so a
    # step qualifies when all its sequences share one, and when the K/V bytes it saves
    # reading ((members - 1) x prefix keys, every KV head, K and V) reach
    # CASCADE_MIN_SAVED_BYTES. Measured with `tidewire bench cascade` on an H200 (decodes,
    # d64 bf16, the engine's eager path: a step that takes a captured decode graph never
    # runs it): the cascade's extra launches (prefix pass, suffix pass, merge) cost
    # ~150-300 us of host time a layer, more than the split-K kernel spends reading
    # hundreds of MB. It won at 256 sequences x 8,192 shared keys of a 32/8-head model
    # (2.1 GB saved: 2.0-2.25x) and lost at 0.5-0.8 GB saved (0.70-0.88x), kernel alone;
    # the engine comparison on a GPU is still to be run (docs/performance.md).
    CASCADE_MIN_SEQS = 8
    CASCADE_MIN_SAVED_BYTES = 1 << 30

    def _prefix(self, rows: list[tuple[int, int, list[int]]]) -> CascadePrefix | None:
        if not self.cascade or len(rows) < 2:
            return None
        groups = cascade_groups([ids for _, _, ids in rows], [n for _, n, _ in rows],
                                [q for q, _, _ in rows], self.block_size)
        if len(groups) != 1 or len(groups[0][0]) != len(rows):
            return None
        members, keys = groups[0]
        elem = 1 if self.kv_cache_dtype == "int8" else self.dtype.itemsize
        saved = (len(members) - 1) * keys * self.num_kv_heads * self.head_dim * 2 * elem
        if len(members) < self.CASCADE_MIN_SEQS or saved < self.CASCADE_MIN_SAVED_BYTES:
            return None
        self.cascade_steps += 1
        from kernels.cascade_attention import CascadePrefix

        return CascadePrefix.build(rows[members[0]][2][: keys // self.block_size], keys,
                                   self.block_size, sum(q for q, _, _ in rows),
                                   self.num_heads, self.num_kv_heads, self.device)

    def _check_device(self) -> None:
        if not torch.cuda.is_available():
            raise ValueError("attention_backend 'cuda' needs a CUDA device; use 'cpu', or "
                             "'triton-interpret' to run the Triton kernels on the CPU")

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def build_metadata(self, layout: StepLayout) -> TritonMetadata:
        rows = [(1, n, ids) for n, ids in zip(layout.decode_seq_lens, layout.decode_block_ids)]
        rows += [(p.q_len, p.ctx_len, p.block_ids) for p in layout.prefills]
        width = max((len(ids) for _, _, ids in rows), default=1) or 1
        table = torch.zeros((len(rows), width), dtype=torch.int32)
        for i, (_, _, ids) in enumerate(rows):
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        starts = [0]
        for q_len, _, _ in rows:
            starts.append(starts[-1] + q_len)
        dev = self.device
        return TritonMetadata(
            torch.tensor(layout.slot_mapping, dtype=torch.int64, device=dev), table.to(dev),
            torch.tensor([n for _, n, _ in rows], dtype=torch.int32, device=dev),
            torch.tensor(starts, dtype=torch.int32, device=dev),
            max((q for q, _, _ in rows), default=1), max((n for _, n, _ in rows), default=1),
            not layout.prefills, self._prefix(rows))

    def write_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: object) -> None:
        assert isinstance(meta, TritonMetadata)
        self._cache_write(k, v, k_cache, v_cache, meta.slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: object, window: int = 0) -> torch.Tensor:
        assert isinstance(meta, TritonMetadata)
        if meta.prefix is not None and window == 0:
            return self._cascade(q, k_cache, v_cache, meta.prefix, meta.block_tables,
                                 meta.seq_lens, meta.query_start_loc, self.scale,
                                 meta.max_query_len, validate=False)
        # the keys a decode reads: its context, or at most its window
        seen = min(meta.max_seq_len, window) if window > 0 else meta.max_seq_len
        if meta.decode_only and seen >= SPLIT_K_MIN_CONTEXT:
            return self._splitk(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                self.scale, meta.max_seq_len, SPLIT_K_PARTITION_BLOCKS,
                                window=window)
        return self._paged(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,  # type: ignore[return-value]  # noqa: E501
                           meta.query_start_loc, self.scale, meta.max_query_len,
                           window=window)

    def gather_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        # [layers, 2, n, bs, kv_heads, d] -> [n, layers, 2, bs, kv_heads, d]
        return kv.index_select(2, block_ids).permute(2, 0, 1, 3, 4, 5)

    def scatter_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor,
                       data: torch.Tensor) -> None:
        kv.index_copy_(2, block_ids, data.permute(1, 2, 0, 3, 4, 5))


class TritonInterpretAttention(TritonAttention):
    """The Triton kernels on CPU tensors through Triton's interpreter (slow; for tests).
    TRITON_INTERPRET must be set before any kernel module is imported; this backend
    sets it, so it must come first in a process that also uses the `cuda` backend."""

    name = "triton-interpret"
    device = "cpu"

    def _check_device(self) -> None:
        os.environ["TRITON_INTERPRET"] = "1"

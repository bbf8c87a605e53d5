"""Attention backends over the paged KV cache.

A backend owns its cache layout and computes attention for one flattened step: the
rows of all decodes first (one query token each), then the prefill chunks (several
query tokens each, possibly after cached context). The runner builds an
`AttentionMetadata` once per step and every layer reuses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    q_start: int  # first row of this sequence's queries in the flat batch
    q_len: int  # query tokens this step
    ctx_len: int  # tokens of context after this step (cached + new)
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)] int64


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built on the host by the runner.

    slot_mapping[i] = block_id * block_size + offset for row i (where its K/V go);
    decodes occupy rows [0, num_decodes)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with 0
    decode_mask: torch.Tensor  # [num_decodes, 1, max_blocks * block_size] additive bias
    prefills: list[PrefillSeq]


class AttentionBackend(ABC):
    """Interface: a cache layout, a cache write and paged attention."""

    name = "abstract"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    @abstractmethod
    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's K (and V) cache tensor for `num_blocks` blocks."""

    @abstractmethod
    def write_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store this step's k, v [num_tokens, kv_heads, head_dim] at meta.slot_mapping."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Paged attention of q [num_tokens, heads, head_dim] over each row's context
        (causal); returns [num_tokens, heads, head_dim]."""

    def build_decode_mask(self, seq_lens: list[int], max_blocks: int) -> torch.Tensor:
        """Additive bias hiding the padding past each decode's context."""
        width = max_blocks * self.block_size
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        keep = torch.arange(width)[None, :] < lens[:, None]
        bias = torch.zeros(len(seq_lens), 1, width, dtype=torch.float32)
        return bias.masked_fill_(~keep[:, None, :], float("-inf"))


class CpuAttention(AttentionBackend):
    """Torch attention tuned for CPUs.

    Cache layout (per layer, K and V alike): [num_kv_heads, num_blocks, block_size,
    head_dim]. Head-major, so gathering a batch's blocks yields [kv_heads, batch,
    tokens, head_dim] with no transpose, and decode attention is two batched GEMMs
    per KV group (all query heads of a group against that group's keys at once).
    """

    name = "cpu"

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    def write_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        # k, v: [num_tokens, kv_heads, head_dim] -> slots of the flat [kv_heads, slots, D]
        slots = meta.slot_mapping
        kv_heads, d = self.num_kv_heads, self.head_dim
        k_cache.view(kv_heads, -1, d)[:, slots] = k.transpose(0, 1)
        v_cache.view(kv_heads, -1, d)[:, slots] = v.transpose(0, 1)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]."""
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], k_cache, v_cache, meta)
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            out[rows] = self._prefill(q[rows], k_cache, v_cache, p)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        b, kvh, g, d = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        tables = meta.decode_block_tables
        k = k_cache[:, tables].view(kvh, b, -1, d)  # [kvh, b, L, d]
        v = v_cache[:, tables].view(kvh, b, -1, d)
        qg = q.view(b, kvh, g, d).transpose(0, 1)  # [kvh, b, g, d]
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * self.scale  # [kvh, b, g, L]
        probs = torch.softmax(scores + meta.decode_mask, dim=-1).to(q.dtype)
        o = torch.matmul(probs, v)  # [kvh, b, g, d]
        return o.transpose(0, 1).reshape(b, self.num_heads, d)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 p: PrefillSeq) -> torch.Tensor:
        kvh, d = self.num_kv_heads, self.head_dim
        k = k_cache[:, p.block_ids].view(kvh, -1, d)[:, : p.ctx_len]  # [kvh, ctx, d]
        v = v_cache[:, p.block_ids].view(kvh, -1, d)[:, : p.ctx_len]
        qh = q.transpose(0, 1)  # [heads, T, d]
        if p.ctx_len == p.q_len:
            mask, causal = None, True
        else:  # query i sits at position ctx_len - q_len + i
            start = p.ctx_len - p.q_len
            rows = torch.arange(p.q_len)[:, None] + start
            mask, causal = torch.arange(p.ctx_len)[None, :] <= rows, False
        o = F.scaled_dot_product_attention(
            qh.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
            is_causal=causal, scale=self.scale, enable_gqa=self.group > 1,
        )
        return o[0].transpose(0, 1)


BACKENDS: dict[str, type[AttentionBackend]] = {"cpu": CpuAttention}


def get_backend(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name]

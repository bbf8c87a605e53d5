"""Frozen configuration, one dataclass per layer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    # Blocks kept free when admitting new requests, so running ones can grow a while
    # before anyone is preempted.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # resolved from kv_cache_memory when 0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")

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


@dataclass(frozen=True)
class TierConfig:
    """The host tier for cold prefix blocks (cache_store)."""

    kind: str = "memory"  # none | memory | redis (memory in front of Redis)
    redis_url: str | None = None  # redis://host:port/db
    memory_bytes: int = 1 << 30  # the in-process tier's budget
    ttl: int = 24 * 3600  # seconds a written key lives; refreshed on every hit
    write_through: bool = False  # also write prompt blocks as they fill (cross-replica)
    load_timeout: float = 2.0  # a LOADING request recomputes after this long
    io_timeout: float = 1.0  # per Redis round trip
    max_pending_writes: int = 4096  # blocks waiting to be written; more are dropped

    def __post_init__(self) -> None:
        if self.kind not in ("none", "memory", "redis"):
            raise ValueError(f"kv tier must be none, memory or redis, got {self.kind!r}")
        if self.kind == "redis" and not self.redis_url:
            raise ValueError("kv tier 'redis' needs a redis_url (redis://host:port/db)")

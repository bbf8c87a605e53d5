"""What the engine publishes about itself: one frozen snapshot per step, built on the
engine thread and read by anyone (metrics, queue positions, health) without touching
the scheduler, the block manager or the host tier from another thread."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TierCounters:
    """One host tier's counters (cache_store.base.TierStats) and its breaker."""

    name: str
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    breaker_open: bool = False
    breaker_trips: int = 0  # times the breaker opened


@dataclass(frozen=True, slots=True)
class OffloadCounters:
    """The engine side of the host tier (engine.kv_io.OffloadStats)."""

    loads: int = 0
    load_blocks: int = 0
    load_timeouts: int = 0
    corrupt: int = 0
    written_blocks: int = 0
    dropped_writes: int = 0
    load_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine after its `step`-th step (0: loaded, no step yet). Counters are
    monotonic; `adds_taken` counts the requests the engine thread has taken from its
    inbox (AsyncEngine: requests sent but not yet taken are not in `waiting`)."""

    step: int = 0
    running: int = 0
    waiting: int = 0
    parked: int = 0
    max_num_seqs: int = 0
    kv_usage: float = 0.0  # share of KV blocks in use
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found
    preemptions: int = 0
    adds_taken: int = 0
    offload: OffloadCounters | None = None  # None: no host tier
    tiers: tuple[TierCounters, ...] = field(default=())

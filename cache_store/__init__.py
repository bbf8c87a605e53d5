"""Host tiers for KV blocks: bytes stored under keys the engine gives (see base.py)."""

from cache_store.base import KVTier, TierStats
from cache_store.codec import CorruptValue, decode_block, encode_block
from cache_store.memory import MemoryTier
from cache_store.redis_tier import CircuitBreaker, RedisTier
from cache_store.stack import TierStack

__all__ = ["CircuitBreaker", "CorruptValue", "KVTier", "MemoryTier", "RedisTier", "TierStack",
           "TierStats", "decode_block", "encode_block", "make_tier"]


def make_tier(kind: str, memory_bytes: int = 1 << 30, redis_url: str | None = None,
              ttl: int = 24 * 3600, timeout: float = 1.0) -> KVTier | None:
    """`none`, `memory`, or `redis` (memory in front of Redis at `redis_url`)."""
    if kind == "none":
        return None
    if kind == "memory":
        return MemoryTier(memory_bytes)
    if kind == "redis":
        if not redis_url:
            raise ValueError("kv tier 'redis' needs a redis_url (redis://host:port/db)")
        redis_tier = RedisTier(redis_url, ttl=ttl, timeout=timeout)
        return TierStack([MemoryTier(memory_bytes), redis_tier]) if memory_bytes else redis_tier
    raise ValueError(f"unknown kv tier {kind!r}: none, memory or redis")

"""Tokens per minute per API key.

Each key has a bucket of `per_minute` tokens that refills continuously (per_minute / 60
a second) up to full. A request is admitted while its key's bucket holds at least one
token; its prompt tokens are taken at admission and its generated tokens when it ends,
so the bucket can go below zero by what the requests in flight produce, and the key
then waits until the refill has paid that back. A request in flight is never cut off
by the limit: it is checked at admission only.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBudget:
    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        if per_minute <= 0:
            raise ValueError("per_minute must be positive")
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # tokens per second
        self.clock = clock
        # key -> (level, when); a key whose bucket refilled to full is dropped, so only
        # keys that used tokens within the last minute take memory
        self._buckets: dict[str, tuple[float, float]] = {}

    def level(self, key: str) -> float:
        """Tokens the key may still use now (negative: owed)."""
        now = self.clock()
        level, when = self._buckets.get(key, (self.capacity, now))
        level = min(self.capacity, level + (now - when) * self.rate)
        if level >= self.capacity:
            self._buckets.pop(key, None)
        return level

    def retry_after(self, key: str) -> float:
        """0 when the key may start a request now, else seconds until it may."""
        level = self.level(key)
        return 0.0 if level >= 1.0 else (1.0 - level) / self.rate

    def charge(self, key: str, tokens: int) -> None:
        """The key used `tokens` tokens."""
        if tokens <= 0:
            return
        self._buckets[key] = (self.level(key) - tokens, self.clock())

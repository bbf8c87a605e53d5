"""Tokens per minute per API key.

Each key has a bucket of `per_minute` tokens that refills continuously (per_minute / 60
a second) up to full. A request reserves what it may use at admission: its prompt plus
n x max_tokens, and is admitted only while the bucket holds that much (or, for a request
larger than the whole bucket, while the bucket is full). When it ends, the part of the
reservation it did not generate is paid back. So requests admitted at the same time
cannot use more than the bucket between them, however many arrive at once (charging
generated tokens only at the end let 256 concurrent requests take hours of budget). A
request in flight is never cut off by the limit: it is checked at admission only.
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

    def retry_after(self, key: str, tokens: float = 1.0) -> float:
        """0 when the key may start a request that reserves `tokens` now, else seconds
        until it may (a reservation past the capacity waits for a full bucket)."""
        need = min(max(tokens, 1.0), self.capacity)
        level = self.level(key)
        return 0.0 if level >= need else (need - level) / self.rate

    def charge(self, key: str, tokens: int) -> None:
        """The key used (or reserved) `tokens` tokens."""
        if tokens <= 0:
            return
        self._buckets[key] = (self.level(key) - tokens, self.clock())

    def refund(self, key: str, tokens: int) -> None:
        """A reservation's unused part comes back (never past the capacity)."""
        if tokens <= 0:
            return
        level = self.level(key) + tokens
        if level >= self.capacity:
            self._buckets.pop(key, None)
        else:
            self._buckets[key] = (level, self.clock())

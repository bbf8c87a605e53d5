"""The in-process tier: a byte-budgeted LRU of block values."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from cache_store.base import KVTier


class MemoryTier(KVTier):
    """Values kept in this process, least recently used dropped first once the total
    size passes `capacity_bytes`. Lives as long as the process: it gives reuse across
    requests (after the device pool has evicted a prefix), not across restarts."""

    name = "memory"
    local = True

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__()
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity = capacity_bytes
        self.used = 0
        self._data: OrderedDict[str, bytes | memoryview] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    @property
    def capacity_bytes(self) -> int | None:
        return self.capacity

    def lookup(self, keys: Sequence[str]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._data:
                    break
                n += 1
        self.stats.add(lookups=len(keys))
        return n

    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        out: list[bytes | memoryview | None] = []
        with self._lock:
            for k in keys:
                v = self._data.get(k)
                if v is not None:
                    self._data.move_to_end(k)
                out.append(v)
        got = [v for v in out if v is not None]
        self.stats.add(hits=len(got), misses=len(out) - len(got),
                       bytes_read=sum(len(v) for v in got))
        return out

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        stored = written = 0
        with self._lock:
            for k, v in items:
                if k in self._data:
                    self._data.move_to_end(k)
                    continue
                if len(v) > self.capacity:
                    continue
                self._data[k] = v
                self.used += len(v)
                stored += 1
                written += len(v)
            while self.used > self.capacity:
                _, old = self._data.popitem(last=False)
                self.used -= len(old)
        self.stats.add(puts=stored, bytes_written=written)
        return stored

    def delete(self, keys: Sequence[str]) -> None:
        with self._lock:
            for k in keys:
                v = self._data.pop(k, None)
                if v is not None:
                    self.used -= len(v)

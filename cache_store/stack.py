"""Tiers stacked fastest first (memory in front of redis)."""

from __future__ import annotations

from collections.abc import Sequence

from cache_store.base import KVTier


class TierStack(KVTier):
    """Reads try each tier in order and copy what a slower tier served into the faster
    ones; writes go to every tier (the memory tier for reuse in this process, Redis for
    restarts and other replicas)."""

    name = "stack"

    def __init__(self, tiers: Sequence[KVTier]) -> None:
        super().__init__()
        if not tiers:
            raise ValueError("a stack needs at least one tier")
        self.tiers = list(tiers)
        self.local = all(t.local for t in self.tiers)

    @property
    def capacity_bytes(self) -> int | None:
        """The largest tier's: a block any tier still has need not be written again
        (a read from it refills the faster ones)."""
        caps = [t.capacity_bytes for t in self.tiers]
        return None if None in caps else max(c for c in caps if c is not None)

    def lookup(self, keys: Sequence[str]) -> int:
        """Contiguous run of keys each present in some tier (blocks of one prefix may
        be split between tiers: some still in memory, older ones only in Redis)."""
        pos = 0
        while pos < len(keys):
            before = pos
            for t in self.tiers:
                pos += t.lookup(keys[pos:])
                if pos == len(keys):
                    break
            if pos == before:
                break
        return pos

    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        out: list[bytes | memoryview | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for level, t in enumerate(self.tiers):
            if not todo:
                break
            vals = t.get_many([keys[i] for i in todo])
            found = [(i, v) for i, v in zip(todo, vals) if v is not None]
            for i, v in found:
                out[i] = v
            if level and found:  # promote into the faster tiers
                for faster in self.tiers[:level]:
                    faster.put_many([(keys[i], v) for i, v in found])
            todo = [i for i, v in zip(todo, vals) if v is None]
        return out

    def get_into(self, keys: Sequence[str], bufs: Sequence[memoryview]) -> list[int | None]:
        out: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for level, t in enumerate(self.tiers):
            if not todo:
                break
            got = t.get_into([keys[i] for i in todo], [bufs[i] for i in todo])
            found = [(i, n) for i, n in zip(todo, got) if n is not None]
            for i, n in found:
                out[i] = n
            whole = [(keys[i], bytes(bufs[i][:n])) for i, n in found if n <= len(bufs[i])]
            if level and whole:  # promote into the faster tiers (copies: the buffers are reused)
                for faster in self.tiers[:level]:
                    faster.put_many(whole)
            todo = [i for i, n in zip(todo, got) if n is None]
        return out

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        return max(t.put_many(items) for t in self.tiers)

    def delete(self, keys: Sequence[str]) -> None:
        for t in self.tiers:
            t.delete(keys)

    def warm(self) -> None:
        for t in self.tiers:
            t.warm()

    def state(self) -> str:
        bad = [f"{t.name}:{t.state()}" for t in self.tiers if t.state() != "ok"]
        return ",".join(bad) or "ok"

    def close(self) -> None:
        for t in self.tiers:
            t.close()

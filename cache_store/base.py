"""The host-tier interface.

A tier stores opaque values under string keys it is given (the engine builds the keys
from its model fingerprint and the blocks' chain hashes, and (de)serializes its own KV
layout). Every method is called from the engine's cache I/O worker thread, never from
the engine thread, so a tier may block on I/O; implementations must still be safe to
call from several threads (a flush at shutdown runs beside the worker).

Failure contract: a tier never raises for an unavailable or misbehaving backend. A
failed lookup is 0 hits, a failed get is a miss (None), a failed put is dropped; each
is counted in `stats`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class TierStats:
    """Counters of one tier (monotonic, read by the metrics endpoint)."""

    lookups: int = 0  # keys asked about
    hits: int = 0  # keys loaded (get_many or get_into found them)
    misses: int = 0  # keys asked for that did not come back
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0  # values stored
    errors: int = 0  # backend failures (connection, timeout, protocol)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


class KVTier(ABC):
    """One storage tier for KV blocks."""

    name: str = "abstract"
    local: bool = False  # lookups are in-process and cheap (no I/O)

    def __init__(self) -> None:
        self.stats = TierStats()

    @property
    def capacity_bytes(self) -> int | None:
        """The most payload bytes this tier keeps at once; None when this process does
        not bound it (Redis: the server's maxmemory and TTLs decide)."""
        return None

    @abstractmethod
    def lookup(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are present (the contiguous hit count).
        Presence is a hint: a key may still be gone by the time it is read."""

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        """The values of `keys`, None for each one missing; refreshes their lifetime."""

    def get_into(self, keys: Sequence[str], bufs: Sequence[memoryview]) -> list[int | None]:
        """get_many's values written into the caller's buffers, one each: the value's
        length, or None for a key that is missing. A length past len(bufs[i]) means the
        value did not fit (only its start was written): the caller treats it as corrupt.
        Here: get_many, then a copy; the Redis tier reads replies from its socket
        straight into the buffers."""
        out: list[int | None] = []
        for v, buf in zip(self.get_many(keys), bufs):
            if v is not None:
                src = memoryview(v).cast("B")
                k = min(len(src), len(buf))
                buf[:k] = src[:k]
            out.append(None if v is None else len(v))
        return out

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        """Store values (replacing none that exist: a key's value never changes);
        returns how many were stored."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Drop keys (a corrupt value, found by the engine's codec)."""

    def warm(self) -> None:  # noqa: B027 - optional hook
        """Open what the first real call would (a connection): the I/O worker calls it
        once when it starts, so a replica's first tier hit does not pay for it."""

    def state(self) -> str:
        """"ok", or a word saying why the tier is not being used right now."""
        return "ok"

    def breaker_trips(self) -> int:
        """Times the tier's circuit breaker opened (0 for a tier without one)."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the tier is not used afterwards."""

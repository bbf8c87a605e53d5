"""Process-wide tuning, in one place. Entry points apply it (the command line, the
offline LLM class); engine and service code never change process state on their own,
with one exception: the event loop pauses the garbage collector for the length of one
fan-out of step outputs (`paused_gc`, held by `Outbox.take`), and restores it before it
returns. Each setting says what it was measured to fix (numbers in docs/performance.md)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator

# libgomp's default (300,000 spins) keeps an idle worker spinning for milliseconds after
# each of the engine's parallel regions: on a small machine that steals the core the
# event loop needs to fan a step's deltas out. ~10,000 spins still bridge the gaps
# between one step's ops (throughput unchanged within noise).
GOMP_SPINCOUNT = "10000"
# The engine thread gives up the GIL in every torch op and must get it back at once;
# the default 5 ms switch interval let the event loop hold it that long per op.
SWITCH_INTERVAL = 0.0005


def tune_openmp() -> None:
    """Read by GNU OpenMP when torch loads it: call before the first torch import. A
    value the user set is kept."""
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)


def tune_gil(interval: float = SWITCH_INTERVAL) -> None:
    """For a server: the engine thread and the event loop share the GIL."""
    sys.setswitchinterval(interval)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No garbage collection inside the block (the collector's state is restored after).

    For the fan-out of one step's outputs on the event loop: the allocations of 64
    deltas tripped a young-generation pass in front of some socket's write. The pass
    runs on the next allocation past the threshold instead, after the writes."""
    collecting = gc.isenabled()
    if collecting:
        gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def tune_malloc() -> bool:
    """glibc only: serve allocations up to 32 MB (glibc's ceiling for this setting) from
    the heap and keep up to 256 MB of freed heap instead of returning it to the OS at
    once.

    A tier load receives tens of MB of ~0.4 MB values on the I/O thread. With glibc's
    defaults each of those buffers was a fresh mmap (or a fresh per-thread arena) whose
    pages faulted in on first touch: a 46 MB Redis load took 220-340 ms inside the
    engine process against 30-50 ms with the heap serving them. The ceiling was 1 MB
    until it showed a price of its own: fixing the threshold turns off glibc's dynamic
    one, and then every larger per-step buffer (the CPU backend's logits, 6-12 MB at
    batch 64 over a 49k vocabulary) was a fresh mapping too, ~500k page faults and
    1.5 s of system time per chat-64 run on the CPU (1.3k faults at 32 MB). Returns
    whether it was applied."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    global _MALLOC_TUNED
    _MALLOC_TUNED = bool(mallopt(m_mmap_threshold, 32 << 20)) and \
        bool(mallopt(m_trim_threshold, 256 << 20))
    return _MALLOC_TUNED


_MALLOC_TUNED = False


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_stats() -> dict[str, int] | None:
    """glibc's heap in bytes, over every arena (mallinfo2; None elsewhere): `heap` (taken
    from the OS by brk/arenas), `in_use` (allocated chunks), `free` (freed chunks the
    heap keeps: what fragmentation or a trim threshold holds), `mmap` (large blocks
    mapped on their own). RSS growing with `free` is the allocator keeping memory, with
    `in_use` a leak. Walks the free lists: ~1 ms, for a scrape, not a hot path."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    m = fn()
    return {"heap": m.arena, "in_use": m.uordblks, "free": m.fordblks, "mmap": m.hblkhd}


class HeapTrimmer:
    """Hands the heap's freed pages back to the OS now and then (glibc malloc_trim),
    for a long-running server whose allocator was tuned by tune_malloc.

    With a 256 MB trim threshold glibc keeps what it frees, so the server's RSS follows
    the high-water mark of its heap: a 30-minute soak's RSS rose in two steps of ~30 MB
    (6.1% over its warm-up baseline) while the memory in use stayed flat and the heap's
    free pages rose by as much (tidewire_malloc_bytes). Every `every` seconds, when more
    than `min_free` bytes are free, the engine thread trims between steps: the pages
    freed since come back on first touch, and the high-water steps go away. (`free`
    counts free chunks whether or not their pages went back, so under steady load this
    trims every time. On a 250 MB heap with half of it free, a trim took 10 ms the first
    time and 0.5 ms once nothing new was free: the cost follows what it hands back.)"""

    def __init__(self, every: float = 15.0, min_free: int = 16 << 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.min_free, self.clock = every, min_free, clock
        self.enabled = _MALLOC_TUNED
        self.next = clock() + every
        self.trims = 0
        self.seconds = 0.0  # spent trimming, in all

    def maybe(self) -> bool:
        """Trim if it is time and enough is free; whether it trimmed."""
        if not self.enabled or self.clock() < self.next:
            return False
        self.next = self.clock() + self.every
        heap = malloc_stats()
        if heap is None or heap["free"] < self.min_free:
            return False
        t0 = time.perf_counter()
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
        self.seconds += time.perf_counter() - t0
        self.trims += 1
        return True

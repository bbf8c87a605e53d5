"""engine/runtime.py: process-wide tuning, the heap trimmer, the fan-out's gc pause."""

from __future__ import annotations

import gc

import pytest

from engine.runtime import paused_gc


def test_paused_gc_restores_the_collectors_state() -> None:
    was = gc.isenabled()
    try:
        gc.enable()
        with paused_gc():
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(RuntimeError), paused_gc():
            raise RuntimeError("a delivery that raises")
        assert gc.isenabled()
        gc.disable()  # paused already (by someone else): stays so
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_heap_trimmer_trims_on_schedule_when_enough_is_free() -> None:
    """Between steps, at most once per `every` seconds (an injected clock), and only
    when the heap keeps at least `min_free` bytes free: the RSS high-water steps of a
    long soak go back to the OS."""
    from engine.runtime import HeapTrimmer, malloc_stats

    now = [0.0]
    t = HeapTrimmer(every=60.0, min_free=0, clock=lambda: now[0])
    t.enabled = malloc_stats() is not None  # glibc (the tuned server's case)
    if not t.enabled:
        pytest.skip("not glibc")
    assert not t.maybe()  # not yet time
    now[0] = 60.0
    assert t.maybe() and t.trims == 1 and t.seconds > 0
    now[0] = 90.0
    assert not t.maybe()  # once a minute at most
    picky = HeapTrimmer(every=1.0, min_free=1 << 50, clock=lambda: now[0] + 5)
    picky.enabled = True
    assert not picky.maybe() and picky.trims == 0  # too little free to bother

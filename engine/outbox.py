"""The way step outputs cross from the engine thread to the event loop.

The engine thread appends each step's output list to a deque and wakes the loop with one
byte on a socket pair (one wake-up per step, never one callback per token); the loop
takes every list in order and delivers it. The hand-off is the engine thread's bounded
wait for the loop to have done so (`Outbox.wait_taken`).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import deque
from collections.abc import Callable

from engine.outputs import StepOutput
from engine.runtime import paused_gc


class Outbox:
    """One engine thread's outputs to one event loop.

    Thread ownership: `publish` and `wait_taken` run on the engine thread; `take` and
    `close` on the loop (which built it). The deque is the only state both touch:
    append on one side, popleft on the other, each atomic under the GIL."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 deliver: Callable[[list[StepOutput]], None]) -> None:
        """`deliver` runs on the loop, once per published list, in publishing order."""
        self._loop = loop
        self._deliver = deliver
        self._lists: deque[list[StepOutput]] = deque()
        self._handed = threading.Event()  # the loop has sent what was last handed off
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        loop.add_reader(self._wake_r.fileno(), self.take)

    def publish(self, outs: list[StepOutput]) -> None:
        """(Engine thread.) Queue a step's outputs and wake the loop.

        Why a socket pair rather than call_soon_threadsafe (an eventfd under uvloop):
        the engine thread blocks right after this (the hand-off wait), and a write to
        a socket is a wake-up the kernel may treat as synchronous (the waker is about
        to sleep), running the loop on this core instead of waking the idle one (see
        docs/performance.md)."""
        if not outs:
            return
        self._handed.clear()
        self._lists.append(outs)
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full of wake-ups already (the loop is coming), or shut down
            pass

    def wait_taken(self, timeout: float) -> bool:
        """(Engine thread.) Wait up to `timeout` seconds for the loop to have taken what
        was last published and run the tasks that woke (the socket writers); whether it
        did. This bounded wait is the hand-off (see AsyncEngine's `handoff`)."""
        return self._handed.wait(timeout)

    def take(self) -> None:
        """(Loop.) Deliver every output list published so far, in order."""
        try:  # one read: any wake-ups left over just run this once more, with nothing to do
            self._wake_r.recv(4096)
        except OSError:  # nothing there (BlockingIOError), or closed at shutdown
            pass
        lists = self._lists
        with paused_gc():
            while lists:
                self._deliver(lists.popleft())
                # Runs after the callbacks and task steps this delivery scheduled (FIFO),
                # i.e. after the writers it woke have sent their frames.
                self._loop.call_soon(self._handed.set)

    def close(self) -> None:
        """(Loop.) Stop watching the socket pair and close it; later wake-ups are lost."""
        self._loop.remove_reader(self._wake_r.fileno())
        self._wake_r.close()
        self._wake_w.close()

    @property
    def closed(self) -> bool:
        return self._wake_r.fileno() == -1

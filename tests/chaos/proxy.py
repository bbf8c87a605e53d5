"""A TCP proxy for fault injection: it sits between a client and a real backend (Redis,
or a Tidewire server) on a thread of its own, and can delay every chunk in both
directions, cut every open connection at once or on a period, refuse new connections,
or send new connections to another backend (`target`: a server that dies and a client
that reconnects to whatever answers)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable


class ChaosProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)  # where new connections go
        # or: the i-th connection goes to targets[i] (the last one for all after it)
        self.targets: list[tuple[str, int]] = []
        self.latency = 0.0  # seconds added to every chunk, each direction
        self.refuse = False  # new connections are closed at once
        self.accepted = 0
        self.cuts = 0  # connections this proxy cut
        self.port = 0
        self._conns: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="chaos-proxy")
        self._server: asyncio.base_events.Server | None = None
        self._cutter: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> ChaosProxy:
        self._thread.start()
        self._server = self._call(self._listen)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close() -> None:
            if self._cutter is not None:
                self._cutter.cancel()
            assert self._server is not None
            self._server.close()
            self._cut_all()
        self._call(close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def cut(self) -> None:
        """Reset every open connection now."""
        async def go() -> None:
            self._cut_all()
        self._call(go)

    def cut_every(self, period: float | None) -> None:
        """Reset every open connection each `period` seconds (None: stop)."""
        async def go() -> None:
            if self._cutter is not None:
                self._cutter.cancel()
                self._cutter = None
            if period is not None:
                self._cutter = asyncio.ensure_future(self._cut_loop(period))
        self._call(go)

    # -- on the proxy's loop -------------------------------------------------------------

    def _call(self, fn: Callable[[], object]):  # noqa: ANN202 - fn's coroutine's result
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(10)

    async def _listen(self) -> asyncio.base_events.Server:
        return await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def _cut_loop(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            self._cut_all()

    def _cut_all(self) -> None:
        for w in list(self._conns):
            self.cuts += 1
            w.transport.abort()
        self._conns.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        target = (self.targets[min(self.accepted, len(self.targets)) - 1] if self.targets
                  else self.target)
        if self.refuse:
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(*target)
        except OSError:
            writer.transport.abort()
            return
        self._conns.update((writer, up_w))
        pumps = [asyncio.ensure_future(self._pump(reader, up_w)),
                 asyncio.ensure_future(self._pump(up_r, writer))]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for p in pumps:
            p.cancel()
        for w in (writer, up_w):
            self._conns.discard(w)
            w.transport.abort()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Forward chunks, each `latency` after it arrived (a delay, not a bandwidth
        cap: chunks in flight overlap, as on a long link)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await src.read(1 << 16)
                await queue.put((time.monotonic() + self.latency, data))
                if not data:
                    break
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                await sender

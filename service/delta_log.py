"""Per-delta metrics, batched: the fan-out path appends a tuple per delta, and one
callback soon after (the first append since the last flush schedules it) observes them
all, so the histograms' cost is paid after a step's fan-out rather than in front of the
next socket."""

from __future__ import annotations

import asyncio

from service.metrics import Metrics


class DeltaLog:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._tokens: list[tuple[bool, float, int]] = []
        self._delivery: list[float] = []
        self._sse_delivery: list[float] = []

    def log_tokens(self, first: bool, gap: float, n: int) -> None:
        """n tokens went out: `gap` is the time to first token (first) or since the
        previous delta."""
        self._flush_soon()
        self._tokens.append((first, gap, n))

    def log_delivery(self, seconds: float) -> None:
        """A delta was written `seconds` after its oldest token was sampled."""
        self._flush_soon()
        self._delivery.append(seconds)

    def log_sse_delivery(self, seconds: float) -> None:
        """An OpenAI streaming chunk was written `seconds` after its oldest token was
        sampled."""
        self._flush_soon()
        self._sse_delivery.append(seconds)

    def _flush_soon(self) -> None:
        if not (self._tokens or self._delivery or self._sse_delivery):
            asyncio.get_running_loop().call_soon(self.flush)  # the first since a flush

    def flush(self) -> None:
        """Observe everything logged since the last flush."""
        tokens, self._tokens = self._tokens, []
        delivery, self._delivery = self._delivery, []
        sse, self._sse_delivery = self._sse_delivery, []
        m = self.metrics
        ttft, itl, out = m.ttft.observe, m.itl.observe, m.output_tokens.inc
        for first, gap, n in tokens:
            (ttft if first else itl)(gap)
            out(n)
        for seconds in delivery:
            m.delivery.observe(seconds)
        for seconds in sse:
            m.sse_delivery.observe(seconds)

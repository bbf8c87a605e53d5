"""service/delta_log.py: per-delta metrics are observed in one flush after the appends
that the event loop ran before it."""

from __future__ import annotations

import asyncio

from service.delta_log import DeltaLog
from service.metrics import Metrics


def count(m: Metrics, name: str) -> float:
    return m.registry.get_sample_value(name) or 0.0


def test_a_burst_of_deltas_is_observed_in_one_flush_after_it() -> None:
    m = Metrics()
    log = DeltaLog(m)
    flushes = []
    real = log.flush

    def flush() -> None:
        flushes.append(count(m, "tidewire_time_to_first_token_seconds_count"))
        real()

    log.flush = flush  # type: ignore[method-assign]

    async def run() -> None:
        log.log_tokens(True, 0.1, 1)
        log.log_tokens(False, 0.02, 3)
        log.log_delivery(0.001)
        log.log_sse_delivery(0.002)
        assert count(m, "tidewire_generation_tokens_total") == 0  # nothing observed yet
        await asyncio.sleep(0)
        log.log_tokens(False, 0.03, 2)  # the next burst schedules the next flush
        await asyncio.sleep(0)

    asyncio.run(run())
    assert flushes == [0.0, 1.0]
    assert count(m, "tidewire_time_to_first_token_seconds_count") == 1
    assert count(m, "tidewire_inter_token_latency_seconds_count") == 2
    assert count(m, "tidewire_generation_tokens_total") == 6
    assert count(m, "tidewire_delta_delivery_seconds_count") == 1
    assert count(m, "tidewire_sse_delta_delivery_seconds_count") == 1

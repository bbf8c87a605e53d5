"""Prometheus metrics, on a registry owned by the app (no module-level state)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               ProcessCollector, generate_latest)

from engine.runtime import malloc_stats

if TYPE_CHECKING:
    from engine.stats import EngineStats

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_DELIVERY = (5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2.5e-2,
             5e-2, 0.1, 0.25, 1.0)
_RATIO = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_PER_STEP = (0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 16)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # process_resident_memory_bytes, process_open_fds, CPU seconds (Linux /proc)
        ProcessCollector(registry=r)
        self.ttft = Histogram("tidewire_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("tidewire_inter_token_latency_seconds", "Gap between deltas",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("tidewire_request_latency_seconds", "Arrival to done",
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("tidewire_queue_time_seconds", "Arrival to first admission",
                               buckets=_LATENCY, registry=r)
        self.running = Gauge("tidewire_requests_running", "Requests in the running batch",
                             registry=r)
        self.waiting = Gauge("tidewire_requests_waiting", "Requests waiting", registry=r)
        self.kv_usage = Gauge("tidewire_kv_cache_usage_ratio", "Share of KV blocks in use",
                              registry=r)
        self.prefix_queries = Gauge("tidewire_prefix_cache_queried_tokens",
                                    "Prompt tokens looked up", registry=r)
        self.prefix_hits = Gauge("tidewire_prefix_cache_hit_tokens", "Prompt tokens found",
                                 registry=r)
        self.preemptions = Gauge("tidewire_preemptions", "Requests preempted", registry=r)
        self.prompt_tokens = Counter("tidewire_prompt_tokens", "Prompt tokens received",
                                     registry=r)
        self.output_tokens = Counter("tidewire_generation_tokens", "Tokens generated",
                                     registry=r)
        self.requests = Counter("tidewire_requests", "Finished requests", ["finish_reason"],
                                registry=r)
        self.errors = Counter("tidewire_errors", "Errors sent to clients", ["code"], registry=r)
        self.delivery = Histogram(
            "tidewire_delta_delivery_seconds", "Token sampled in the engine to its delta written "
            "to the socket", buckets=_DELIVERY, registry=r)
        self.sse_delivery = Histogram(
            "tidewire_sse_delta_delivery_seconds", "Token sampled in the engine to its "
            "OpenAI streaming (SSE) chunk written", buckets=_DELIVERY, registry=r)
        self.connections = Gauge("tidewire_websocket_connections", "Open sockets", registry=r)
        self.resumes = Counter("tidewire_websocket_resumable_requests", "Requests of dropped "
                               "sockets by outcome: parked (kept for a reconnect), resumed, "
                               "expired (grace over), refused (over max_detached), continued "
                               "(resumed here from the client's tokens)", ["outcome"],
                               registry=r)
        self.detached = Gauge("tidewire_websocket_parked_requests", "Requests of dropped sockets "
                              "waiting for a resume", registry=r)
        # Host tier (cache_store): cumulative counts read from the engine when scraped.
        self.tier_ops = Gauge("tidewire_kv_tier_ops", "Host tier activity by tier: lookups, "
                              "hits, misses, puts, errors", ["tier", "op"], registry=r)
        self.tier_bytes = Gauge("tidewire_kv_tier_bytes", "Bytes moved per tier",
                                ["tier", "direction"], registry=r)
        self.tier_loads = Gauge("tidewire_kv_tier_loads", "Engine-side tier traffic: loads, "
                                "load_blocks, load_timeouts, corrupt, written_blocks, "
                                "dropped_writes", ["what"], registry=r)
        self.tier_load_seconds = Gauge("tidewire_kv_tier_load_seconds",
                                       "Time the I/O worker spent on loads (sum)", registry=r)
        self.tier_breaker_open = Gauge("tidewire_kv_tier_breaker_open",
                                       "1 while a tier's circuit breaker is not closed",
                                       ["tier"], registry=r)
        self.tier_breaker_trips = Gauge("tidewire_kv_tier_breaker_trips",
                                        "Times a tier's circuit breaker opened (cumulative)",
                                        ["tier"], registry=r)

        self.malloc = Gauge("tidewire_malloc_bytes", "glibc heap by kind: heap (from the OS), "
                            "in_use, free (kept by the allocator), mmap", ["kind"], registry=r)
        # speculative decoding, one observation per finished request that verified proposals
        self.spec_acceptance = Histogram(
            "tidewire_spec_acceptance_ratio", "Per request: proposed tokens the target "
            "accepted, over those proposed", buckets=_RATIO, registry=r)
        self.spec_accepted = Histogram(
            "tidewire_spec_accepted_tokens_per_step", "Per request: accepted proposals per "
            "verifying step (each step also adds the target's own token)",
            buckets=_PER_STEP, registry=r)

    def observe_spec(self, spec: tuple[int, int, int] | None) -> None:
        """A finished request's (verifying steps, proposed, accepted), if it speculated."""
        if spec is None or not spec[0]:
            return
        steps, proposed, accepted = spec
        self.spec_acceptance.observe(accepted / proposed if proposed else 0.0)
        self.spec_accepted.observe(accepted / steps)

    def observe_engine(self, st: EngineStats) -> None:
        """Gauges from the engine's last published stats (engine/stats.py)."""
        self.running.set(st.running)
        self.waiting.set(st.waiting)
        self.kv_usage.set(st.kv_usage)
        self.prefix_queries.set(st.prefix_queries)
        self.prefix_hits.set(st.prefix_hits)
        self.preemptions.set(st.preemptions)
        if st.offload is not None:
            for what in ("loads", "load_blocks", "load_timeouts", "corrupt", "written_blocks",
                         "dropped_writes"):
                self.tier_loads.labels(what).set(getattr(st.offload, what))
            self.tier_load_seconds.set(st.offload.load_seconds)
        for t in st.tiers:
            for op in ("lookups", "hits", "misses", "puts", "errors"):
                self.tier_ops.labels(t.name, op).set(getattr(t, op))
            self.tier_bytes.labels(t.name, "read").set(t.bytes_read)
            self.tier_bytes.labels(t.name, "written").set(t.bytes_written)
            self.tier_breaker_open.labels(t.name).set(1 if t.breaker_open else 0)
            self.tier_breaker_trips.labels(t.name).set(t.breaker_trips)

    def render(self) -> bytes:
        heap = malloc_stats()
        if heap is not None:
            for kind, n in heap.items():
                self.malloc.labels(kind).set(n)
        return generate_latest(self.registry)

"""The Redis tier under faults, through the real server and real sockets: Redis killed
mid-run and restarted, Redis slow and cutting connections (a TCP proxy in front of it),
Redis answering corrupt values. Every request must complete with exactly HF's greedy
tokens; the tier's breaker must open and close again; hits must come back.

The server: a tiny random Llama, a KV pool small enough that each prompt set is evicted
by the next ones, a Redis-only tier (no memory tier in front) with write-through, so
every third round of a set is served from Redis when Redis is well."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import EngineConfig
from engine.config import CacheConfig, TierConfig
from service.config import ServiceConfig
from tests.chaos.driver import Stream, full, greedy_body, run_requests
from tests.chaos.proxy import ChaosProxy
from tests.conftest import hf_greedy
from tests.servers import apoll, run_server

BS = 8
MAX_TOKENS = 6
SETS, PER_SET = 3, 12  # prompt sets cycled; requests per round


def prompt_sets(seed: int = 7) -> list[list[list[int]]]:
    """SETS sets of PER_SET prompts; in each set, groups of 3 share a 40-token prefix."""
    rng = random.Random(seed)
    out = []
    for _ in range(SETS):
        ps = []
        for _ in range(PER_SET // 3):
            prefix = [rng.randrange(3, 320) for _ in range(40)]
            ps += [prefix + [rng.randrange(3, 320) for _ in range(rng.randint(2, 10))]
                   for _ in range(3)]
        out.append(ps)
    return out


def tier_config(path: Path, redis_url: str) -> ServiceConfig:
    # 96 blocks hold about one round (12 prompts x ~7 blocks); two other sets evict it
    return ServiceConfig(engine=EngineConfig(
        model=str(path), dtype="float32", cache=CacheConfig(block_size=BS, num_blocks=96),
        tier=TierConfig("redis", redis_url, memory_bytes=0, write_through=True,
                        io_timeout=0.25, load_timeout=1.0)))


class Load:
    """Rounds of requests (one prompt set per round, cycling) over 4 sockets, until
    stopped; checks every stream against the reference as it ends."""

    def __init__(self, ws_url: str, sets: list[list[list[int]]], ref: dict[tuple, list[int]]):
        self.ws_url, self.sets, self.ref = ws_url, sets, ref
        self.streams: list[Stream] = []
        self.rounds = 0
        self.host_tokens_by_round: list[int] = []
        self.stop = asyncio.Event()
        self.wrong: list[str] = []

    async def one_round(self) -> int:
        ps = self.sets[self.rounds % len(self.sets)]
        tag = f"r{self.rounds}"
        jobs = [(f"{tag}-{i}", greedy_body(p, MAX_TOKENS)) for i, p in enumerate(ps)]
        got = await run_requests(self.ws_url, jobs, sockets=4)
        host = 0
        for (rid, _), p in zip(jobs, ps):
            s = got[rid]
            self.streams.append(s)
            if s.tokens != self.ref[tuple(p)]:
                self.wrong.append(rid)
            if s.start is not None:
                host += s.start["cached_tokens"]["host"]
        self.rounds += 1
        self.host_tokens_by_round.append(host)
        return host

    async def run(self) -> None:
        while not self.stop.is_set():
            await self.one_round()

    def outcomes(self) -> Counter:
        return Counter(s.outcome for s in self.streams)


@pytest.fixture(scope="module")
def workload(tiny_models) -> tuple[Path, list[list[list[int]]], dict[tuple, list[int]]]:
    path = tiny_models("llama", 0)
    sets = prompt_sets()
    flat = [p for ps in sets for p in ps]
    ref = {tuple(p): out for p, out in zip(flat, hf_greedy(path, flat, MAX_TOKENS))}
    return path, sets, ref


def tier_stats(s) -> object:  # noqa: ANN001 - RunningServer -> TierCounters of redis
    (redis,) = [t for t in s.gateway.engine.stats.tiers if t.name == "redis"]
    return redis


async def assert_clean(load: Load, s) -> None:  # noqa: ANN001
    """Zero failed requests, zero wrong tokens, and the server idle with every block back.
    (The engine's stats are a snapshot taken after each step, and a CPU step hands its
    outputs, the last dones among them, to the sockets before its block bookkeeping: the
    snapshot can trail the last done by a moment, so it is polled.)"""
    assert load.wrong == [], load.wrong[:10]
    assert load.outcomes() == Counter({"completed": len(load.streams)}), load.outcomes()

    def idle() -> bool:
        st = s.gateway.engine.stats
        return st.running == st.waiting == 0 and st.kv_usage == 0.0

    await apoll(idle, 10, "the engine idle with every block back")
    assert s.gateway.inflight_total == 0


def report(name: str, load: Load, s, **extra: object) -> None:  # noqa: ANN001
    t = tier_stats(s)
    print(f"\nchaos {name}: {len(load.streams)} requests in {load.rounds} rounds, "
          f"outcomes {dict(load.outcomes())}, wrong tokens {len(load.wrong)}, "
          f"redis errors {t.errors}, breaker trips {t.breaker_trips}, "
          f"rounds with Redis hits {sum(1 for h in load.host_tokens_by_round if h)} "
          f"({sum(load.host_tokens_by_round)} tokens), {extra}")


async def test_redis_killed_mid_run_and_restarted(workload, redis_server) -> None:
    path, sets, ref = workload
    cycles = 3 if full() else 1
    with run_server(tier_config(path, redis_server.url)) as s:
        load = Load(s.ws_url, sets, ref)
        for _ in range(SETS):
            await load.one_round()
        assert await load.one_round() > 0  # the fourth round's set comes back from Redis
        runner = asyncio.ensure_future(load.run())
        marks = []
        for _ in range(cycles):
            # kill it while rounds run
            await apoll(lambda: load.rounds >= (marks[-1][1] if marks else SETS) + 2, 60,
                        "two more rounds")
            trips = tier_stats(s).breaker_trips
            await asyncio.to_thread(redis_server.stop)
            killed_at = load.rounds
            await apoll(lambda trips=trips: tier_stats(s).breaker_trips > trips, 30, "the breaker to open")
            assert tier_stats(s).breaker_open
            await apoll(lambda k=killed_at: load.rounds >= k + 2 * SETS, 60,
                        "rounds with Redis down")
            # nothing comes from Redis while it is down (the round running at the kill
            # may have loaded before it)
            assert sum(load.host_tokens_by_round[killed_at + 1:]) == 0
            # restarted empty (no persistence): the breaker closes after its cooldown
            # (5 s), and hits come back once write-through has put the prefixes there
            # again (the engine forgets what it believed Redis held when a lookup misses)
            await asyncio.to_thread(redis_server.start)
            restarted_at = load.rounds
            await apoll(lambda: not tier_stats(s).breaker_open, 30, "the breaker to close")
            await apoll(lambda r=restarted_at: sum(load.host_tokens_by_round[r:]) > 0, 60,
                        "Redis hits after the restart")
            marks.append((killed_at, restarted_at))
        load.stop.set()
        await asyncio.wait_for(runner, 60)
        report("redis killed and restarted", load, s, kill_restart_rounds=marks)
        await assert_clean(load, s)
        assert tier_stats(s).breaker_trips >= cycles
        assert redis_server.client().dbsize() > 0


@pytest.fixture()
def proxied_redis(redis_server) -> Iterator[ChaosProxy]:
    proxy = ChaosProxy(redis_server.port).start()
    try:
        yield proxy
    finally:
        proxy.stop()


async def test_redis_slow_and_cutting_connections(workload, proxied_redis) -> None:
    """Latency under, then over, the tier's I/O timeout, and connections reset on a
    period: requests wait at most their load timeout, then recompute."""
    path, sets, ref = workload
    proxy = proxied_redis
    rounds = 4 * SETS if full() else 2 * SETS
    with run_server(tier_config(path, proxy.url)) as s:
        load = Load(s.ws_url, sets, ref)
        for _ in range(SETS + 1):
            await load.one_round()
        assert load.host_tokens_by_round[-1] > 0
        phases = {}
        # slow: 20 ms a chunk each way (the lookup answer misses the step's 2 ms budget,
        # so requests go through a LOADING round), still under the 0.25 s I/O timeout
        proxy.latency = 0.02
        for _ in range(rounds):
            await load.one_round()
        phases["slow_host_tokens"] = sum(load.host_tokens_by_round[-rounds:])
        # slower than the I/O timeout: every call times out, the breaker opens
        proxy.latency = 0.4
        for _ in range(rounds):
            await load.one_round()
        phases["too_slow_trips"] = tier_stats(s).breaker_trips
        # back to 5 ms: the breaker closes after its cooldown (5 s)
        proxy.latency = 0.005
        deadline = time.monotonic() + 30
        while tier_stats(s).breaker_open:
            assert time.monotonic() < deadline, "the breaker did not close"
            await load.one_round()
        # then connections reset every 50 ms
        errors = tier_stats(s).errors
        proxy.cut_every(0.05)
        for _ in range(rounds):
            await load.one_round()
        proxy.cut_every(None)
        phases["cuts"] = proxy.cuts
        phases["errors_while_cutting"] = tier_stats(s).errors - errors
        report("redis slow and cut", load, s, **phases)
        await assert_clean(load, s)
        assert phases["slow_host_tokens"] > 0  # slow is not down: hits still land
        assert phases["too_slow_trips"] >= 1
        assert proxy.cuts > 0 and phases["errors_while_cutting"] > 0


def corrupt(value: bytes, how: str, rng: random.Random) -> bytes:
    if how == "flip" and len(value) > 200:  # one byte of the payload (the CRC catches it)
        i = rng.randrange(200, len(value))
        return value[:i] + bytes([value[i] ^ 0x5A]) + value[i + 1:]
    if how in ("truncate", "flip"):
        return value[: rng.randrange(0, len(value))]
    if how == "header":  # the shape field
        return value[:25] + b"\xff\xff\xff\x7f" + value[29:]
    return rng.randbytes(len(value))


async def test_redis_returning_corrupt_values(workload, redis_server) -> None:
    """Every value in Redis corrupted (a flipped payload byte, truncated, a bad header,
    random bytes, or another block's value under this key), again and again while the
    rounds run: each is a miss, deleted, and the request recomputes; no wrong token."""
    path, sets, ref = workload
    rng = random.Random(3)
    client = redis_server.client()
    with run_server(tier_config(path, redis_server.url)) as s:
        load = Load(s.ws_url, sets, ref)
        for _ in range(SETS):
            await load.one_round()
        stop = threading.Event()
        kinds: Counter = Counter()

        def vandal() -> None:
            while not stop.is_set():
                keys = client.keys("tw:kv:v1:*")
                values = client.mget(keys) if keys else []
                good = [v for v in values if v]
                for k, v in zip(keys, values):
                    if not v:
                        continue
                    how = rng.choice(["flip", "truncate", "header", "random", "swap"])
                    if how == "swap":
                        other = rng.choice(good)
                        if other == v:
                            continue
                        bad = other
                    else:
                        bad = corrupt(v, how, rng)
                    client.set(k, bad, xx=True, keepttl=True)
                    kinds[how] += 1
                stop.wait(0.02)

        thread = threading.Thread(target=vandal, daemon=True)
        thread.start()
        try:
            for _ in range((6 if full() else 3) * SETS):
                await load.one_round()
        finally:
            stop.set()
            thread.join(10)
        corrupt_seen = s.gateway.engine.stats.offload.corrupt
        report("redis corrupt values", load, s, corrupted=dict(kinds), rejected=corrupt_seen)
        await assert_clean(load, s)
        assert sum(kinds.values()) > 0 and corrupt_seen > 0
        # with the vandal gone, clean values are written again and hit again
        before = len(load.host_tokens_by_round)
        deadline = time.monotonic() + 60
        while sum(load.host_tokens_by_round[before:]) == 0:
            assert time.monotonic() < deadline, "no Redis hits after the corruption stopped"
            await load.one_round()
        await assert_clean(load, s)

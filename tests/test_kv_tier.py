"""The host tier end to end: greedy outputs stay exact with the tier off, on a device
hit, after a restart (Redis), from a second process (write-through), and under every
fault; keys are stable across processes; nothing leaks over 1,000 requests."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cache_store import RedisTier, encode_block
from cache_store.codec import HEADER_SIZE, MAC_HEADER_SIZE
from engine import LLM, SamplingParams
from engine.block_manager import hash_block, root_hash
import engine.kv_io
from engine.kv_io import BlockFormat, tier_key
from engine.kv_offload import kv_fingerprint
from tests.conftest import hf_greedy, run_side_by_side

ROOT = Path(__file__).resolve().parents[1]
BS = 8
MAX_TOKENS = 6


def prompts(seed: int, n: int = 4, prefix_len: int = 40) -> list[list[int]]:
    """n prompts sharing a prefix of `prefix_len` tokens (5 full blocks), then apart."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 320) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 320) for _ in range(rng.randint(3, 12))]
            for _ in range(n)]


def make_llm(path: Path, **kw) -> LLM:
    kw = {"num_kv_blocks": 96, "debug": True, **kw}
    return LLM(model=str(path), dtype="float32", block_size=BS, max_num_batched_tokens=64, **kw)


def run(llm: LLM, ps: list[list[int]], salt: bytes = b"") -> tuple[list[list[int]], list[int]]:
    """Greedy outputs and the host-cached prompt tokens of each request (all at once)."""
    eng = llm.engine
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [f"q{time.monotonic_ns()}-{i}" for i in range(len(ps))]
    for rid, p in zip(ids, ps):
        eng.add(eng.make_request(p, sp, rid, salt))
    toks: dict[str, list[int]] = {rid: [] for rid in ids}
    host: dict[str, int] = {}
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
            host[o.request_id] = o.num_host_cached_tokens
    assert eng.kv.num_free_blocks == eng.num_blocks  # nothing held after the run
    return [toks[r] for r in ids], [host[r] for r in ids]


def redis_keys(redis_server) -> list[bytes]:
    return redis_server.client().keys("tw:kv:v1:*")


_SECOND = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from tests.test_kv_tier import make_llm, run
    llm = make_llm(sys.argv[2], kv_tier="redis", redis_url=sys.argv[3])
    toks, host = run(llm, json.loads(sys.argv[4]))
    print(json.dumps({"tokens": toks, "host": host}))
    llm.close()
""")


def second_process(path: Path, url: str, ps: list[list[int]]) -> dict:
    """Another engine process (another replica) on the same Redis."""
    out = subprocess.run([sys.executable, "-c", _SECOND, str(ROOT), str(path), url,
                          json.dumps(ps)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONHASHSEED": "4242"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_greedy_identical_off_device_hit_restart_and_second_process(tiny_models,
                                                                     redis_server) -> None:
    path = tiny_models("llama", 0)
    ps = prompts(0)
    ref = hf_greedy(path, ps, MAX_TOKENS)
    with make_llm(path, kv_tier="none") as off:
        assert run(off, ps)[0] == ref
    a = make_llm(path, kv_tier="redis", redis_url=redis_server.url)
    # memory in front of Redis: Redis is not bounded by this process, so the write-dedupe
    # set keeps its full ceiling
    assert a.engine.offload.tier.capacity_bytes is None and a.engine.offload.known_limit == 1 << 18
    toks, host = run(a, ps)
    assert toks == ref and host == [0] * 4
    toks, host = run(a, ps)  # device hits
    assert toks == ref and host == [0] * 4
    assert a.engine.kv.num_hits >= 4 * 5 * BS
    a.close()  # graceful shutdown flushes the cached blocks to Redis
    assert len(redis_keys(redis_server)) >= 5 + 4

    b = make_llm(path, kv_tier="redis", redis_url=redis_server.url)  # a restart
    toks, host = run(b, ps)
    assert toks == ref
    assert all(h >= 5 * BS for h in host), host  # the prefix came back from Redis
    assert b.engine.offload.stats.load_blocks >= 5

    # Cross-replica: write-through publishes prompt blocks while this engine lives on.
    ps2 = prompts(1)
    ref2 = hf_greedy(path, ps2, MAX_TOKENS)
    c = make_llm(path, kv_tier="redis", redis_url=redis_server.url, kv_tier_write_through=True)
    assert run(c, ps2)[0] == ref2
    deadline = time.monotonic() + 10
    while c.engine.offload.worker.pending_writes and time.monotonic() < deadline:
        time.sleep(0.01)
    other = second_process(path, redis_server.url, ps2)
    assert other["tokens"] == ref2
    assert all(h >= 5 * BS for h in other["host"]), other["host"]
    for llm in (b, c):
        llm.close()


def test_fp32_blocks_computed_with_int8_x_never_share_keys_with_exact_ones(tiny_models) -> None:
    """An fp32 run whose 4-bit matmuls took x in int8 (dtype auto on a CPU without native
    bf16) writes other K/V than one with the exact sums: their tier keys differ. In bf16
    x is always int8 there, so the flag changes nothing."""
    import torch

    from engine.build import offload_fingerprint
    from engine.config import EngineConfig
    from engine.models.arch import ModelArch

    path = tiny_models("llama", 0)
    arch, cfg = ModelArch.from_dir(path), EngineConfig(quantization="int4")
    fp = {(dt, x8): offload_fingerprint(cfg, arch, path, dt, x8)
          for dt in (torch.float32, torch.bfloat16) for x8 in (False, True)}
    assert fp[torch.float32, True] != fp[torch.float32, False]
    assert fp[torch.bfloat16, True] == fp[torch.bfloat16, False] != fp[torch.float32, True]


def test_keys_are_stable_across_processes_and_separate_models_and_tenants() -> None:
    fp = kv_fingerprint("llama", "abc123", "bfloat16", 16, 30, 3, 64)
    chain = hash_block(root_hash(b"tenant-a"), list(range(16)))
    here = tier_key(fp, chain)
    code = ("import sys; sys.path.insert(0, sys.argv[1]);"
            "from engine.kv_io import tier_key; from engine.kv_offload import kv_fingerprint;"
            "from engine.block_manager import hash_block, root_hash;"
            "print(tier_key(kv_fingerprint('llama', 'abc123', 'bfloat16', 16, 30, 3, 64),"
            " hash_block(root_hash(b'tenant-a'), list(range(16)))))")
    outs = run_side_by_side([([sys.executable, "-c", code, str(ROOT)],
                              {**os.environ, "PYTHONHASHSEED": seed})
                             for seed in ("1", "2", "random")])
    assert [o.strip() for o in outs] == [here] * 3
    assert here.startswith(f"tw:kv:v1:{fp.hex()}:") and len(here) == len("tw:kv:v1:") + 129
    # Any change of model, weights, dtype, geometry or block size changes the fingerprint.
    others = [kv_fingerprint("qwen2", "abc123", "bfloat16", 16, 30, 3, 64),
              kv_fingerprint("llama", "abc124", "bfloat16", 16, 30, 3, 64),
              kv_fingerprint("llama", "abc123", "float32", 16, 30, 3, 64),
              kv_fingerprint("llama", "abc123", "bfloat16", 32, 30, 3, 64),
              kv_fingerprint("llama", "abc123", "bfloat16", 16, 30, 3, 128)]
    assert len({fp, *others}) == 6
    # Fields are length-prefixed: moving a boundary is a different fingerprint.
    assert kv_fingerprint("ab", "c", "x", 1, 1, 1, 1) != kv_fingerprint("a", "bc", "x", 1, 1, 1, 1)
    assert kv_fingerprint("llama", "1", "f", 11, 1, 1, 1) != \
        kv_fingerprint("llama", "11", "f", 1, 1, 1, 1)
    # Tenants: the salt seeds the chain, so the same tokens give other keys.
    assert hash_block(root_hash(b"tenant-b"), list(range(16))) != chain
    assert hash_block(root_hash(b"ab"), [1]) != hash_block(root_hash(b"a"), [1])


def test_other_tenant_or_model_misses_same_one_hits(tiny_models, redis_server) -> None:
    path = tiny_models("llama", 0)
    ps = prompts(2, n=2)
    ref = hf_greedy(path, ps, MAX_TOKENS)
    with make_llm(path, kv_tier="redis", redis_url=redis_server.url) as a:
        assert run(a, ps, salt=b"tenant-a")[0] == ref
    with make_llm(path, kv_tier="redis", redis_url=redis_server.url) as b:
        toks, host = run(b, ps, salt=b"tenant-b")
        assert toks == ref and host == [0, 0]  # another tenant: no hit
        toks, host = run(b, ps, salt=b"tenant-a")
        assert toks == ref and min(host) >= 5 * BS  # same tenant: hit
    other_model = tiny_models("llama", 1)
    with make_llm(other_model, kv_tier="redis", redis_url=redis_server.url) as c:
        toks, host = run(c, ps, salt=b"tenant-a")
        assert toks == hf_greedy(other_model, ps, MAX_TOKENS) and host == [0, 0]


def _populate(path: Path, url: str, ps: list[list[int]], **kw) -> None:
    with make_llm(path, kv_tier="redis", redis_url=url, **kw) as a:
        run(a, ps)


def _redis_only(path: Path, url: str, **kw) -> LLM:
    """Redis with no memory tier in front, so every load really goes to Redis."""
    return make_llm(path, kv_tier="redis", redis_url=url, kv_tier_memory=0, **kw)


class GatedTier(RedisTier):
    """A real Redis whose reads after the first `free` chunks wait for `gate`; `fail`
    makes them raise something that is not a Redis error instead."""

    def __init__(self, url: str, free: int = 1) -> None:
        super().__init__(url)
        self.gate, self.free, self.fail, self.reads = threading.Event(), free, False, 0

    def get_into(self, keys, bufs):  # noqa: ANN001, ANN201
        self.reads += 1
        if self.reads > self.free:
            assert self.gate.wait(10)
            if self.fail:
                raise RuntimeError("a tier that raises")
        return super().get_into(keys, bufs)


def _chunked(path: Path, url: str, monkeypatch, tier: RedisTier | None = None) -> LLM:
    """Loads of 2 values a round trip through 2 chunk buffers."""
    import engine.kv_io

    monkeypatch.setattr(engine.kv_io, "LOAD_CHUNK", 2)
    monkeypatch.setattr(engine.kv_io, "LOAD_BUFFERS", 2)
    llm = _redis_only(path, url)
    if tier is not None:
        off = llm.engine.offload
        off.tier = off.worker.tier = tier
    return llm


def _chunked_hit(path: Path, url: str, monkeypatch, seed: int  # noqa: ANN001
                 ) -> tuple[list[list[int]], list[list[int]], LLM]:
    """A prompt whose 12-block prefix (and any full block after it) is in Redis, HF's
    greedy tokens for it, and a _chunked engine that will load it."""
    ps = prompts(seed, n=1, prefix_len=12 * BS)
    ref = hf_greedy(path, ps, MAX_TOKENS)
    _populate(path, url, ps)
    return ps, ref, _chunked(path, url, monkeypatch)


def _buffers_back(off, n: int = 2) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + 10
    while off.worker._free_bufs.qsize() < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return off.worker._free_bufs.qsize() == n


def test_a_load_arrives_in_chunks_put_in_while_the_rest_is_read(tiny_models, redis_server,
                                                                 monkeypatch) -> None:
    """A prefix of 12 blocks read 2 values a round trip through 2 chunk buffers: the
    worker waits for the engine thread to empty a buffer before it reads on, the engine
    puts chunks into the pool before the last has arrived, and the output is HF's."""
    ps, ref, llm = _chunked_hit(tiny_models("llama", 0), redis_server.url, monkeypatch, 11)
    off = llm.engine.offload
    seen = []  # (blocks arrived, job done) each time the engine put a chunk in
    real = off._insert_chunk

    def spy(job, chunk):  # noqa: ANN001, ANN202
        seen.append((job.num_arrived, job.done))
        return real(job, chunk)
    monkeypatch.setattr(off, "_insert_chunk", spy)
    toks, host = run(llm, ps)
    assert toks == ref and host[0] >= 12 * BS
    blocks = (len(ps[0]) - 1) // BS  # (the tier has every full block; one token is left)
    assert len(seen) == -(-blocks // 2) and not seen[0][1]  # the first chunk went in before
    # the load ended
    assert _buffers_back(off)
    llm.close()


def test_a_load_aborted_or_failing_mid_way_gives_every_buffer_back(tiny_models, redis_server,
                                                                   monkeypatch) -> None:
    """Chunks still to come when the request is aborted; a tier that raises something
    other than a Redis error in the middle of a load: the buffers all come back, the
    worker lives on, and the failed load's request recomputes what did not arrive."""
    path = tiny_models("llama", 0)
    ps = prompts(12, n=1, prefix_len=12 * BS) + prompts(13, n=1, prefix_len=12 * BS)
    ref = hf_greedy(path, ps[1:], MAX_TOKENS)
    _populate(path, redis_server.url, ps)
    tier = GatedTier(redis_server.url)
    llm = _chunked(path, redis_server.url, monkeypatch, tier)
    eng, off = llm.engine, llm.engine.offload
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    eng.add(eng.make_request(ps[0], sp, "gone"))
    eng.step()
    job = off._loads["gone"]
    assert "gone" in eng.scheduler.loading and not job.done
    eng.abort(["gone"])  # one chunk read, the worker held at the second
    tier.gate.set()
    while eng.has_unfinished():
        eng.step()
    assert _buffers_back(off) and job.done and job.cancelled and not off._loads
    tier.gate.clear()
    tier.fail, tier.reads = True, 0
    threading.Timer(0.05, tier.gate.set).start()
    toks, host = run(llm, ps[1:])
    assert toks == ref and host == [2 * BS]  # the first chunk, then the failure
    assert _buffers_back(off) and off.worker.thread.is_alive()
    eng.kv.check_integrity()
    assert eng.kv.num_free_blocks == eng.num_blocks
    llm.close()


def test_a_load_whose_blocks_are_evicted_between_chunks_stops_at_the_gap(
        tiny_models, redis_server, monkeypatch) -> None:
    """Blocks a load has put in are free until the load ends: another request's
    allocation may evict them. The chunks after such a gap are not put in (no prefix
    hit could reach them), the request counts only what it can hit, and recomputes."""
    ps, ref, llm = _chunked_hit(tiny_models("llama", 0), redis_server.url, monkeypatch, 14)
    off = llm.engine.offload
    pool = llm.engine.kv.pool
    real = off._insert_chunk
    calls, allocated = [], []
    real_allocate = pool.allocate

    def evict_first_then_insert(job, chunk):  # noqa: ANN001, ANN202
        calls.append(job.inserted)
        if len(calls) == 2:  # another request's allocation takes every free block
            pool.give_back(real_allocate(pool.num_free))
        return real(job, chunk)

    def allocate(n):  # noqa: ANN001, ANN202
        if len(calls) >= 2:
            allocated.append(n)
        return real_allocate(n)
    monkeypatch.setattr(off, "_insert_chunk", evict_first_then_insert)
    monkeypatch.setattr(pool, "allocate", allocate)
    eng = llm.engine
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    eng.add(eng.make_request(ps[0], sp, "r"))
    toks = []
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.new_token_ids
            host = o.num_host_cached_tokens
    assert toks == ref[0] and host == 0
    blocks = (len(ps[0]) - 1) // BS
    assert calls == list(range(0, blocks, 2))  # every chunk arrived and was looked at
    # after the gap no chunk took a block: the allocations after it are the request's own
    assert off.stats.load_blocks == blocks and sum(allocated) <= -(-len(ps[0]) // BS) + 1
    llm.close()


def test_the_io_worker_connects_to_redis_before_the_first_request(tiny_models,
                                                                    redis_server) -> None:
    """The worker opens its Redis connection when it starts (KVTier.warm), so the first
    hit of a fresh replica does not pay for the handshake."""
    r = redis_server.client()
    before = len(r.client_list())
    llm = _redis_only(tiny_models("llama", 0), redis_server.url)
    deadline = time.monotonic() + 10
    while len(r.client_list()) <= before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(r.client_list()) == before + 1 and llm.engine.offload.tier.stats.errors == 0
    assert llm.engine.offload.tier.stats.lookups == 0  # nothing asked yet
    llm.close()


def test_redis_down_before_the_run(tiny_models) -> None:
    from tests.servers import RedisServer

    path = tiny_models("llama", 0)
    ps = prompts(3)
    ref = hf_greedy(path, ps, MAX_TOKENS)
    dead = RedisServer()  # never started
    llm = _redis_only(path, dead.url, num_kv_blocks=24)  # small pool: evictions, write-backs
    for _ in range(2):
        assert run(llm, ps)[0] == ref
    assert llm.engine.offload.tier.stats.errors >= 1
    llm.close()


def test_redis_stopped_mid_run(tiny_models, redis_server) -> None:
    path = tiny_models("llama", 0)
    ps = prompts(4, n=6)
    ref = hf_greedy(path, ps, MAX_TOKENS)
    _populate(path, redis_server.url, ps)
    llm = _redis_only(path, redis_server.url)
    eng = llm.engine
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    toks: dict[str, list[int]] = {}
    for i, p in enumerate(ps[:3]):
        eng.add(eng.make_request(p, sp, f"r{i}"))
    for _ in range(3):
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    redis_server.stop()
    for i, p in enumerate(ps[3:], 3):
        eng.add(eng.make_request(p, sp, f"r{i}"))
    while eng.has_unfinished():
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [toks[f"r{i}"] for i in range(6)] == ref
    assert eng.offload.tier.stats.errors >= 1 and eng.offload.stats.load_blocks >= 5
    assert eng.kv.num_free_blocks == eng.num_blocks
    llm.close()


def test_corrupt_values_are_misses_and_deleted(tiny_models, redis_server) -> None:
    path = tiny_models("llama", 0)
    ps = prompts(5, n=2)
    ref = hf_greedy(path, ps, MAX_TOKENS)
    _populate(path, redis_server.url, ps)
    r = redis_server.client()
    with _redis_only(path, redis_server.url) as probe:  # find the prefix's keys in order
        probe.engine.kv.update_hashes(req := probe.engine.make_request(ps[0], SamplingParams()))
        keys = [tier_key(probe.engine.kv_fingerprint, h) for h in req.block_hashes]
    assert all(r.exists(k) for k in keys[:5])
    r.set(keys[1], r.get(keys[1])[:-10])  # truncated
    flipped = bytearray(r.get(keys[3]))
    flipped[-5] ^= 0xFF
    r.set(keys[3], bytes(flipped))  # a flipped payload byte
    llm = _redis_only(path, redis_server.url)
    toks, host = run(llm, ps[:1])
    assert toks == ref[:1] and host == [BS]  # block 0 loaded; block 1 is corrupt: recompute
    assert llm.engine.offload.stats.corrupt == 1 and not r.exists(keys[1])
    r.set(keys[1], b"garbage")  # not even a header
    fresh = _redis_only(path, redis_server.url)  # an empty device cache: it must load
    toks, host = run(fresh, ps[1:])
    assert toks == ref[1:] and host == [BS]
    assert fresh.engine.offload.stats.corrupt == 1 and not r.exists(keys[1])
    for x in (llm, fresh):
        x.close()


SECRET = "replicas-share-this"  # --kv-tier-secret in the tests below


def _prefix(path: Path, url: str, p: list[int], **kw) -> tuple[list[str], list[bytes], BlockFormat]:
    """The Redis keys and chain hashes of the prompt's blocks, in order, and the block
    format an engine with these options reads."""
    with _redis_only(path, url, **kw) as probe:
        eng = probe.engine
        eng.kv.update_hashes(req := eng.make_request(p, SamplingParams()))
        keys = [tier_key(eng.kv_fingerprint, h) for h in req.block_hashes]
        return keys, list(req.block_hashes), eng.offload.worker.fmt


def test_with_a_secret_forged_or_moved_blocks_are_misses_and_deleted(tiny_models,
                                                                      redis_server) -> None:
    """Someone who can write Redis but lacks the secret puts real KV (block 2's) under
    block 1's key: as a well-formed value with a valid checksum and no MAC, with a MAC
    of a guessed key, or as block 2's genuine value with its header's chain hash
    rewritten. Each is refused (block 1 and on recompute, the output stays exact),
    counted and deleted."""
    path = tiny_models("llama", 0)
    ps = prompts(30, n=1)
    ref = hf_greedy(path, ps, MAX_TOKENS)
    _populate(path, redis_server.url, ps, kv_tier_secret=SECRET)
    r = redis_server.client()
    keys, hashes, fmt = _prefix(path, redis_server.url, ps[0], kv_tier_secret=SECRET)
    assert all(r.exists(k) for k in keys[:5])
    block2 = r.get(keys[2])
    moved = bytearray(block2)
    moved[81:113] = hashes[1]  # the header now names block 1; the MAC still covers block 2
    payload = block2[MAC_HEADER_SIZE:]
    forgeries = {
        "no MAC": encode_block(fmt.fingerprint, hashes[1], fmt.dtype_name, fmt.shape, payload),
        "guessed key": encode_block(fmt.fingerprint, hashes[1], fmt.dtype_name, fmt.shape,
                                    payload, mac_key=hashlib.sha256(SECRET.encode()).digest()),
        "moved": moved,
    }
    for what, forged in forgeries.items():
        r.set(keys[1], bytes(forged))
        with _redis_only(path, redis_server.url, kv_tier_secret=SECRET) as llm:
            toks, host = run(llm, ps)
            assert toks == ref and host == [BS], what  # block 0 loaded, block 1 recomputed
            assert llm.engine.offload.stats.corrupt == 1 and not r.exists(keys[1]), what


def test_replicas_sharing_a_secret_hit_another_secret_or_none_misses(tiny_models,
                                                                     redis_server) -> None:
    path = tiny_models("llama", 0)
    ps = prompts(31, n=1) + prompts(32, n=1)  # two unrelated prefixes
    ref = hf_greedy(path, ps, MAX_TOKENS)
    _populate(path, redis_server.url, ps, kv_tier_secret=SECRET)
    with _redis_only(path, redis_server.url, kv_tier_secret=SECRET) as same:  # a replica
        toks, host = run(same, ps[:1])
        assert toks == ref[:1] and host[0] >= 5 * BS
        assert same.engine.offload.stats.corrupt == 0
    # another secret, or none: the values cannot be checked, so they are misses
    for i, kw in ((1, {"kv_tier_secret": "another secret"}), (0, {})):
        with _redis_only(path, redis_server.url, **kw) as other:
            toks, host = run(other, ps[i : i + 1])
            assert toks == ref[i : i + 1] and host == [0], kw
            assert other.engine.offload.stats.corrupt == 1, kw


def test_redis_without_a_secret_warns_at_start(tiny_models, redis_server, caplog) -> None:
    """The warning names the flag and what trusting Redis means; the secret itself is
    never logged."""
    path = tiny_models("llama", 0)
    caplog.set_level(logging.INFO)
    for kw, warns in (({"kv_tier": "redis", "redis_url": redis_server.url}, True),
                      ({"kv_tier": "redis", "redis_url": redis_server.url,
                        "kv_tier_secret": SECRET}, False),
                      ({"kv_tier": "memory"}, False)):
        caplog.clear()
        make_llm(path, **kw).close(flush=False)
        warned = [x for x in caplog.records if x.levelno == logging.WARNING
                  and x.name == "tidewire.kv_offload" and "--kv-tier-secret" in x.getMessage()]
        assert len(warned) == warns, kw
        if warns:
            assert "trusts whoever can write Redis" in caplog.text
        assert SECRET not in caplog.text


class EvictingTier(RedisTier):
    """A real Redis whose third key of a load is evicted after the lookup, just before
    the values are read."""

    def get_into(self, keys, bufs):  # noqa: ANN001, ANN201
        if len(keys) > 2:
            self._client.delete(keys[2])
        return super().get_into(keys, bufs)


class SlowTier(RedisTier):
    def get_into(self, keys, bufs):  # noqa: ANN001, ANN201
        time.sleep(0.6)
        return super().get_into(keys, bufs)


@pytest.mark.parametrize("tier_cls", [EvictingTier, SlowTier])
def test_evicted_between_lookup_and_load_or_too_slow(tiny_models, redis_server,
                                                     tier_cls: type) -> None:
    path = tiny_models("llama", 0)
    ps = prompts(6, n=3)
    ref = hf_greedy(path, ps, MAX_TOKENS)
    _populate(path, redis_server.url, ps)
    llm = _redis_only(path, redis_server.url)
    from engine.config import TierConfig

    off = llm.engine.offload
    off.tier = off.worker.tier = tier_cls(redis_server.url)
    off.config = TierConfig("redis", redis_server.url, 0, load_timeout=0.2)
    toks, host = run(llm, ps)
    assert toks == ref
    if tier_cls is EvictingTier:
        assert max(host) == 2 * BS and off.stats.load_blocks >= 2  # up to the evicted block
    else:
        assert host == [0, 0, 0] and off.stats.load_timeouts >= 1
    assert _buffers_back(off, engine.kv_io.LOAD_BUFFERS)
    llm.close()


def test_no_leaks_after_1000_requests_with_tier_traffic(tiny_models) -> None:
    path = tiny_models("llama", 0)
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 320) for _ in range(24)] for _ in range(30)]
    llm = make_llm(path, kv_tier="memory", kv_tier_memory=1 << 20, num_kv_blocks=40,
                   debug=False)
    eng, off = llm.engine, llm.engine.offload
    mem = off.tier
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for _ in range(20):
        ps = [rng.choice(prefixes) + [rng.randrange(3, 320) for _ in range(rng.randint(1, 9))]
              for _ in range(50)]
        outs = llm.generate(ps, sp)
        assert all(len(o.token_ids) == 2 for o in outs)
        eng.kv.check_integrity()
        assert eng.kv.num_free_blocks == eng.num_blocks
        assert mem.used <= mem.capacity
    assert not eng.scheduler.requests and not eng.scheduler.loading and not off._loads
    assert not len(eng.outputs) and not eng.runner._generators and not eng.lifecycle.parents
    assert mem.stats.hits > 100 and off.stats.written_blocks > 100  # it really cycled
    assert off.worker._free_bufs.qsize() == engine.kv_io.LOAD_BUFFERS
    # the write-dedupe set is bounded by the blocks the tier can hold (older entries are
    # surely stale), not by its 2**18 ceiling (~45 MB, which grew a soak's heap)
    value_bytes = HEADER_SIZE + off.block_bytes
    assert off.known_limit == (1 << 20) // value_bytes < 1 << 18
    assert off.stats.written_blocks > off.known_limit >= len(off._known)
    llm.close()
    assert off.worker.pending_writes == 0


async def test_socket_warm_start_frames_http_warm_and_tier_metrics(tiny_models,
                                                                   redis_server) -> None:
    from prometheus_client.parser import text_string_to_metric_families
    from websockets.asyncio.client import connect

    from engine import EngineConfig
    from engine.config import CacheConfig, TierConfig
    from service.config import ServiceConfig
    from tests.servers import http_get, run_server

    path = tiny_models("llama", 0)
    ps = prompts(8, n=1) + prompts(9, n=1)  # two unrelated prefixes
    _populate(path, redis_server.url, ps[:1])  # ps[0]'s prefix is in Redis
    config = ServiceConfig(engine=EngineConfig(
        model=str(path), dtype="float32", cache=CacheConfig(block_size=BS, num_blocks=64),
        tier=TierConfig("redis", redis_server.url)))
    with run_server(config) as s:
        async with connect(s.ws_url, subprotocols=["tidewire.v1.json"]) as ws:
            assert json.loads(await ws.recv())["type"] == "ready"
            # warm the prefix of ps[1] while "the user types"
            await ws.send(json.dumps({"type": "warm", "id": "w1", "prompt_token_ids": ps[1][:40]}))
            warmed = json.loads(await ws.recv())
            assert warmed == {"type": "warmed", "id": "w1", "prompt_tokens": 40,
                              "cached_tokens": 40, "reused_tokens": {"device": 0, "host": 0}}
            for rid, p in (("from-redis", ps[0]), ("from-warm", ps[1])):
                await ws.send(json.dumps({"type": "generate", "id": rid, "prompt_token_ids": p,
                                          "params": {"max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                     "ignore_eos": True}}))
                msgs = []
                while not msgs or msgs[-1]["type"] != "done":
                    msgs.append(json.loads(await ws.recv()))
                start, done = msgs[0], msgs[-1]
                assert start["type"] == "start" and done["status"] == "completed"
                assert [t for m in msgs if m["type"] == "delta" for t in m["token_ids"]] == \
                    hf_greedy(path, [p], MAX_TOKENS)[0]
                cached = start["cached_tokens"]
                if rid == "from-redis":
                    assert cached["host"] >= 5 * BS and done["usage"]["cached_tokens"] == cached
                else:
                    assert cached == {"device": 40, "host": 0}  # the warm put it on the device
            await ws.send(json.dumps({"type": "warm", "prompt": "text", "params": {}}))
            err = json.loads(await ws.recv())
            assert err["type"] == "error" and err["code"] == "invalid_request"
        import urllib.request

        req = urllib.request.Request(f"{s.url}/v1/warm", method="POST",
                                     data=json.dumps({"prompt": ps[1][:24]}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = json.loads(r.read())
        assert body["prompt_tokens"] == 24 and body["cached_tokens"] == 24
        assert body["reused_tokens"]["device"] == 16  # 2 blocks; the last token recomputes
        status, text = http_get(f"{s.url}/metrics")
        assert status == 200
        samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
                   for f in text_string_to_metric_families(text.decode()) for x in f.samples}
        assert samples[("tidewire_kv_tier_ops", (("op", "hits"), ("tier", "redis")))] >= 5
        assert samples[("tidewire_kv_tier_bytes", (("direction", "read"), ("tier", "redis")))] > 0
        assert samples[("tidewire_kv_tier_loads", (("what", "load_blocks"),))] >= 5
        assert samples[("tidewire_kv_tier_breaker_open", (("tier", "redis"),))] == 0
        before = len(redis_keys(redis_server))
    # the server is gone: its graceful shutdown flushed ps[1]'s blocks (never evicted)
    assert len(redis_keys(redis_server)) >= before + 5


class SlowPutTier(RedisTier):
    def put_many(self, items):  # noqa: ANN001, ANN201
        time.sleep(0.2)
        return super().put_many(items)


def test_write_queue_is_bounded_and_drops_under_backpressure(tiny_models, redis_server) -> None:

    path = tiny_models("llama", 0)
    ps = [p for s in range(10, 14) for p in prompts(s, n=3)]  # 4 prefixes: evictions
    ref = hf_greedy(path, ps, MAX_TOKENS)
    llm = _redis_only(path, redis_server.url, num_kv_blocks=24, kv_tier_write_through=True)
    off = llm.engine.offload
    off.tier = off.worker.tier = SlowPutTier(redis_server.url)
    off.worker.max_pending_writes = 6
    for i in range(0, len(ps), 3):
        assert run(llm, ps[i : i + 3])[0] == ref[i : i + 3]
        assert off.worker.pending_writes <= 6
    assert off.stats.dropped_writes > 0 and off.stats.written_blocks > 0
    llm.close(flush=False)


def test_a_tier_miss_is_admitted_without_a_loading_round(tiny_models, redis_server,
                                                         monkeypatch) -> None:
    import engine.kv_offload

    # a generous budget: this checks the logic, not how fast a loaded machine answers
    monkeypatch.setattr(engine.kv_offload, "_LOOKUP_WAIT_PER_STEP", 5.0)
    path = tiny_models("llama", 0)
    ps = prompts(20)
    llm = _redis_only(path, redis_server.url)
    eng = llm.engine
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    eng.add(eng.make_request(ps[0], sp, "miss"))
    eng.step()  # the lookup answered within the step's wait budget: a miss, no LOADING
    assert not eng.scheduler.loading and eng.offload.stats.loads == 0
    # one key asked about (the first block's): the reads of a hit say where its run ends
    assert eng.offload.tier.stats.lookups == 1 and eng.scheduler.running
    while eng.has_unfinished():
        eng.step()
    llm.close(flush=False)


def test_malloc_tuning_serves_tier_values_and_step_buffers_from_the_heap() -> None:
    """Entry points tune glibc's malloc (engine.runtime.tune_malloc) so that ~0.4 MB tier
    values and multi-MB per-step buffers (the CPU backend's logits) are reused from the
    heap: allocated and freed again and again they fault no pages in after the first
    time. (With the threshold at 1 MB, every 12 MB buffer was a fresh mapping: ~3k page
    faults each.) A fresh interpreter, so that no earlier test's heap can serve them."""
    code = textwrap.dedent("""
        import resource, numpy as np
        from engine.runtime import tune_malloc
        if not tune_malloc():
            print("skip")
            raise SystemExit
        def faults(size, n=20):
            r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(n):
                a = np.empty(size, np.uint8)
                a.fill(1)
                del a
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0
        faults(12 << 20, 1), faults(400 << 10, 1)  # the heap grows once
        print(faults(12 << 20), faults(400 << 10))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "skip":
        pytest.skip("not glibc")
    big, small = map(int, out.stdout.split())
    # 20 rounds of 12 MB are 61k pages; a few stray faults are allowed, not one a round.
    assert big < 20 and small < 20, (big, small)


def test_evicted_blocks_are_snapshotted_before_the_forward_and_shipped_after_launch(
        tiny_models) -> None:
    """An evicted block is gathered (snapshot) before the step's forward, which may
    overwrite it; its host copy and the hand-off to the I/O thread come after the
    caller's `launched` (the socket hand-off, which sockets wait for), within the same
    step; the tier then serves it: the evicting prompts' outputs and a rerun of the first
    prompt (loaded back from the tier) equal a run with no tier at all."""
    path = tiny_models("llama", 0)
    first, others = prompts(21, n=1), prompts(22, n=3) + prompts(23, n=3)
    expected = run(make_llm(path, kv_tier="none", num_kv_blocks=24), first + others + first)[0]
    llm = make_llm(path, kv_tier="memory", num_kv_blocks=24)
    eng, off = llm.engine, llm.engine.offload
    toks = run(llm, first)[0]
    pending_at_launch: list[bool] = []
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {f"e{i}": [] for i in range(len(others))}
    for i, p in enumerate(others):
        eng.add(eng.make_request(p, sp, f"e{i}"))
    while eng.has_unfinished():
        for o in eng.step(launched=lambda: pending_at_launch.append(off.captured)):
            out[o.request_id] += o.new_token_ids
        assert not off.captured  # shipped within the step
    toks += [out[f"e{i}"] for i in range(len(others))]
    assert any(pending_at_launch), "no step evicted: the pool is too large for this test"
    assert off.stats.dropped_writes == 0
    again, host = run(llm, first)
    assert host[0] > 0  # the first prompt's prefix came back from the tier
    assert toks + again == expected
    llm.close()


def test_an_engine_dropped_without_close_is_freed(tiny_models) -> None:
    """The tier's I/O worker holds the runner (weights, KV pool); dropping the LLM
    without close() must still let all of it go (else every such LLM leaks its pool)."""
    import gc
    import weakref

    llm = LLM(model=str(tiny_models("llama")), num_kv_blocks=64)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4))
    runner, worker = weakref.ref(llm.engine.runner), llm.engine.offload.worker.thread
    del llm
    deadline = time.monotonic() + 10
    while (runner() is not None or worker.is_alive()) and time.monotonic() < deadline:
        gc.collect()
        worker.join(0.05)
    assert runner() is None and not worker.is_alive()

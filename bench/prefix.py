"""`tidewire bench prefix`: what the host tier buys, measured in one run.

TTFT of a request whose prompt is a 2,000-token shared prefix plus a short suffix:
(a) cold, (b) device prefix-cache hit, (c) after a restart, loaded from Redis,
(d) after the device evicted it, loaded from the memory tier. Also the bytes/s of the
Redis loads, and the throughput cost of the host tiers on a workload with no prefix
hits (chat-64 prompts; tier none, memory and Redis in one process, in rotating order).
Once the device pool is full every allocation evicts cached blocks, which a tier then
writes: `--overhead-kv-blocks` sets the pool small enough for that to start early.

Redis: `--redis-url`, or a private redis-server started on a free port (or, with
`--redis-socket unix`, on a unix socket).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.offline import run_tidewire
from bench.workloads import chat64
from bench.ws import free_port


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="registry name, HF model directory or .gguf file (see `tidewire models`)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto: bfloat16 on a GPU or a CPU with AVX512-BF16/AMX, else float32")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="int8: the CPU's int8 KV cache, whose blocks (and tier values) are "
                        "about half the bytes of bf16")
    p.add_argument("--attention-backend", default=None, choices=["cpu", "cuda"],
                   help="default: cuda when a GPU is present")
    p.add_argument("--prefix-tokens", type=int, default=2000,
                   help="length of the shared prompt prefix")
    p.add_argument("--repeats", type=int, default=3,
                   help="TTFT measurements per case (the median is reported)")
    p.add_argument("--redis-url", default=None, help="default: start a private redis-server")
    p.add_argument("--redis-socket", default="tcp", choices=["tcp", "unix"],
                   help="the private redis-server's transport: TCP on 127.0.0.1, or a unix "
                        "socket (Redis on the replica's own host)")
    p.add_argument("--overhead-requests", type=int, default=32,
                   help="chat-64 requests per round of the no-hit overhead run")
    p.add_argument("--overhead-rounds", type=int, default=3,
                   help="rounds of the overhead run, tier settings in rotating order (the "
                        "median is reported)")
    p.add_argument("--overhead-kv-blocks", type=int, default=None,
                   help="device KV blocks of the overhead engines (default: by memory)")
    p.add_argument("--overhead-kinds", default="none,memory,redis,redis_write_through",
                   help="comma-separated tier settings to compare; the first is the baseline")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--parts", default="ttft,overhead", help="comma-separated: ttft, overhead")
    p.add_argument("--json", type=Path, default=None, help="write the results here")


class _PrivateRedis:
    def __init__(self, unix: bool = False) -> None:
        """`unix`: listen on a unix socket in a new temporary directory, no TCP port."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server not found (make install puts it there)")
        import redis  # (here: the other benchmarks run where redis-py is absent)

        self.dir = tempfile.TemporaryDirectory(prefix="tw-redis-") if unix else None
        if self.dir is not None:
            sock = Path(self.dir.name) / "redis.sock"
            self.url = f"unix://{sock}?db=0"
            listen = ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"]
        else:
            port = free_port()
            self.url = f"redis://127.0.0.1:{port}/0"
            listen = ["--port", str(port), "--bind", "127.0.0.1"]
        self.proc = subprocess.Popen(
            [exe, *listen, "--save", "", "--appendonly", "no",
             "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(200):  # until it answers PING
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        client.close()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        if self.dir is not None:
            self.dir.cleanup()


def _llm(a: argparse.Namespace, **kw: Any) -> Any:
    """An engine as a replica has it once /ready: loaded and warmed up (the server's
    engine thread runs LLMEngine.warm_up before it reports ready)."""
    from engine import LLM

    llm = LLM(model=a.model, dtype=a.dtype, max_num_batched_tokens=512,
              attention_backend=a.attention_backend, kv_cache_dtype=a.kv_cache_dtype, **kw)
    llm.engine.warm_up()
    return llm


def ttft(llm: Any, prompt: list[int]) -> tuple[float, dict[str, int]]:
    """Seconds from add to the first token, and where the cached prompt tokens came from."""
    from engine import SamplingParams

    eng = llm.engine
    rid = f"ttft-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    eng.add(eng.make_request(prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                    ignore_eos=True), rid))
    first = None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid and o.new_token_ids and first is None:
                first = time.perf_counter() - t0
                cached = {"device": o.num_cached_tokens - o.num_host_cached_tokens,
                          "host": o.num_host_cached_tokens}
    assert first is not None
    return first, cached


def _prompts(a: argparse.Namespace, vocab: int, salt: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(a.seed * 1000 + salt)
    prefix = [rng.randrange(100, vocab) for _ in range(a.prefix_tokens)]
    suffixes = [[rng.randrange(100, vocab) for _ in range(16)] for _ in range(4)]
    return prefix, [prefix + s for s in suffixes]


def measure_ttft(a: argparse.Namespace, url: str) -> dict[str, Any]:
    cold, device, redis, memory, where, rates = [], [], [], [], {}, []
    for rep in range(a.repeats):
        # (a) cold and (b) device hit, on an engine that writes to Redis at close
        llm = _llm(a, kv_tier="redis", redis_url=url, kv_tier_memory=0)
        vocab = llm.engine.arch.vocab_size
        prefix, ps = _prompts(a, vocab, rep)
        t, where["cold"] = ttft(llm, ps[0])
        cold.append(t)
        t, where["device"] = ttft(llm, ps[1])
        device.append(t)
        llm.close()  # graceful shutdown: cached blocks flushed to Redis
        # (c) a restart: a new engine, empty device cache, Redis only (no memory tier)
        llm = _llm(a, kv_tier="redis", redis_url=url, kv_tier_memory=0)
        t, where["redis"] = ttft(llm, ps[2])
        redis.append(t)
        st = llm.engine.offload.stats
        rates.append(st.load_bytes / st.load_seconds if st.load_seconds else 0.0)
        llm.close(flush=False)
        # (d) the memory tier: a pool that holds one prefix; a second prefix evicts it
        blocks = -(-(a.prefix_tokens + 64) // 16) + 8
        llm = _llm(a, kv_tier="memory", num_kv_blocks=blocks, max_model_len=a.prefix_tokens + 64)
        _, other = _prompts(a, vocab, 10_000 + rep)
        ttft(llm, ps[0])
        ttft(llm, other[0])  # evicts ps[0]'s blocks to the memory tier
        t, where["memory"] = ttft(llm, ps[3])
        memory.append(t)
        llm.close(flush=False)
    med = {k: statistics.median(v) for k, v in
           (("cold", cold), ("device", device), ("redis", redis), ("memory", memory))}
    return {"ttft_s": med, "runs_s": {"cold": cold, "device": device, "redis": redis,
                                      "memory": memory},
            "speedup_vs_cold": {k: med["cold"] / med[k] for k in ("device", "redis", "memory")},
            "cached_tokens": where, "redis_load_bytes_per_s": statistics.median(rates)}


def measure_overhead(a: argparse.Namespace, url: str) -> dict[str, Any]:
    """Throughput with no prefix hits: tier none vs memory vs redis (write-back, the
    default) vs redis with write-through (every prompt block written: the most traffic),
    one engine each in this process, in rotating order over the rounds, medians. Rounds
    after the pool fills also pay for writing what it evicts."""
    settings = {"none": dict(kv_tier="none"), "memory": dict(kv_tier="memory"),
                "redis": dict(kv_tier="redis", redis_url=url),
                "redis_write_through": dict(kv_tier="redis", redis_url=url,
                                            kv_tier_write_through=True)}
    kinds = tuple(a.overhead_kinds.split(","))
    if not kinds or any(k not in settings for k in kinds):
        raise SystemExit(f"--overhead-kinds: a comma-separated subset of {', '.join(settings)}")
    blocks = {"num_kv_blocks": a.overhead_kv_blocks} if a.overhead_kv_blocks else {}
    llms = {k: _llm(a, **settings[k], **blocks) for k in kinds}
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    vocab = llms[kinds[0]].engine.arch.vocab_size
    for llm in llms.values():  # one-time warm-ups (oneDNN kernels, page faults) first
        run_tidewire(llm, chat64(vocab, 4, seed=a.seed + 99))
    for rnd in range(a.overhead_rounds):
        # fresh prompts each round: nothing can hit, on the device or in a tier
        work = chat64(vocab, a.overhead_requests, seed=a.seed + 100 + rnd)
        first = rnd % len(kinds)
        for kind in kinds[first:] + kinds[:first]:
            runs[kind].append(run_tidewire(llms[kind], work)["output_tok_s"])
    traffic = {k: vars(llms[k].engine.offload.stats).copy() for k in kinds
               if llms[k].engine.offload is not None}
    for llm in llms.values():
        llm.close(flush=False)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"output_tok_s": med, "runs": runs, "traffic": traffic, "baseline": kinds[0],
            "loss": {k: 1 - med[k] / med[kinds[0]] for k in kinds[1:]}}


def main(a: argparse.Namespace) -> int:
    import torch

    a.attention_backend = a.attention_backend or ("cuda" if torch.cuda.is_available() else "cpu")
    parts = a.parts.split(",")
    needs_redis = "ttft" in parts or ("overhead" in parts and "redis" in a.overhead_kinds)
    server = _PrivateRedis(unix=a.redis_socket == "unix") if needs_redis and not a.redis_url \
        else None
    url = a.redis_url or (server.url if server is not None else "")
    try:
        result: dict[str, Any] = {"model": a.model, "dtype": a.dtype,
                                  "kv_cache_dtype": a.kv_cache_dtype,
                                  "attention_backend": a.attention_backend,
                                  "prefix_tokens": a.prefix_tokens}
        if "ttft" in parts:
            result["ttft"] = measure_ttft(a, url)
        if "overhead" in parts:
            result["no_hit_overhead"] = measure_overhead(a, url)
    finally:
        if server is not None:
            server.close()
    _report(result)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2))
    return 0


def _report(result: dict[str, Any]) -> None:
    if "ttft" in result:
        t = result["ttft"]
        for k in ("cold", "device", "redis", "memory"):
            s = t["speedup_vs_cold"].get(k)
            print(f"TTFT {k:7s} {t['ttft_s'][k] * 1000:9.1f} ms"
                  + (f"   {s:6.1f}x faster than cold" if s else "")
                  + f"   cached {t['cached_tokens'][k]}")
        print(f"Redis loads: {t['redis_load_bytes_per_s'] / 1e6:.0f} MB/s")
    if "no_hit_overhead" in result:
        o = result["no_hit_overhead"]
        base = o["baseline"]
        print(f"no-hit workload: tier {base} {o['output_tok_s'][base]:.1f} tok/s; " + "; ".join(
            f"{k} {o['output_tok_s'][k]:.1f} tok/s (loss {o['loss'][k] * 100:.1f}%, "
            f"{o['traffic'][k]['written_blocks'] if k in o['traffic'] else 0} blocks written)"
            for k in o["loss"]))

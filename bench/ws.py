"""`tidewire bench ws`: the chat-64 workload over 64 concurrent WebSocket streams to a
`tidewire serve` process, and in the same run the engine alone (offline API) on the
same requests. Reports socket tok/s / engine tok/s and the sampled-to-written latency of
deltas (from the server's tidewire_delta_delivery_seconds histogram, scraped after the
warm-up and after each round: each round's quantiles are of its own deltas)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.workloads import BenchRequest, chat64

# bench.offline (torch, the engine) is imported where it is used: the load-generator
# processes (here and in bench.load) import this module, and torch would add ~200 MB to each

DELIVERY = "tidewire_delta_delivery_seconds"  # the server's sampled-to-written histogram


def add_args(p: argparse.ArgumentParser) -> None:
    from bench.offline import add_sampling_args

    p.add_argument("--model", default="smollm2-135m",
                   help="registry name, HF model directory or .gguf file (see `tidewire models`)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto: bfloat16 on a GPU or a CPU with AVX512-BF16/AMX, else float32")
    p.add_argument("--attention-backend", default=None, choices=["cpu", "cuda"],
                   help="default: cuda where a GPU is present, else cpu")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--kv-tier", default="memory", choices=["none", "memory"],
                   help="the host tier of both engines (server and engine alone)")
    p.add_argument("--no-async-output", dest="async_output", action="store_false",
                   help="the server sends a step's outputs before the next step starts")
    p.add_argument("--num-requests", type=int, default=64,
                   help="requests (and sockets) per round (other values change chat-64)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="sequences one engine step may batch, in both engines")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens one engine step may process, in both engines")
    p.add_argument("--protocol", default="tidewire.v1.msgpack",
                   choices=["tidewire.v1.msgpack", "tidewire.v1.json"],
                   help="the WebSocket subprotocol the clients speak")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the first round's workload (round i uses seed + i)")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternate engine alone / sockets this many times, each round on "
                        "fresh chat-64 requests (seed + round); the ratio is the median "
                        "round's (a GPU runs chat-64 in under a second: one round is noisy)")
    p.add_argument("--client-procs", type=int, default=1,
                   help="load-generator processes the 64 sockets are spread over")
    p.add_argument("--client-sched", default="normal", choices=["normal", "batch"],
                   help="the load generator's Linux scheduling policy while it streams. "
                        "batch (SCHED_BATCH): a woken client does not preempt the running "
                        "task, i.e. the server's event loop in the middle of a fan-out, "
                        "which a co-located client on a small machine otherwise does "
                        "(remote clients never do)")
    add_sampling_args(p, "the measured rounds' tokens, in both engines")
    p.add_argument("--json", type=Path, default=None, help="write the results here")


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server started next. Drawn below the
    kernel's ephemeral range (`ip_local_port_range`), not by binding port 0: a port from
    that range is also one any outgoing connection can take as its local port before the
    server meant to have it binds, and a load generator opening dozens of connections a
    second beside a starting server (the test suite's background soak) made that a real
    race. Never the same port twice in one process."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            top = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        top = 32768
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.randrange(max(1024, top - 12000), top)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # that range is full: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _start_server(a: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", a.model, "--dtype", a.dtype,
           "--port", str(port), "--max-num-seqs", str(a.max_num_seqs),
           "--max-num-batched-tokens", str(a.max_num_batched_tokens),
           "--attention-backend", a.attention_backend, "--kv-tier", a.kv_tier] \
        + (["--enforce-eager"] if a.enforce_eager else []) \
        + ([] if a.async_output else ["--no-async-output"])
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for _ in range(1200):
        try:
            # (and still running: not another server that got the port first)
            if json.loads(_get(f"http://127.0.0.1:{port}/ready"))["ready"] and proc.poll() is None:
                return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    proc.kill()
    proc.wait()
    log.seek(0)
    tail = log.read().decode(errors="replace")[-3000:]
    raise RuntimeError(f"server did not start; its stderr ends:\n{tail}")


def _codec(proto: str) -> tuple[Any, Any]:
    import msgpack

    if proto.endswith("msgpack"):
        return msgpack.packb, msgpack.unpackb
    return json.dumps, json.loads


async def _connect(url: str, proto: str, n: int) -> list[Any]:
    from websockets.asyncio.client import connect

    conns = [await connect(url, subprotocols=[proto], max_size=None) for _ in range(n)]
    for ws in conns:
        await ws.recv()  # ready
    return conns


async def _stream(ws: Any, proto: str, rid: str, r: BenchRequest, sampling: dict) -> int:
    enc, dec = _codec(proto)
    await ws.send(enc({"type": "generate", "id": rid, "prompt_token_ids": r.prompt_token_ids,
                       "params": {"max_tokens": r.max_tokens, "ignore_eos": True,
                                  **sampling}}))
    n = 0
    while True:
        m = dec(await ws.recv())
        if m["type"] == "delta":
            n += len(m["token_ids"])
        elif m["type"] in ("done", "error"):
            assert m["type"] == "done" and m["status"] == "completed", m
            return n


async def _run_streams(url: str, proto: str, work: list[BenchRequest], first: int,
                       start: Any = None, sampling: dict | None = None) -> int:
    """One socket per request (ids r{first}...); `start()` runs once all are connected."""
    conns = await _connect(url, proto, len(work))
    if start is not None:
        start()
    sampling = {"temperature": 0.0, **(sampling or {})}
    counts = await asyncio.gather(*(_stream(ws, proto, f"r{first}-{i}", r, sampling)
                                    for i, (ws, r) in enumerate(zip(conns, work))))
    for ws in conns:
        await ws.close()
    return sum(counts)


@contextlib.contextmanager
def _client_policy(sched: str) -> Iterator[None]:
    """Run the calling thread (and the threads it starts) under `sched`: "normal" leaves
    it as it is; "batch" is SCHED_BATCH, restored afterwards."""
    if sched == "normal":
        yield
        return
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    try:
        yield
    finally:
        os.sched_setscheduler(0, *before)


def _client_process(url: str, proto: str, work: list[BenchRequest], first: int, sched: str,
                    sampling: dict | None, ready: Any, go: Any, results: Any) -> None:
    """A load-generator process: connect, wait for the common start, stream, report."""
    def start() -> None:
        ready.wait()
        go.wait()

    with _client_policy(sched):
        results.put(asyncio.run(_run_streams(url, proto, work, first, start, sampling)))


def _drive(url: str, proto: str, work: list[BenchRequest], procs: int = 1,
           sched: str = "normal", sampling: dict | None = None) -> dict[str, Any]:
    """Output tokens/s of the streams from the moment every socket is connected. With
    procs > 1 the sockets are spread over that many client processes (one Python client
    reading ~10k deltas/s can be the bottleneck next to a GPU engine); `sched`: their
    scheduling policy (see --client-sched); `sampling`: SamplingParams fields (default
    greedy)."""
    if procs <= 1:
        t: list[float] = []
        with _client_policy(sched):
            n = asyncio.run(_run_streams(url, proto, work, 0,
                                         lambda: t.append(time.perf_counter()), sampling))
        dt = time.perf_counter() - t[0]
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        ready, go, results = ctx.Barrier(procs + 1), ctx.Event(), ctx.Queue()
        parts = [list(range(i, len(work), procs)) for i in range(procs)]
        workers = [ctx.Process(target=_client_process,
                               args=(url, proto, [work[j] for j in part], part[0] if part else 0,
                                     sched, sampling, ready, go, results))
                   for part in parts]
        for w in workers:
            w.start()
        ready.wait()
        t0 = time.perf_counter()
        go.set()
        n = sum(results.get(timeout=600) for _ in workers)
        dt = time.perf_counter() - t0
        for w in workers:
            w.join()
    assert n == sum(r.max_tokens for r in work)
    return {"seconds": dt, "output_tokens": n, "output_tok_s": n / dt, "client_procs": procs,
            "client_sched": sched}


def histogram_buckets(metrics_text: str, name: str) -> list[tuple[float, float]]:
    """A Prometheus histogram's cumulative buckets, (upper edge, count), by edge."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets = []
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == f"{name}_bucket":
                buckets.append((float(s.labels["le"]), s.value))
    return sorted(buckets)


def histogram_quantiles(metrics_text: str, name: str, qs: tuple[float, ...],
                        since: str | None = None) -> dict[str, float]:
    """Quantiles of a Prometheus histogram, linearly interpolated inside buckets; with
    `since` (an earlier scrape of the same server), of what was observed after it."""
    buckets = histogram_buckets(metrics_text, name)
    if since is not None:
        earlier = dict(histogram_buckets(since, name))
        buckets = [(edge, count - earlier.get(edge, 0.0)) for edge, count in buckets]
    total = buckets[-1][1] if buckets else 0.0
    out: dict[str, float] = {}
    for q in qs:
        target, lo_edge, lo_count = q * total, 0.0, 0.0
        for edge, count in buckets:
            if count >= target:
                frac = (target - lo_count) / max(count - lo_count, 1e-9)
                out[f"p{int(q * 100)}"] = lo_edge + frac * ((edge if edge != float("inf")
                                                             else lo_edge) - lo_edge)
                break
            lo_edge, lo_count = edge, count
    out["count"] = total
    return out


def _delivery_ms(metrics_text: str, since: str) -> dict[str, float]:
    lat = histogram_quantiles(metrics_text, DELIVERY, (0.5, 0.99), since)
    return {k: (v if k == "count" else v * 1000) for k, v in lat.items()}


def main(a: argparse.Namespace) -> int:
    import torch

    from bench.offline import run_tidewire, sampling_args
    from engine import LLM

    a.attention_backend = a.attention_backend or ("cuda" if torch.cuda.is_available() else "cpu")
    llm = LLM(model=a.model, dtype=a.dtype, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens,
              attention_backend=a.attention_backend, enforce_eager=a.enforce_eager,
              kv_tier=a.kv_tier)
    vocab = llm.engine.arch.vocab_size
    sampling = sampling_args(a)
    warm = chat64(vocab, 4, a.seed - 1)
    run_tidewire(llm, warm)
    result: dict[str, Any] = {"workload": "chat-64", "dtype": llm.engine.dtype_name,
                              "protocol": a.protocol, "attention_backend": a.attention_backend,
                              "enforce_eager": a.enforce_eager, "async_output": a.async_output,
                              "kv_tier": a.kv_tier, "client_sched": a.client_sched,
                              "sampling": sampling,
                              "rounds": []}
    port = free_port()
    proc = _start_server(a, port)  # the engine stays loaded here: the two runs alternate
    try:
        url = f"ws://127.0.0.1:{port}/v1/ws"
        _drive(url, a.protocol, warm)
        start = last = _get(f"http://127.0.0.1:{port}/metrics")  # after the warm-up
        for i in range(a.rounds):
            work = chat64(vocab, a.num_requests, a.seed + i)
            rnd = {"engine": run_tidewire(llm, work, sampling)}
            rnd["websocket"] = _drive(url, a.protocol, work, a.client_procs, a.client_sched,
                                      sampling)
            rnd["ratio"] = rnd["websocket"]["output_tok_s"] / rnd["engine"]["output_tok_s"]
            metrics = _get(f"http://127.0.0.1:{port}/metrics")
            rnd["delivery_ms"], last = _delivery_ms(metrics, last), metrics
            result["rounds"].append(rnd)
            d = rnd["delivery_ms"]
            print(f"round {i + 1}: engine alone {rnd['engine']['output_tok_s']:8.1f}, "
                  f"websocket x{len(work)} {rnd['websocket']['output_tok_s']:8.1f} output "
                  f"tok/s, ratio {rnd['ratio']:.3f}; delta p50 {d['p50']:.3f} ms, "
                  f"p99 {d['p99']:.3f} ms")
    finally:
        proc.terminate()
        proc.wait(30)
    result["delivery_ms"] = _delivery_ms(last, start)  # every round's deltas
    rounds = sorted(result["rounds"], key=lambda r: r["ratio"])
    mid = rounds[(len(rounds) - 1) // 2]  # the median round (the lower one of an even count)
    result.update(engine=mid["engine"], websocket=mid["websocket"], ratio=mid["ratio"])
    print(f"engine alone   {result['engine']['output_tok_s']:8.1f} output tok/s")
    print(f"websocket x{a.num_requests} {result['websocket']['output_tok_s']:8.1f} output tok/s")
    print(f"ratio          {result['ratio']:8.3f}" + (" (median round)" if a.rounds > 1 else ""))
    print("sampled->written delta latency: "
          + ", ".join(f"{k}={v:.3f} ms" for k, v in result["delivery_ms"].items()
                    if k != "count")
          + f" ({result['delivery_ms']['count']:.0f} deltas)")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2))
    return 0

"""`tidewire bench load`: how much a server holds and what its clients see under a mixed
load, from load-generator processes apart from the server's.

Each client process (`--clients`) opens its share of `--sockets` WebSocket connections
and `--sse` OpenAI streaming requests (the official openai SDK). Every socket carries
`--streams` multiplexed streams and plays one role, drawn by `--mix`:

  stream    reads every delta to its `done`
  cancel    cancels its streams after their first delta
  abandon   drops the connection after the first delta and never comes back
  slow      sleeps `--slow-ms` before reading each frame
  resume    drops the connection after the first delta, reconnects and resumes

All sockets connect first; their requests go out together, so at the peak every socket
has a live (queued or streaming) request. With `--duration`, each socket starts again
when it ends, until the time is up (the soak). The run reports sockets held, outcomes by
kind and error code, TTFT and inter-delta gaps (client side), the server's
sampled-to-written delta latency, its RSS and open fds over time, and whether every KV
block is back in the pool at the end; `--json` writes it all, `--plot` draws the
timeline. Without `--url` it starts `tidewire serve` itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.ws import _start_server, free_port, histogram_quantiles

ROLES = ("stream", "cancel", "abandon", "slow", "resume")
# error codes that refuse a generate at admission (no `done` follows)
REFUSALS = frozenset({"too_many_inflight", "overloaded", "rate_limited", "invalid_request",
                      "context_length_exceeded", "duplicate_id", "message_too_big"})
DELIVERY = "tidewire_delta_delivery_seconds"
SSE_DELIVERY = "tidewire_sse_chunk_delivery_seconds"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None,
                   help="a running server's base URL (http://host:port); default: start "
                        "`tidewire serve` on a free port with the flags below")
    p.add_argument("--api-key", default=None, help="Bearer key for --url")
    p.add_argument("--model", default="smollm2-135m", help="the started server's model")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="the started server's weights (auto: bfloat16 where the CPU has "
                        "AVX512-BF16/AMX, else float32)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the started server's batch")
    p.add_argument("--kv-tier", default="memory", choices=["memory", "none"],
                   help="the started server's host tier (its size: TIDEWIRE_KV_TIER_MEMORY_GB; "
                        "a filling tier is RSS growth up to that size, not a leak)")
    p.add_argument("--sockets", type=int, default=1000, help="WebSocket connections")
    p.add_argument("--streams", type=int, default=1, help="streams multiplexed per socket")
    p.add_argument("--sse", type=int, default=16, help="concurrent OpenAI SSE streams")
    p.add_argument("--clients", type=int, default=4, help="load-generator processes")
    p.add_argument("--mix", default="stream=0.7,cancel=0.1,abandon=0.05,slow=0.1,resume=0.05",
                   help="share of sockets per role (normalized)")
    p.add_argument("--prompt-tokens", default="8-64", help="prompt length range, token ids")
    p.add_argument("--max-token-id", type=int, default=1000,
                   help="prompt token ids are drawn below this (and above 10)")
    p.add_argument("--max-tokens", default="8-32", help="output length range (EOS ignored)")
    p.add_argument("--slow-ms", type=float, default=50.0, help="a slow reader's pause per frame")
    p.add_argument("--duration", type=float, default=0.0,
                   help="seconds to keep every socket busy (each starts again when it ends); "
                        "0: one request round per socket")
    p.add_argument("--sample-every", type=float, default=1.0,
                   help="seconds between samples of the timeline (server RSS, fds, sockets)")
    p.add_argument("--warmup", type=float, default=0.2,
                   help="share of the run before the RSS baseline of the drift figure")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the socket roles and of each client process's prompts and lengths")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, help="PNG timeline (matplotlib)")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        role, _, share = item.partition("=")
        if role not in ROLES:
            raise ValueError(f"--mix: unknown role {role!r} (one of {', '.join(ROLES)})")
        mix[role] = float(share)
    total = sum(mix.values())
    if total <= 0:
        raise ValueError("--mix: the shares must add up to more than 0")
    return {r: s / total for r, s in mix.items()}


def assign_roles(n: int, mix: dict[str, float], seed: int) -> list[str]:
    """Exactly round(n * share) sockets per role (the rest `stream`), shuffled."""
    roles: list[str] = []
    for role, share in mix.items():
        if role != "stream":
            roles += [role] * int(round(n * share))
    roles = roles[:n] + ["stream"] * max(0, n - len(roles))
    random.Random(seed).shuffle(roles)
    return roles


# -- one client process ----------------------------------------------------------------------


class Tally:
    """What one process saw; summed over processes by the coordinator."""

    def __init__(self) -> None:
        self.outcomes: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.tokens = 0
        self.connect_failures = 0
        self.examples: dict[str, str] = {}  # code -> the first message of that code

    def count(self, what: str, n: int = 1) -> None:
        self.outcomes[what] = self.outcomes.get(what, 0) + n

    def as_dict(self) -> dict[str, Any]:
        return dict(outcomes=self.outcomes, errors=self.errors, ttft=self.ttft, gaps=self.gaps,
                    tokens=self.tokens, connect_failures=self.connect_failures,
                    examples=self.examples)


class Client:
    def __init__(self, cfg: dict[str, Any], live: Any, idx: int) -> None:
        self.cfg, self.live, self.idx = cfg, live, idx
        self.tally = Tally()
        self.rng = random.Random(cfg["seed"] * 1000 + idx)
        self.deadline = 0.0
        # a thousand handshakes at once would time out on a 2-core server: a few dozen
        # at a time per process
        self.connect_slots = asyncio.Semaphore(32)
        self.open_sockets = 0
        self.live_streams = 0

    def _publish(self) -> None:
        # shared counters the coordinator samples: [open sockets, live streams, tokens]
        self.live[3 * self.idx] = self.open_sockets
        self.live[3 * self.idx + 1] = self.live_streams
        self.live[3 * self.idx + 2] = self.tally.tokens

    def _request(self) -> dict[str, Any]:
        lo, hi = self.cfg["prompt_tokens"]
        mlo, mhi = self.cfg["max_tokens"]
        vocab = self.cfg["vocab"]
        return {"prompt_token_ids": [self.rng.randrange(10, vocab) for _ in
                                     range(self.rng.randint(lo, hi))],
                "params": {"max_tokens": self.rng.randint(mlo, mhi), "ignore_eos": True,
                           "temperature": 0.0}}

    async def _connect(self) -> Any:
        from websockets.asyncio.client import connect

        headers = {"Authorization": f"Bearer {self.cfg['api_key']}"} if self.cfg["api_key"] else {}
        async with self.connect_slots:
            ws = await connect(self.cfg["ws_url"], subprotocols=["tidewire.v1.msgpack"],
                               additional_headers=headers, max_size=None, open_timeout=60,
                               ping_interval=None)
            ready = _dec(await ws.recv())
        assert ready["type"] == "ready", ready
        return ws, ready["session_id"]

    async def socket(self, role: str, n: int, go: asyncio.Event) -> None:
        """One socket's life: connect, wait for `go`, then its role's rounds."""
        try:
            ws, session = await self._connect()
        except Exception:
            self.tally.connect_failures += 1
            return
        self.open_sockets += 1
        self._publish()
        await go.wait()
        first = True
        try:
            while first or time.monotonic() < self.deadline:
                first = False
                ws, session = await self._round(ws, session, role, n)
                if ws is None:
                    if time.monotonic() >= self.deadline:
                        return
                    ws, session = await self._connect()
                    self.open_sockets += 1
        except Exception as e:  # a close or a protocol surprise: counted, never hidden
            self.tally.count(f"socket_error:{type(e).__name__}")
        finally:
            if ws is not None:
                self.open_sockets -= 1
                self._publish()
                await ws.close()

    async def _round(self, ws: Any, session: str, role: str, n: int) -> tuple[Any, str]:
        """n streams on `ws` played as `role`; returns the socket to go on with (None
        when it was dropped for good)."""
        ids = [f"c{self.idx}-{self.rng.getrandbits(48):x}" for _ in range(n)]
        sent: dict[str, float] = {}
        for rid in ids:
            await ws.send(_enc({"type": "generate", "id": rid, **self._request()}))
            sent[rid] = time.monotonic()
        self.live_streams += n
        self._publish()
        last: dict[str, float] = {}
        seqs: dict[str, int] = {}
        pending = set(ids)
        dropped = False
        try:
            while pending:
                if role == "slow":
                    await asyncio.sleep(self.cfg["slow_ms"] / 1000)
                m = _dec(await asyncio.wait_for(ws.recv(), 300))
                rid = m.get("id")
                kind = m["type"]
                if kind == "delta":
                    now = time.monotonic()
                    if rid not in last:
                        self.tally.ttft.append(now - sent[rid])
                    else:
                        self.tally.gaps.append(now - last[rid])
                    last[rid] = now
                    seqs[rid] = m["seq"]
                    self.tally.tokens += len(m["token_ids"])
                    if role == "cancel" and seqs[rid] == 1:
                        await ws.send(_enc({"type": "cancel", "id": rid}))
                    if role in ("abandon", "resume") and len(seqs) == len(ids):
                        dropped = True
                        break
                elif kind == "done":
                    pending.discard(rid)
                    self.tally.count(m["status"])
                elif kind == "error":
                    self._error(m, role, rid in pending and rid not in last)
                    if m["code"] in REFUSALS and rid in pending and rid not in last:
                        pending.discard(rid)  # refused at admission: no done follows
        finally:
            self._publish()
        if not dropped:
            self.live_streams -= n
            self._publish()
            return ws, session
        # the drop: close without a cancel; its requests are parked server-side
        await ws.close()
        self.open_sockets -= 1
        if role == "abandon":
            self.tally.count("abandoned", len(pending))
            self.live_streams -= n
            self._publish()
            return None, session
        ws, new_session = await self._connect()
        self.open_sockets += 1
        for rid in list(pending):
            await ws.send(_enc({"type": "resume", "id": rid, "after_seq": seqs.get(rid, 0),
                                "session_id": session}))
        while pending:
            m = _dec(await asyncio.wait_for(ws.recv(), 300))
            rid, kind = m.get("id"), m["type"]
            if kind == "delta":
                self.tally.tokens += len(m["token_ids"])
            elif kind == "done":
                pending.discard(rid)
                self.tally.count("resumed" if m["status"] == "completed" else m["status"])
            elif kind == "error":
                self._error(m, role, False)
                if m["code"] in REFUSALS or m["code"] == "invalid_request":
                    pending.discard(rid)  # the resume was refused: no done follows
        self.live_streams -= n
        self._publish()
        return ws, new_session

    def _error(self, m: dict[str, Any], role: str, refused: bool) -> None:
        code = m["code"]
        if role == "cancel" and code == "unknown_id":
            self.tally.count("cancel_after_done")  # the stream ended before the cancel
            return
        self.tally.errors[code] = self.tally.errors.get(code, 0) + 1
        self.tally.examples.setdefault(code, str(m.get("message", ""))[:200])

    async def sse(self, go: asyncio.Event, client: Any) -> None:
        await go.wait()
        first = True
        while first or time.monotonic() < self.deadline:
            first = False
            req = self._request()
            t0 = time.monotonic()
            seen = None
            try:
                self.live_streams += 1
                stream = await client.completions.create(
                    model=self.cfg["model_name"], prompt=req["prompt_token_ids"], stream=True,
                    max_tokens=req["params"]["max_tokens"], temperature=0.0,
                    extra_body={"ignore_eos": True})
                async for chunk in stream:
                    now = time.monotonic()
                    if chunk.choices and chunk.choices[0].text:
                        if seen is None:
                            self.tally.ttft.append(now - t0)
                        else:
                            self.tally.gaps.append(now - seen)
                        seen = now
                        self.tally.tokens += 1
                self.tally.count("sse_completed")
            except Exception as e:
                code = getattr(getattr(e, "body", None) or {}, "get", lambda *_: None)("code")
                self.tally.errors[f"sse:{code or type(e).__name__}"] = \
                    self.tally.errors.get(f"sse:{code or type(e).__name__}", 0) + 1
            finally:
                self.live_streams -= 1
                self._publish()


async def _client_main(cfg: dict[str, Any], plan: list[str], sse: int, idx: int, live: Any,
                       ready: Any, go_evt: Any) -> dict[str, Any]:
    import openai

    c = Client(cfg, live, idx)
    go = asyncio.Event()

    oa = openai.AsyncOpenAI(base_url=cfg["http_url"] + "/v1", api_key=cfg["api_key"] or "x",
                            max_retries=0, timeout=600.0)
    tasks = [asyncio.create_task(c.socket(role, cfg["streams"], go)) for role in plan]
    tasks += [asyncio.create_task(c.sse(go, oa)) for _ in range(sse)]
    while c.open_sockets + c.tally.connect_failures < len(plan):
        await asyncio.sleep(0.05)
    await asyncio.get_running_loop().run_in_executor(None, ready.wait)
    await asyncio.get_running_loop().run_in_executor(None, go_evt.wait)
    c.deadline = time.monotonic() + cfg["duration"]
    go.set()
    await asyncio.gather(*tasks)
    await oa.close()
    return c.tally.as_dict()


def _client_process(cfg: dict[str, Any], plan: list[str], sse: int, idx: int, live: Any,
                    ready: Any, go: Any, results: Any) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    results.put((idx, asyncio.run(_client_main(cfg, plan, sse, idx, live, ready, go))))


def _enc(m: dict[str, Any]) -> bytes:
    import msgpack

    return msgpack.packb(m)


def _dec(b: bytes | str) -> dict[str, Any]:
    import msgpack

    return msgpack.unpackb(b) if isinstance(b, bytes) else json.loads(b)


# -- the coordinator -----------------------------------------------------------------------


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _server_sample(http_url: str, headers: dict[str, str]) -> dict[str, float | None]:
    req = urllib.request.Request(http_url + "/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    return {"rss_mb": (_metric(text, "process_resident_memory_bytes") or 0) / 2**20,
            "fds": _metric(text, "process_open_fds"),
            "running": _metric(text, "tidewire_requests_running"),
            "waiting": _metric(text, "tidewire_requests_waiting"),
            "kv_usage": _metric(text, "tidewire_kv_cache_usage_ratio"),
            "parked": _metric(text, "tidewire_websocket_parked_requests"),
            "connections": _metric(text, "tidewire_websocket_connections"),
            "heap_in_use_mb": (_metric(text, 'tidewire_malloc_bytes{kind="in_use"}') or 0) / 2**20,
            "heap_free_mb": (_metric(text, 'tidewire_malloc_bytes{kind="free"}') or 0) / 2**20,
            "_text": text}


def _quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "count": 0}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"p50": pick(0.5) * 1000, "p99": pick(0.99) * 1000, "max": s[-1] * 1000,
            "count": len(s)}


def run(a: argparse.Namespace) -> dict[str, Any]:
    mix = parse_mix(a.mix)
    proc = None
    if a.url is None:
        port = free_port()
        ns = argparse.Namespace(model=a.model, dtype=a.dtype, max_num_seqs=a.max_num_seqs,
                                max_num_batched_tokens=512, attention_backend="cpu",
                                kv_tier=a.kv_tier, enforce_eager=False, async_output=True)
        proc = _start_server(ns, port)
        http_url = f"http://127.0.0.1:{port}"
    else:
        http_url = a.url.rstrip("/")
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    try:
        models = json.loads(urllib.request.urlopen(urllib.request.Request(
            http_url + "/v1/models", headers=headers), timeout=30).read())
        model_name = models["data"][0]["id"]
        cfg = {"ws_url": http_url.replace("http", "ws", 1) + "/v1/ws", "http_url": http_url,
               "api_key": a.api_key, "model_name": model_name, "vocab": a.max_token_id,
               "prompt_tokens": _range(a.prompt_tokens), "max_tokens": _range(a.max_tokens),
               "slow_ms": a.slow_ms, "duration": a.duration, "streams": a.streams,
               "seed": a.seed}
        roles = assign_roles(a.sockets, mix, a.seed)
        ctx = mp.get_context("spawn")
        n = max(1, a.clients)
        live = ctx.Array("q", 3 * n, lock=False)
        ready, go, results = ctx.Barrier(n + 1), ctx.Event(), ctx.Queue()
        workers = [ctx.Process(target=_client_process,
                               args=(cfg, roles[i::n], a.sse // n + (i < a.sse % n), i, live,
                                     ready, go, results), daemon=True)
                   for i in range(n)]
        before = _server_sample(http_url, headers)
        for w in workers:
            w.start()
        ready.wait(timeout=600)
        connected = sum(live[3 * i] for i in range(n))
        t0 = time.monotonic()
        go.set()
        timeline: list[dict[str, float | None]] = []
        got: dict[int, dict[str, Any]] = {}
        last_tokens, last_t = 0, t0
        while len(got) < n:
            # finer samples over the first seconds, where every socket's stream is live
            every = a.sample_every if time.monotonic() - t0 > 5 else min(a.sample_every, 0.2)
            try:
                idx, tally = results.get(timeout=every)
                got[idx] = tally
            except Exception:
                pass
            now = time.monotonic()
            if now - last_t >= every or len(got) == n:
                s = _server_sample(http_url, headers)
                s.pop("_text")
                tokens = sum(live[3 * i + 2] for i in range(n))
                s.update(t=now - t0, sockets=sum(live[3 * i] for i in range(n)),
                         live_streams=sum(live[3 * i + 1] for i in range(n)),
                         tok_s=(tokens - last_tokens) / max(now - last_t, 1e-9))
                timeline.append(s)
                last_tokens, last_t = tokens, now
            if now - t0 > a.duration + 1800:
                raise RuntimeError("the load generators did not finish within 30 minutes")
        elapsed = time.monotonic() - t0
        for w in workers:
            w.join(30)
        # the end: nothing running or waiting, every block back (parked requests keep no
        # blocks; they expire after the resume grace)
        deadline = time.monotonic() + 60
        end = _server_sample(http_url, headers)
        while (end["running"] or end["waiting"] or end["kv_usage"]) and time.monotonic() < deadline:
            time.sleep(0.2)
            end = _server_sample(http_url, headers)
        text = end.pop("_text")
        before.pop("_text")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    total = Tally()
    for t in got.values():
        for k, v in t["outcomes"].items():
            total.count(k, v)
        for k, v in t["errors"].items():
            total.errors[k] = total.errors.get(k, 0) + v
        total.ttft += t["ttft"]
        total.gaps += t["gaps"]
        total.tokens += t["tokens"]
        total.connect_failures += t["connect_failures"]
        for k, v in t["examples"].items():
            total.examples.setdefault(k, v)
    held = max((s["live_streams"] or 0 for s in timeline), default=0)
    # the drift baseline: the first sample past the warm-up share of the run's time (the
    # timeline is denser at the start, so not a share of the samples)
    rss = [s["rss_mb"] for s in timeline if s["rss_mb"]]
    warm = [s["rss_mb"] for s in timeline if s["rss_mb"] and s["t"] >= a.warmup * elapsed]
    base = warm[0] if warm else (rss[-1] if rss else 0)
    drift = (max(abs(r - base) for r in warm) / base * 100) if warm and base else 0.0
    # growth over the second half of the run, MB a minute: a leak keeps a slope, a cache
    # filling up (the tier, parked requests) flattens out
    half = [(s["t"], s["rss_mb"]) for s in timeline if s["rss_mb"] and s["t"] >= elapsed / 2]
    slope = ((half[-1][1] - half[0][1]) / max(half[-1][0] - half[0][0], 1e-9) * 60
             if len(half) > 1 else 0.0)
    result = {
        "sockets": a.sockets, "sse": a.sse, "streams_per_socket": a.streams, "clients": n,
        "mix": mix, "duration_s": a.duration, "elapsed_s": elapsed,
        "sockets_connected": connected, "connect_failures": total.connect_failures,
        "peak_live_streams": held,
        "peak_server_connections": max((s["connections"] or 0 for s in timeline), default=0),
        "outcomes": total.outcomes, "errors": total.errors,
        "error_examples": total.examples, "output_tokens": total.tokens,
        "output_tok_s": total.tokens / elapsed,
        "ttft_ms": _quantiles(total.ttft), "gap_ms": _quantiles(total.gaps),
        "server_delivery_ms": {k: (v if k == "count" else v * 1000) for k, v in
                               histogram_quantiles(text, DELIVERY, (0.5, 0.99)).items()},
        "rss_mb": {"before": before["rss_mb"], "after": end["rss_mb"],
                   "warm_baseline": base, "max_drift_pct": drift,
                   "second_half_mb_per_min": slope},
        "fds": {"before": before["fds"], "after": end["fds"],
                "max": max((s["fds"] or 0 for s in timeline), default=0)},
        "end": {k: end[k] for k in ("running", "waiting", "kv_usage", "parked")},
        "blocks_back": not (end["running"] or end["waiting"] or end["kv_usage"]),
        "timeline": timeline,
    }
    return result


def report(r: dict[str, Any]) -> str:
    o = r["outcomes"]
    lines = [
        f"sockets: {r['sockets_connected']}/{r['sockets']} connected "
        f"({r['connect_failures']} failed), peak live streams {r['peak_live_streams']} "
        f"(+ SSE), server connections peak {r['peak_server_connections']:.0f}",
        "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(o.items())),
        "errors: " + (", ".join(f"{k} {v} ({r['error_examples'].get(k, '')})"
                                for k, v in sorted(r["errors"].items())) or "none"),
        f"output: {r['output_tokens']} tokens in {r['elapsed_s']:.1f}s "
        f"({r['output_tok_s']:.0f} tok/s)",
        "TTFT ms: p50 {p50:.0f}, p99 {p99:.0f}, max {max:.0f}".format(**r["ttft_ms"]),
        "inter-delta gap ms (client): p50 {p50:.1f}, p99 {p99:.1f}, max {max:.1f}".format(
            **r["gap_ms"]),
        "sampled->written ms (server): p50 {p50:.3f}, p99 {p99:.3f}".format(
            **r["server_delivery_ms"]),
        "server RSS MB: before {before:.0f}, after {after:.0f}, max drift after warm-up "
        "{max_drift_pct:.1f}%, second half {second_half_mb_per_min:+.1f} MB/min".format(**r["rss_mb"]),
        f"server fds: before {r['fds']['before']:.0f}, max {r['fds']['max']:.0f}, "
        f"after {r['fds']['after']:.0f}",
        f"end: running {r['end']['running']:.0f}, waiting {r['end']['waiting']:.0f}, "
        f"KV usage {r['end']['kv_usage']:.3f}, parked {r['end']['parked']:.0f} -> "
        + ("every block back" if r["blocks_back"] else "BLOCKS NOT BACK"),
    ]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = r["timeline"]
    t = [s["t"] for s in tl]
    fig, ax = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    ax[0].plot(t, [s["sockets"] for s in tl], label="client sockets open")
    ax[0].plot(t, [s["live_streams"] for s in tl], label="live streams (client)")
    ax[0].plot(t, [s["running"] for s in tl], label="running (engine)")
    ax[0].plot(t, [s["waiting"] for s in tl], label="waiting (engine)")
    ax[0].legend(fontsize=8)
    ax[0].set_ylabel("count")
    ax[1].plot(t, [s["tok_s"] for s in tl], color="tab:green")
    ax[1].set_ylabel("output tok/s")
    ax[2].plot(t, [s["rss_mb"] for s in tl], color="tab:red", label="RSS")
    if any(s.get("heap_in_use_mb") for s in tl):  # glibc: what the allocator holds
        ax[2].plot(t, [s.get("heap_in_use_mb") for s in tl], color="tab:orange",
                   label="heap in use")
        ax[2].plot(t, [s.get("heap_free_mb") for s in tl], color="tab:gray",
                   label="heap free (kept)")
    ax[2].legend(fontsize=8, loc="upper left")
    ax2 = ax[2].twinx()
    ax2.plot(t, [s["fds"] for s in tl], color="tab:purple", label="open fds")
    ax[2].set_ylabel("server RSS (MB)")
    ax2.set_ylabel("open fds")
    ax[2].set_xlabel("seconds")
    fig.suptitle(f"tidewire bench load: {r['sockets']} sockets, {r['sse']} SSE, "
                 f"{r['duration_s']:.0f}s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(a: argparse.Namespace) -> int:
    r = run(a)
    print(report(r))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(r, indent=2))
    if a.plot:
        plot(r, a.plot)
        print(f"wrote {a.plot}")
    failed = r["errors"] or r["connect_failures"] or not r["blocks_back"] or any(
        k.startswith("socket_error") for k in r["outcomes"])
    return 1 if failed else 0

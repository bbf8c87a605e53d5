"""A bystander's stream while another client sends huge prompts.

Starts the server (the default model unless --model), opens one socket whose request
streams `--tokens` tokens, and, once it is under way, sends `--hostile` prompts of
`--prompt-mib` MiB each from a second socket. Prints the bystander's gaps between
deltas (p50, p99, max) with and without the hostile traffic, and what each hostile
prompt was answered. Run: `python -m bench.bystander` (repo root, the project's venv).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time

from websockets.asyncio.client import connect

from bench.ws import _start_server, free_port


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def bystander(url: str, tokens: int, started: asyncio.Event) -> list[tuple[float, float]]:
    """(arrival time, gap since the previous delta) for each delta of one long stream."""
    out: list[tuple[float, float]] = []
    async with connect(url, subprotocols=["tidewire.v1.json"], max_size=None) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "generate", "id": "b", "prompt": "Tell me a story.",
                                  "params": {"max_tokens": tokens, "ignore_eos": True,
                                             "temperature": 0.0}}))
        last = None
        while True:
            f = json.loads(await ws.recv())
            now = time.perf_counter()
            if f["type"] == "delta":
                if last is not None:
                    out.append((now, now - last))
                last = now
                if len(out) == 20:
                    started.set()
            elif f["type"] == "done":
                return out


async def hostile(url: str, n: int, mib: float, started: asyncio.Event,
                  window: list[float]) -> list[str]:
    await started.wait()
    answers = []
    prompt = "ab " * int(mib * (1 << 20) / 3)
    async with connect(url, subprotocols=["tidewire.v1.json"], max_size=None) as ws:
        await ws.recv()
        window.append(time.perf_counter())
        for i in range(n):
            await ws.send(json.dumps({"type": "generate", "id": f"h{i}", "prompt": prompt}))
        while len(answers) < n:
            f = json.loads(await ws.recv())
            if f["type"] in ("error", "done"):
                answers.append(f.get("code") or f.get("status"))
        window.append(time.perf_counter())
    return answers


async def run(a: argparse.Namespace) -> None:
    port = free_port()
    os.environ["TIDEWIRE_MAX_MESSAGE_BYTES"] = str(4 << 20)  # room for the huge prompts
    proc = _start_server(argparse.Namespace(
        model=a.model, dtype="auto", max_num_seqs=64, max_num_batched_tokens=512,
        attention_backend="cpu", kv_tier="memory", enforce_eager=False, async_output=True),
        port)
    try:
        url = f"ws://127.0.0.1:{port}/v1/ws"
        started, window = asyncio.Event(), []
        deltas, answers = await asyncio.gather(
            bystander(url, a.tokens, started), hostile(url, a.hostile, a.prompt_mib, started,
                                                       window))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    t0, t1 = window
    # a gap is "during" when the time between its two deltas overlaps the window
    during = [g for t, g in deltas if t - g <= t1 and t >= t0]
    quiet = [g for t, g in deltas if not (t - g <= t1 and t >= t0)]
    for name, gaps in (("quiet", quiet), ("during the hostile prompts", during)):
        print(f"{name}: {len(gaps)} gaps, p50 {1000 * statistics.median(gaps):.1f} ms, "
              f"p99 {1000 * pct(gaps, 0.99):.1f} ms, max {1000 * max(gaps):.1f} ms")
    print(f"hostile prompts answered in {t1 - t0:.2f} s: "
          f"{ {k: answers.count(k) for k in set(answers)} }")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--hostile", type=int, default=20)
    p.add_argument("--prompt-mib", type=float, default=1.0)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()

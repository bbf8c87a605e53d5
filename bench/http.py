"""`tidewire bench http`: the chat-64 workload against any OpenAI-compatible server
(Tidewire, llama.cpp server, vLLM...), so different servers are held to the same requests.

Every request goes out at once as a streaming `POST {base}/completions` whose prompt is
the token-id list itself (no tokenizer on the client side, so every server sees the same
tokens), greedy, `ignore_eos`, with a usage chunk requested. The SSE stream is parsed here
and timed per chunk: TTFT, the gaps between content chunks, completion tokens (from the
usage chunk, else one per content chunk), and overall output tok/s over the wall time.

The client shares the machine with the server when both run on one box, so it is kept
light: aiohttp on uvloop, one event loop for every stream (~0.2 CPU-s for chat-64's
8,690 chunks, where httpx on asyncio's loop took ~1 CPU-s and cost the server on the same
two cores ~14% of its throughput). Like `bench offline`, it first sends the workload's
first few requests (--warmup) untimed."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.workloads import BenchRequest, chat64

if TYPE_CHECKING:
    import aiohttp

DESCRIPTION = (
    "Send the chat-64 workload, every request at once, as streaming POST {base}/completions "
    "(prompt = token ids, temperature 0, ignore_eos, stream_options.include_usage) and "
    "report TTFT, inter-chunk gaps and output tok/s. Each request's token count is compared "
    "with its max_tokens: the server must honour ignore_eos for the comparison, and the "
    "throughput, to be fair (Tidewire, vLLM and llama.cpp server read it; a server that "
    "does not know it ignores the field silently, stops at EOS, and shows up as max_tokens "
    "mismatches). Exits 1 when any request failed.")


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of `tidewire bench http`."""
    p.description = DESCRIPTION
    p.add_argument("--base-url", required=True,
                   help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None,
                   help="the model name sent in requests (default: the first id from "
                        "GET {base}/models)")
    p.add_argument("--vocab-size", type=int, default=49152,
                   help="prompt token ids are drawn below this; the default is SmolLM2's "
                        "vocabulary size")
    p.add_argument("--num-requests", type=int, default=64,
                   help="requests sent at once (other values change chat-64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument("--output-range", type=int, nargs=2, default=(16, 256), metavar=("LO", "HI"),
                   help="max_tokens drawn from LO..HI; the default is chat-64's, other "
                        "values change the workload")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"),
                   help="sent as a Bearer token (default: $OPENAI_API_KEY, else 'none')")
    p.add_argument("--warmup", type=int, default=4, metavar="N",
                   help="send the workload's first N requests once, untimed, before the run "
                        "(as `bench offline` does; their prompts are then cached)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to connect, and to wait for each read, per request")
    p.add_argument("--api", default="completions",
                   help="which API's stream to time, or several, comma-separated, run in "
                        "turn --rounds times with the ratios of their median tok/s to the "
                        "first: completions (token-id prompts), chat (/chat/completions), "
                        "responses (/responses), responses-background (the same with "
                        "background: true, which a server may record to resume elsewhere), "
                        "messages (/messages, Anthropic's); all but completions send the "
                        "prompt as text, the same words for each")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of each --api, alternating (medians reported)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")


APIS = ("completions", "chat", "responses", "responses-background", "messages")
# words the text prompts are made of, one per token id (a client without the server's
# tokenizer; each API gets the same text)
_WORDS = ("tide", "wire", "stream", "token", "river", "harbor", "signal", "lantern", "coast",
          "anchor", "current", "beacon", "shore", "wave", "keel", "compass")


def prompt_text(ids: list[int]) -> str:
    return " ".join(_WORDS[t % len(_WORDS)] for t in ids)


@dataclass
class Outcome:
    """One request's stream as the client saw it (perf_counter seconds)."""

    index: int
    max_tokens: int
    sent: float = 0.0
    done: float = 0.0
    status: int | None = None  # the HTTP status; None when no response came
    failure: str | None = None  # the failure's key (a status code or an error's name)
    message: str = ""
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    usage_tokens: int | None = None  # completion_tokens from the usage chunk

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def completion_tokens(self) -> int:
        """The usage chunk's count, else one token per content chunk (a lower bound when a
        server merges tokens into one chunk)."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)

    def fail(self, key: str, message: str) -> None:
        self.failure, self.message = key, message[:300]


def chunk_has_content(chunk: dict[str, Any]) -> bool:
    """Whether a streamed completion chunk carries generated output: a choice with text, or
    a choice with no finish_reason yet (a server streams one only when generation moved on:
    a token whose text is held back mid-UTF-8, or a model without a tokenizer). A usage-only
    chunk, a closing chunk with a finish_reason and no text, or a chat stream's opening
    chunk (the role, before any token) is not content."""
    for c in chunk.get("choices") or []:
        delta = c.get("delta")
        if delta is None:  # /completions
            if c.get("text") or c.get("finish_reason") is None:
                return True
        elif any(delta.get(k) for k in ("content", "reasoning_content", "reasoning",
                                        "tool_calls")) or \
                (c.get("finish_reason") is None and "role" not in delta):
            return True
    return False


def parse_sse_line(line: str) -> dict[str, Any] | None | str:
    """One line of an SSE stream: its `data:` JSON object, "[DONE]" for the end marker, or
    None for anything else (blank lines, comments, `event:` fields)."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return payload
    return json.loads(payload)


def _headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}


def _body(r: BenchRequest, model: str | None, api: str = "completions") -> dict[str, Any]:
    """The request: the same tokens (or words) and length for every server, greedy, EOS
    ignored."""
    greedy = {"temperature": 0, "ignore_eos": True, "stream": True}
    text = prompt_text(r.prompt_token_ids)
    body: dict[str, Any]
    if api == "completions":
        body = {"prompt": r.prompt_token_ids, "max_tokens": r.max_tokens, **greedy,
                "stream_options": {"include_usage": True}}
    elif api == "chat":
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": r.max_tokens,
                **greedy, "stream_options": {"include_usage": True}}
    elif api.startswith("responses"):
        body = {"input": text, "max_output_tokens": r.max_tokens, **greedy,
                "background": api == "responses-background"}
    else:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": r.max_tokens,
                **greedy}
    if model is not None:
        body["model"] = model
    return body


def _path(api: str) -> str:
    return {"completions": "completions", "chat": "chat/completions", "responses": "responses",
            "responses-background": "responses", "messages": "messages"}[api]


async def default_model(client: aiohttp.ClientSession, base: str, headers: dict[str, str]
                        ) -> str | None:
    """The first id from GET {base}/models, or None (with a warning) when the server does
    not answer it: the requests then go without a model name and fail or not on their own."""
    import aiohttp

    try:
        async with client.get(f"{base}/models", headers=headers) as r:
            if r.status == 200:
                return (await r.json(content_type=None))["data"][0]["id"]
            why = f"HTTP {r.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError,
            TypeError) as e:
        why = f"{type(e).__name__}: {e}"
    print(f"bench http: GET {base}/models failed ({why}); sending no model name",
          file=sys.stderr)
    return None


# the typed-event APIs: (the event of a content delta, the events that end the stream)
_RESPONSE = ("response.output_text.delta",
             ("response.completed", "response.incomplete", "response.failed"))
_TYPED = {"responses": _RESPONSE, "responses-background": _RESPONSE,
          "messages": ("content_block_delta", ("message_stop", "error"))}


def _typed_usage(api: str, event: dict[str, Any]) -> int | None:
    if api.startswith("responses"):
        usage = (event.get("response") or {}).get("usage") or {}
    else:
        usage = event.get("usage") or {}
    value = usage.get("output_tokens")
    return int(value) if value is not None else None


async def _read_stream(resp: aiohttp.ClientResponse, out: Outcome,
                       api: str = "completions") -> None:
    """Time the content chunks of one 200 response until [DONE] (or the typed APIs' last
    event); an error event, a bad data line or a stream that ends early marks the
    request failed."""
    async for raw in resp.content:  # one line at a time
        now = time.perf_counter()
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        try:
            event = parse_sse_line(line)
        except ValueError:
            out.fail("bad_sse", f"not JSON: {line[:200]}")
            return
        if event == "[DONE]":
            return
        if not isinstance(event, dict):
            continue
        if api in _TYPED:
            delta, ends = _TYPED[api]
            kind = event.get("type")
            if kind == delta:
                out.chunk_times.append(now)
            tokens = _typed_usage(api, event)
            if tokens is not None:
                out.usage_tokens = tokens
            if kind in ends:
                if kind in ("response.failed", "error"):
                    out.fail("stream_error", json.dumps(event)[:300])
                return
            continue
        if event.get("error"):
            out.fail("stream_error", json.dumps(event["error"])[:300])
            return
        if chunk_has_content(event):
            out.chunk_times.append(now)
        usage = event.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            out.usage_tokens = int(usage["completion_tokens"])
    out.fail("incomplete", "the stream ended without data: [DONE]")


async def stream_one(client: aiohttp.ClientSession, url: str, headers: dict[str, str],
                     body: dict[str, Any], out: Outcome, api: str = "completions") -> None:
    """Send one request and fill `out`. Every failure is recorded there, never raised (any
    exception: a server's odd reply must cost one request, not the run), keyed by the
    status code or the exception's class."""
    out.sent = time.perf_counter()
    try:
        async with client.post(url, json=body, headers=headers) as resp:
            out.status = resp.status
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                out.fail(str(resp.status), text.strip())
            else:
                await _read_stream(resp, out, api)
    except Exception as e:  # noqa: BLE001 - see the docstring
        out.fail(type(e).__name__, str(e) or repr(e))
    finally:
        out.done = time.perf_counter()


async def run_workload(base: str, model: str | None, api_key: str, work: list[BenchRequest],
                       timeout: float, warmup: int = 0, api: str = "completions"
                       ) -> tuple[str | None, list[Outcome]]:
    """Resolve the model name if not given, send the first `warmup` requests (untimed,
    outcomes dropped), then every request at once, one connection each (no limit on
    connections, so none waits for a slot)."""
    import aiohttp

    headers = _headers(api_key)
    timeouts = aiohttp.ClientTimeout(total=None, connect=timeout, sock_read=timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeouts) as client:
        if model is None:
            model = await default_model(client, base, headers)
        url = f"{base}/{_path(api)}"
        if warmup > 0:
            await asyncio.gather(*(stream_one(client, url, headers, _body(r, model, api),
                                              Outcome(i, r.max_tokens), api)
                                   for i, r in enumerate(work[:warmup])))
        outs = [Outcome(i, r.max_tokens) for i, r in enumerate(work)]
        await asyncio.gather(*(stream_one(client, url, headers, _body(r, model, api), o, api)
                               for r, o in zip(work, outs)))
    return model, outs


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between ranks; None if empty."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _quantiles_ms(seconds: list[float]) -> dict[str, float | int | None]:
    def ms(v: float | None) -> float | None:
        return None if v is None else v * 1000

    return {"p50": ms(percentile(seconds, 50)), "p99": ms(percentile(seconds, 99)),
            "count": len(seconds)}


def summarize(outs: list[Outcome]) -> dict[str, Any]:
    """The run's numbers: completed requests' tokens over the wall time (first send to
    last done, failed requests included), TTFT and inter-chunk quantiles, failures by key."""
    ok = [o for o in outs if o.ok]
    wall = max(o.done for o in outs) - min(o.sent for o in outs) if outs else 0.0
    tokens = sum(o.completion_tokens for o in ok)
    ttft = [o.chunk_times[0] - o.sent for o in ok if o.chunk_times]
    gaps = [b - a for o in ok for a, b in zip(o.chunk_times, o.chunk_times[1:])]
    from_usage = sum(o.usage_tokens is not None for o in ok)
    source = ("none" if not ok else "usage" if from_usage == len(ok)
              else "chunks" if from_usage == 0 else "mixed")
    failed = [o for o in outs if not o.ok]
    return {
        "requests": len(outs), "completed": len(ok), "failures": len(failed),
        "failures_by_status": dict(Counter(o.failure for o in failed)),
        "wall_s": wall, "output_tokens": tokens,
        "output_tok_s": tokens / wall if wall > 0 else 0.0,
        "tokens_from": source,
        "max_tokens_mismatches": sum(o.completion_tokens != o.max_tokens for o in ok),
        "ttft_ms": _quantiles_ms(ttft), "inter_chunk_ms": _quantiles_ms(gaps),
        "per_request": [{"index": o.index, "status": o.status, "failure": o.failure,
                         "message": o.message or None, "max_tokens": o.max_tokens,
                         "completion_tokens": o.completion_tokens if o.ok else None,
                         "chunks": len(o.chunk_times),
                         "ttft_ms": ((o.chunk_times[0] - o.sent) * 1000
                                     if o.ok and o.chunk_times else None)}
                        for o in outs],
    }


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"


def print_report(res: dict[str, Any], outs: list[Outcome]) -> None:
    """A short table, then each kind of failure once with its count and first message."""
    t, g = res["ttft_ms"], res["inter_chunk_ms"]
    note = {"usage": "from usage chunks", "chunks": "counted as content chunks: no usage "
            "chunk came, a lower bound", "mixed": "usage chunks, some counted as chunks",
            "none": "no request completed"}
    model = res["model"] if res["model"] is not None else "(none sent)"
    print(f"{res['url']}  model {model}  {res['requests']} requests at once"
          f" (after {res.get('warmup_requests', 0)} untimed)")
    print(f"  completed        {res['completed']}/{res['requests']}"
          f"   failures {res['failures']}")
    print(f"  wall             {res['wall_s']:.3f} s")
    print(f"  output tokens    {res['output_tokens']} ({note[res['tokens_from']]})")
    print(f"  output tok/s     {res['output_tok_s']:.1f}")
    print(f"  TTFT             p50 {_fmt_ms(t['p50'])}   p99 {_fmt_ms(t['p99'])}")
    print(f"  inter-chunk      p50 {_fmt_ms(g['p50'])}   p99 {_fmt_ms(g['p99'])}"
          f"   ({g['count']} gaps)")
    print(f"  != max_tokens    {res['max_tokens_mismatches']} of {res['completed']} completed"
          " (the server must honour ignore_eos)")
    first: dict[str, Outcome] = {}
    for o in outs:
        if o.failure is not None:
            first.setdefault(o.failure, o)
    for key, o in first.items():
        print(f"  failed {key} x{res['failures_by_status'][key]}: {o.message}")


def main(a: argparse.Namespace) -> int:
    """Run the workload against --base-url (each --api, --rounds times); 0 when every
    request completed, else 1."""
    if a.num_requests < 1:
        raise ValueError("--num-requests must be at least 1")
    apis = [x.strip() for x in a.api.split(",") if x.strip()]
    if not apis or any(x not in APIS for x in apis) or a.rounds < 1:
        raise ValueError(f"--api takes one or more of {', '.join(APIS)}; --rounds >= 1")
    base = a.base_url.rstrip("/")
    lo, hi = a.output_range
    work = chat64(a.vocab_size, a.num_requests, a.seed, output_range=(lo, hi))
    import uvloop

    if a.warmup < 0:
        raise ValueError("--warmup must be 0 or more")
    runs: dict[str, list[dict[str, Any]]] = {x: [] for x in apis}
    model = a.model
    for _ in range(a.rounds):
        for api in apis:
            model, outs = uvloop.run(run_workload(base, model, a.api_key, work, a.timeout,
                                                  a.warmup, api))
            res = {"workload": "chat-64", "api": api, "url": f"{base}/{_path(api)}",
                   "model": model, "warmup_requests": min(a.warmup, len(work)),
                   "vocab_size": a.vocab_size, "seed": a.seed, "output_range": [lo, hi],
                   **summarize(outs)}
            print_report(res, outs)
            runs[api].append(res)
    failures = sum(r["failures"] for rs in runs.values() for r in rs)
    if len(apis) == 1 and a.rounds == 1:
        out: dict[str, Any] = runs[apis[0]][0]
    else:
        medians = {x: statistics.median(r["output_tok_s"] for r in rs) for x, rs in runs.items()}
        first = medians[apis[0]]
        out = {"apis": apis, "rounds": a.rounds, "median_output_tok_s": medians,
               "ratio_to_first": {x: (m / first if first else None) for x, m in medians.items()},
               "runs": runs}
        print("median output tok/s: " + ", ".join(
            f"{x} {m:.1f} ({out['ratio_to_first'][x]:.3f}x)" for x, m in medians.items()))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=2))
    return 0 if failures == 0 else 1

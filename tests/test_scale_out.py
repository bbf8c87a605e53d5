"""Replicas behind HAProxy (deploy/haproxy/haproxy.cfg), as processes: Redis, two
`tidewire serve` replicas, a DNS name for them, the balancer. `make scale-out` runs it
on the default model (TIDEWIRE_SCALE_OUT_FULL=1); `make test` on a tiny random model
with SmolLM2's tokenizer, without the prefix-timing test (whose point is a prefill that
takes seconds).

- A conversation stays on one replica (its routing key); when that replica is gone, the
  conversation's prefix comes from Redis on the other, far faster than a cold prefill.
- A replica killed with SIGKILL mid-stream: the Python and the JS SDK's streams finish
  on the other replica with exactly the uninterrupted greedy text and one done.
- Every replica restarted in turn under load: no request fails.
- A replica that is not ready (loading) gets no traffic."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from tidewire_client import AsyncClient, DeltaEvent, DoneEvent, StartEvent
from tidewire_client import APIConnectionError, APIError

from tests.servers import http_get, http_get_quiet, scrape_metrics
from tests.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
JS = ROOT / "clients" / "js"
FULL = os.environ.get("TIDEWIRE_SCALE_OUT_FULL", "") not in ("", "0")
COMMON = ["--kv-cache-memory-gb", "0.5", "--kv-tier-write-through", "--shutdown-grace", "3"]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def replica_args(smollm2_dir, tiny_chat_model) -> list[str]:  # noqa: ANN001
    model = ["--model", "smollm2-135m"] if FULL else ["--model", str(tiny_chat_model),
                                                      "--dtype", "float32"]
    return model + COMMON


@pytest.fixture(scope="module")
def topo(replica_args, tmp_path_factory) -> Topology:  # noqa: ANN001
    t = Topology(2, replica_args, tmp_path_factory.mktemp("lb"))
    try:
        yield t.start()
    finally:
        t.stop()


@pytest.fixture(autouse=True)
def _replicas_back(request):  # noqa: ANN001, ANN202
    """After each test, a replica it killed and left dead (a failed assertion before its
    restart) is started again, so one failure does not fail the tests after it."""
    yield
    if "topo" not in request.fixturenames:
        return
    t = request.getfixturevalue("topo")
    dead = [i for i, r in enumerate(t.replicas) if r.proc is None or r.proc.poll() is not None]
    for i in dead:
        t.restart(i)
    if dead:
        t.wait_routed(set(t.addresses))


def prompt_tokens(replica) -> float:  # noqa: ANN001 - a ServeProcess
    return scrape_metrics(replica.url).get("tidewire_prompt_tokens_total", 0.0)


def which(topo: Topology, before: list[float]) -> int:
    """The replica whose prompt-token count moved since `before`."""
    moved = [i for i, r in enumerate(topo.replicas) if prompt_tokens(r) != before[i]]
    assert len(moved) == 1, moved
    return moved[0]


def document(seed: int, words: int) -> str:
    import random

    rng = random.Random(seed)
    vocab = ["harbor", "lantern", "granite", "meadow", "copper", "willow", "signal", "ember",
             "tide", "quarry", "orchard", "falcon", "canyon", "beacon", "thistle", "ledger"]
    return " ".join(f"{rng.choice(vocab)}{rng.randrange(100)}" for _ in range(words))


async def ask(url: str, affinity: str, content: str, **params) -> tuple[StartEvent, DoneEvent]:  # noqa: ANN003
    async with AsyncClient(url, affinity=affinity, timeout=180) as c:
        s = await c.chat.stream([{"role": "user", "content": content}], **params)
        start = None
        async for ev in s:
            if isinstance(ev, StartEvent):
                start = ev
        assert start is not None and s.done is not None and s.done.status == "completed"
        return start, s.done


@pytest.mark.skipif(not FULL, reason="the default model's prefill timing: make scale-out")
async def test_a_conversation_stays_on_its_replica_and_moves_through_redis(topo) -> None:
    lb = topo.lb
    for i in range(2):  # warm each process up (so "cold" below means cache-cold only)
        await ask(topo.replicas[i].ws_url, "-", document(100 + i, 60), max_tokens=2, **GREEDY)
    doc = "Summarize this list:\n" + document(7, 650)
    before = [prompt_tokens(r) for r in topo.replicas]
    start, done = await ask(lb.ws_url, "conversation-1", doc, max_tokens=4, **GREEDY)
    home = which(topo, before)
    assert start.prompt_tokens >= 1800, start.prompt_tokens
    # (only the chat template's first block, shared with the warm-up, is cached)
    assert start.cached_tokens.device <= 32 and start.cached_tokens.host == 0
    cold_ms = done.timings.ttft_ms
    for _ in range(3):  # the same conversation: the same replica, its device cache
        before = [prompt_tokens(r) for r in topo.replicas]
        start, _ = await ask(lb.ws_url, "conversation-1", doc, max_tokens=4, **GREEDY)
        assert which(topo, before) == home
        assert start.cached_tokens.device >= start.prompt_tokens - 32
    # its replica goes away (a graceful stop): the balancer moves the conversation
    other = 1 - home
    assert topo.replicas[home].stop() in (0, -15)
    topo.wait_routed({topo.addresses[other]})
    before = [prompt_tokens(r) for r in topo.replicas[other:other + 1]]
    start, done = await ask(lb.ws_url, "conversation-1", doc, max_tokens=4, **GREEDY)
    assert prompt_tokens(topo.replicas[other]) != before[0]
    assert start.cached_tokens.host >= start.prompt_tokens - 32, start.cached_tokens
    moved_ms = done.timings.ttft_ms
    print(f"\nscale-out: a {start.prompt_tokens}-token prompt: cold TTFT {cold_ms:.0f} ms on "
          f"replica {home}; after that replica stopped, {moved_ms:.0f} ms on replica {other} "
          f"with {start.cached_tokens.host} tokens from Redis: {cold_ms / moved_ms:.1f}x")
    assert cold_ms >= 5 * moved_ms, (cold_ms, moved_ms)
    topo.restart(home)
    topo.wait_routed(set(topo.addresses))


def failover_gap(arrivals: list[float], killed_at: float) -> float:
    """Kill to the first delta of the new replica: the delta that ends the longest gap
    between consecutive deltas after the kill (deltas the dead replica had already sent
    can still arrive just after it)."""
    after = [t for t in arrivals if t >= killed_at]
    prev = [killed_at] + after[:-1]
    _, end = max((t - p, t) for p, t in zip(prev, after))
    return end - killed_at


def _js_stream(url: str, request: dict, affinity: str, lines: list[dict]) -> subprocess.Popen:
    node = shutil.which("node")
    assert node, "node is not installed"
    proc = subprocess.Popen([node, "scripts/stream.mjs", url, json.dumps(request), affinity],
                            cwd=JS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(json.loads(line))

    threading.Thread(target=read, daemon=True).start()
    return proc


async def test_a_replica_killed_mid_stream_both_sdks_finish_elsewhere(topo) -> None:
    messages = [{"role": "user", "content": "Tell a long story about a lighthouse keeper."}]
    params = {"max_tokens": 160 if FULL else 600, **GREEDY}
    async with AsyncClient(topo.lb.ws_url, affinity="reference") as c:
        want = await c.chat.create(messages, **params)
    js_lines: list[dict] = []
    js = _js_stream(topo.lb.ws_url, {"messages": messages, **params}, "doomed", js_lines)
    async with AsyncClient(topo.lb.ws_url, affinity="doomed") as c:
        s = await c.chat.stream(messages, **params)
        events: list[tuple[float, object]] = []
        while sum(isinstance(e, DeltaEvent) for _, e in events) < 3:
            events.append((time.time(), await s.next_event()))
        deadline = time.monotonic() + 60
        while sum(1 for x in js_lines if x["type"] == "delta") < 3:
            assert time.monotonic() < deadline and js.poll() is None, js_lines[-3:]
            await asyncio.sleep(0.01)
        running = [scrape_metrics(r.url)["tidewire_requests_running"] for r in topo.replicas]
        victim = max(range(2), key=lambda i: running[i])
        assert running[victim] == 2, running  # one routing key: one replica has both
        killed_at = time.time()
        topo.kill(victim)
        while (ev := await s.next_event()) is not None:
            events.append((time.time(), ev))
        assert await asyncio.to_thread(js.wait, 120) == 0, js.stderr.read()  # type: ignore[union-attr]
    deltas = [e for _, e in events if isinstance(e, DeltaEvent)]
    assert [d.seq for d in deltas] == list(range(1, len(deltas) + 1))
    assert "".join(d.text for d in deltas) == want.text
    assert s.done is not None and s.done.status == "completed"
    py_gap = failover_gap([t for t, e in events if isinstance(e, DeltaEvent)], killed_at)
    js_deltas = [x for x in js_lines if x["type"] == "delta"]
    assert [x["seq"] for x in js_deltas] == list(range(1, len(js_deltas) + 1))
    assert "".join(x["text"] for x in js_deltas) == want.text
    assert [x["type"] for x in js_lines].count("done") == 1
    assert js_lines[-2]["type"] == "done" and js_lines[-2]["status"] == "completed"
    assert js_lines[-1]["token_ids"] == want.token_ids[0]
    js_gap = failover_gap([x["t"] / 1000 for x in js_deltas], killed_at)
    print(f"\nscale-out: replica {victim} killed (SIGKILL) mid-stream: the first delta from the "
          f"other replica came {1000 * py_gap:.0f} ms after the kill through the Python SDK, "
          f"{1000 * js_gap:.0f} ms through the JS SDK; texts identical to an uninterrupted run")
    topo.restart(victim)
    topo.wait_routed(set(topo.addresses))


async def test_a_rolling_restart_under_load_fails_no_request(topo) -> None:
    stop = asyncio.Event()
    tally = {"completed": 0, "failed": 0, "retried": 0}
    failures: list[str] = []

    async def user(k: int) -> None:
        async with AsyncClient(topo.lb.ws_url, affinity=f"user-{k}", max_retries=8) as c:
            n = 0
            while not stop.is_set():
                n += 1
                messages = [{"role": "user", "content": f"User {k}, question {n}: say a number."}]
                for attempt in range(6):
                    try:
                        r = await c.chat.create(messages, max_tokens=24, **GREEDY)
                        assert r.status == "completed", r.status
                        tally["completed"] += 1
                        break
                    except (APIConnectionError, APIError) as e:
                        # a refusal marked retryable (e.g. `overloaded` from a replica
                        # that is draining) or a connection that broke before the request
                        # went out: a client retries; a stream already under way is
                        # resumed by the SDK itself and never lands here
                        if isinstance(e, APIError) and not e.retryable or attempt == 5:
                            tally["failed"] += 1
                            failures.append(repr(e))
                            break
                        tally["retried"] += 1
                        await asyncio.sleep(0.2 * (attempt + 1))

    users = [asyncio.ensure_future(user(k)) for k in range(6)]
    try:
        await asyncio.sleep(1.0)  # (load under way before the first restart)
        for i in range(len(topo.replicas)):
            code = await asyncio.to_thread(topo.replicas[i].stop)
            assert code in (0, -15), topo.replicas[i].log()[-2000:]
            await asyncio.to_thread(topo.restart, i)
            await asyncio.to_thread(topo.wait_routed, set(topo.addresses))
        done_before = tally["completed"]
        while tally["completed"] < done_before + 6:  # still served after the last restart
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*users), 120)
    resumed = sum(scrape_metrics(r.url).get(
        'tidewire_websocket_resumable_requests_total', 0.0) for r in topo.replicas)
    print(f"\nscale-out: rolling restart of {len(topo.replicas)} replicas under 6 users: "
          f"{tally}, failures {failures[:3]}, resumable-request events on the new "
          f"replicas {resumed:.0f}")
    assert tally["failed"] == 0, failures
    assert tally["completed"] >= 12


async def test_a_replica_that_is_not_ready_is_routed_around(topo, replica_args) -> None:
    """A third replica joins (its name in DNS) and loads: /ready and its endpoints answer
    503 meanwhile. Clients through the balancer never see that: every handshake and
    every HTTP request made while it loads succeeds elsewhere; once ready, it is
    routed to."""
    from websockets.asyncio.client import connect

    from tests.servers import ServeProcess

    addr = "127.0.0.23"
    third = ServeProcess(*replica_args, "--kv-tier", "redis", "--redis-url", topo.redis.url,
                         host=addr, port=topo.port)
    topo.dns.addresses.append(addr)
    third.start(wait=False)
    tried, refused_by_it = 0, 0
    try:
        while await asyncio.to_thread(http_get_quiet, third.url + "/ready") != 200:
            # raw clients, no retries: each answer is what the balancer gave
            async with connect(topo.lb.ws_url, subprotocols=["tidewire.v1.json"],
                               additional_headers={"X-Tidewire-Affinity": f"probe-{tried}"},
                               open_timeout=30) as ws:
                assert json.loads(await ws.recv())["type"] == "ready"
            status, body = await asyncio.to_thread(http_get, topo.lb.url + "/v1/models")
            assert status == 200, body
            direct = await asyncio.to_thread(http_get_quiet, third.url + "/v1/models")
            refused_by_it += direct == 503
            tried += 1
            assert tried < 2000, "the third replica never became ready"
        assert tried > 0 and refused_by_it > 0  # it really was there and loading meanwhile
        topo.wait_routed({*topo.addresses, addr})
        print(f"\nscale-out: while a third replica loaded (503 to {refused_by_it} direct "
              f"requests), {tried} WebSocket handshakes and {tried} HTTP requests through "
              f"the balancer all succeeded; routed to once ready")
    finally:
        topo.dns.addresses.remove(addr)
        third.kill()
    topo.wait_routed(set(topo.addresses))

"""Resumable SSE on the completion endpoints (service/sse_resume.py): every event has an
`id: SEQ:TOKENS`; a stream that opted in (X-Tidewire-Resume) runs on when its client
drops, and `GET .../{id}/events` with Last-Event-ID replays the rest, so the client's
text is the uninterrupted run's, one [DONE]; Chromium's EventSource does that by itself
through a connection cut. Without the opt-in a drop aborts, as before."""

from __future__ import annotations

import contextlib
import http.client
import json
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from engine import EngineConfig
from service.config import Limits, ServiceConfig
from tests.servers import run_server

GRACE = 0.5  # the grace test's server: short, as the test waits it out
MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
BODY = {"model": "tiny", "messages": MESSAGES, "max_tokens": 60, "temperature": 0,
        "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with run_server(_config(tiny_chat_model, 30.0)) as s:
        yield s


def _config(model, grace: float) -> ServiceConfig:  # noqa: ANN001 - a model directory
    return ServiceConfig(engine=EngineConfig(model=str(model), dtype="float32"),
                         model_name="tiny", limits=Limits(resume_grace=grace))


def events_of(lines: list[str]) -> list[dict]:
    """SSE events (their id, data) from the lines of a stream."""
    out, cur = [], {}
    for line in lines:
        if not line:
            if cur:
                out.append(cur)
            cur = {}
            continue
        name, _, value = line.partition(": ")
        cur[name] = value
    return out


def content(events: list[dict]) -> str:
    text = ""
    for e in events:
        if e["data"] != "[DONE]":
            for c in json.loads(e["data"])["choices"]:
                text += c["delta"].get("content") or ""
    return text


@contextlib.contextmanager
def stream(method: str, url: str, body: dict | None = None,
           headers: dict[str, str] | None = None) -> Iterator[http.client.HTTPResponse]:
    """An HTTP request whose response is read line by line; leaving the block closes
    the connection (a client that drops)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    path = u.path + (f"?{u.query}" if u.query else "")
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"content-type": "application/json", **(headers or {})})
    try:
        yield conn.getresponse()
    finally:
        conn.close()


def read(response: http.client.HTTPResponse, until_seq: int | None = None) -> list[dict]:
    lines = []
    while raw := response.readline():
        line = raw.decode().rstrip("\r\n")
        lines.append(line)
        if line == "" and until_seq is not None:
            evs = events_of(lines)
            if evs and int(evs[-1]["id"].split(":")[0]) >= until_seq:
                return evs
    return events_of(lines + [""])


def wait_idle(server, what: str) -> None:
    deadline = time.monotonic() + 20
    while server.gateway.inflight_total and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.gateway.inflight_total == 0, what


def test_events_carry_sequence_and_token_ids(server) -> None:
    with stream("POST", server.url + "/v1/chat/completions", BODY) as r:
        events = read(r)
    seqs = [int(e["id"].split(":")[0]) for e in events]
    tokens = [int(e["id"].split(":")[1]) for e in events]
    assert seqs == list(range(len(events))) and events[-1]["data"] == "[DONE]"
    assert tokens == sorted(tokens) and tokens[-1] == 60 and "retry" not in events[0]
    assert all(list(e)[0] == "data" for e in events)  # data first: a reader of old sees it


def test_a_dropped_stream_is_replayed_and_continued(server) -> None:
    url = server.url + "/v1/chat/completions"
    with stream("POST", url, BODY) as r:
        whole = content(read(r))
    with stream("POST", url, BODY, {"X-Tidewire-Resume": "1"}) as r:
        before = read(r, until_seq=3)
    assert before[0]["retry"] and before[-1]["id"].startswith("3:")
    cid = json.loads(before[0]["data"])["id"]
    with stream("GET", f"{url}/{cid}/events", None, {"Last-Event-ID": before[-1]["id"]}) as r:
        assert r.status == 200
        after = read(r)
    assert [int(e["id"].split(":")[0]) for e in after] == list(range(4, 4 + len(after)))
    assert content(before) + content(after) == whole
    assert [e["data"] for e in after].count("[DONE]") == 1
    for bad in ("--1", "3:x", "\u00b2"):  # refused as bad input
        with stream("GET", f"{url}/{cid}/events", None, {"Last-Event-ID": bad}) as r:
            assert r.status == 400
    # ended and replayable for the grace period: from any point, again
    with stream("GET", f"{url}/{cid}/events?after=10") as r:
        assert content(read(r)) == content((before + after)[11:])
    wait_idle(server, "the resumed stream ended")


def test_without_opting_in_a_drop_aborts(server) -> None:
    url = server.url + "/v1/chat/completions"
    with stream("POST", url, {**BODY, "max_tokens": 900}) as r:
        before = read(r, until_seq=2)
    cid = json.loads(before[0]["data"])["id"]
    wait_idle(server, "a plain stream's drop aborts its request")
    with stream("GET", f"{url}/{cid}/events") as r:
        assert r.status == 404


def test_a_stream_nobody_comes_back_for_is_aborted_after_the_grace(tiny_chat_model) -> None:
    with run_server(_config(tiny_chat_model, GRACE)) as server:
        url = server.url + "/v1/chat/completions"
        aborted = server.gateway.metrics.requests.labels("abort")
        with stream("POST", url + "?resume=1", {**BODY, "max_tokens": 950}) as r:
            read(r, until_seq=1)
        dropped = time.monotonic()
        assert server.gateway.inflight_total == 1  # running on, nobody following
        wait_idle(server, "the grace ran out")
        assert time.monotonic() - dropped >= GRACE * 0.9
        assert aborted._value.get() == 1  # stopped, not run to its end


@pytest.mark.slow
async def test_chromium_eventsource_resumes_through_a_cut(server) -> None:
    """The page starts an opted-in stream with fetch, lets that go, and follows it with
    an EventSource; the proxy between page and server cuts every connection mid-stream;
    EventSource reconnects by itself with Last-Event-ID and the page's text is the
    uninterrupted run's."""
    from tests.chaos.proxy import ChaosProxy
    from tests.test_chat_page import browser

    body = {**BODY, "max_tokens": 400}
    with stream("POST", server.url + "/v1/chat/completions", body) as r:
        whole = content(read(r))
    proxy = ChaosProxy(int(server.url.rsplit(":", 1)[1])).start()
    try:
        async with browser() as b:
            page = await b.new_page()
            await page.goto(f"http://127.0.0.1:{proxy.port}/")
            await page.evaluate("""async (body) => {
                const r = await fetch('/v1/chat/completions', {method: 'POST',
                    headers: {'content-type': 'application/json', 'x-tidewire-resume': '1'},
                    body: JSON.stringify(body)});
                const first = new TextDecoder().decode((await r.body.getReader().read()).value);
                const id = JSON.parse(first.split('data: ')[1].split('\\n')[0]).id;
                window.got = {text: '', done: 0, errors: 0, events: 0};
                const es = new EventSource(`/v1/chat/completions/${id}/events`);
                es.onmessage = (e) => {
                    window.got.events++;
                    if (e.data === '[DONE]') { window.got.done++; es.close(); return; }
                    for (const c of JSON.parse(e.data).choices)
                        window.got.text += c.delta.content || '';
                };
                es.onerror = () => { window.got.errors++; };
            }""", body)
            await page.wait_for_function("window.got && window.got.events >= 5")
            proxy.cut()
            await page.wait_for_function("window.got.done >= 1", timeout=60000)
            got = await page.evaluate("window.got")
    finally:
        proxy.stop()
    assert proxy.cuts >= 1 and got["errors"] >= 1  # it did drop, and came back
    assert got["text"] == whole and got["done"] == 1


def test_a_client_done_early_stops_the_stream_at_once(server) -> None:
    """DELETE .../{id}/events stops an opted-in stream now (no grace to wait out); the
    Python SDK sends it when its iteration is closed before [DONE]."""
    from tidewire_client.sse import stream_chat

    url = server.url + "/v1/chat/completions"
    aborted = server.gateway.metrics.requests.labels("abort")
    before = aborted._value.get()
    with stream("POST", url, {**BODY, "max_tokens": 900}, {"X-Tidewire-Resume": "1"}) as r:
        events = read(r, until_seq=2)
    cid = json.loads(events[0]["data"])["id"]
    with stream("DELETE", f"{url}/{cid}/events") as r:
        assert r.status == 200 and json.loads(r.read()) == {"id": cid, "cancelled": True}
    wait_idle(server, "the DELETE stopped it")  # (well inside the 30 s grace)
    assert aborted._value.get() == before + 1
    with stream("DELETE", f"{url}/chatcmpl-nope/events") as r:
        assert r.status == 404
    chunks = stream_chat(server.url + "/v1", MESSAGES, model="tiny", max_tokens=900,
                         ignore_eos=True)
    for n, _ in enumerate(chunks):
        if n == 2:
            break
    chunks.close()  # (what leaving the loop does once the generator is collected)
    wait_idle(server, "the SDK's DELETE stopped it")
    assert aborted._value.get() == before + 2


async def test_one_tenant_does_not_take_every_detached_place() -> None:
    """Streams left without a follower run on up to max_detached_per_key a tenant: past
    it that tenant's next one stops at once, while another tenant's still runs on."""
    import asyncio

    from service.sse_resume import SseStreams

    streams = SseStreams(Limits(resume_grace=30.0, max_detached=8, max_detached_per_key=1))
    hold = asyncio.Event()

    async def endless():  # noqa: ANN202 - an event source that waits
        yield "data: {}\n\n", 1
        await hold.wait()

    async def drop(sid: str, tenant: str):  # noqa: ANN202
        s = streams.start(sid, tenant, endless())
        async for _ in streams.follow(s, -1):
            break  # (its client leaves after the first event)
        await asyncio.sleep(0)
        return s

    kept, over, other = await drop("a1", "a"), await drop("a2", "a"), await drop("b1", "b")
    await asyncio.sleep(0)
    assert not kept.task.done() and not other.task.done()
    assert over.task.done() and over.ended  # stopped: "a" had its one place
    assert streams.detached == 2 and streams.detached_by == {"a": 1, "b": 1}
    hold.set()
    await asyncio.gather(kept.task, other.task)
    assert streams.detached == 0 and streams.detached_by == {}

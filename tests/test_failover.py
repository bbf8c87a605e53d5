"""Resuming a stream on a server that never ran it (another replica, or this one after a
restart): `resume` carries the request and the token ids received, the server continues
from them, and the client gets exactly the uninterrupted run's tokens and text (greedy
and seeded), seqs continuing from after_seq, one done."""

from __future__ import annotations

import json
from typing import Any

import pytest
from websockets.asyncio.client import connect

from engine import EngineConfig
from service.config import ServiceConfig
from tests.servers import run_server

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def two_servers(tiny_chat_model):  # noqa: ANN201
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_chat_model), dtype="float32"),
                           model_name="tiny")
    with run_server(config) as a, run_server(config) as b:
        yield a, b


async def _open(url: str) -> tuple[Any, str]:
    ws = await connect(url, subprotocols=["tidewire.v1.json"], ping_interval=None)
    ready = json.loads(await ws.recv())
    return ws, ready["session_id"]


async def _read(ws: Any, rid: str, until_seq: int | None = None) -> list[dict[str, Any]]:
    """Frames for `rid` until its done (or until a delta with seq >= until_seq)."""
    frames = []
    while True:
        m = json.loads(await ws.recv())
        assert m.get("id") == rid, m
        frames.append(m)
        if m["type"] == "done" or (until_seq is not None and m["type"] == "delta"
                                   and m["seq"] >= until_seq):
            return frames


def _tokens_text(frames: list[dict[str, Any]]) -> tuple[list[int], str]:
    deltas = [f for f in frames if f["type"] == "delta"]
    return [t for d in deltas for t in d["token_ids"]], "".join(d["text"] for d in deltas)


@pytest.mark.parametrize("params", [
    {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True},
    {"max_tokens": 40, "temperature": 1.0, "top_p": 0.9, "seed": 7, "frequency_penalty": 0.5,
     "ignore_eos": True},
], ids=["greedy", "seeded"])
async def test_a_dropped_stream_continues_on_another_server(two_servers, params) -> None:
    a, b = two_servers
    request = {"messages": MESSAGES, "params": params}
    ws, _ = await _open(a.ws_url)  # the uninterrupted run
    await ws.send(json.dumps({"type": "generate", "id": "whole", **request}))
    whole = _tokens_text(await _read(ws, "whole"))
    await ws.close()

    ws, session = await _open(a.ws_url)  # the same request, dropped after 3 deltas
    await ws.send(json.dumps({"type": "generate", "id": "r", **request}))
    before = await _read(ws, "r", until_seq=3)
    ws.transport.abort()
    got_tokens, got_text = _tokens_text(before)
    assert before[0]["type"] == "start" and 0 < len(got_tokens) < len(whole[0])

    ws, _ = await _open(b.ws_url)  # another server: it has never seen session or request
    await ws.send(json.dumps({"type": "resume", "id": "r", "after_seq": 3, "session_id": session,
                              "request": request, "token_ids": got_tokens}))
    after = await _read(ws, "r")
    assert after[0] == {"type": "resumed", "id": "r", "after_seq": 3}
    deltas = [f for f in after if f["type"] == "delta"]
    assert [d["seq"] for d in deltas] == list(range(4, 4 + len(deltas)))
    assert [f["type"] for f in after].count("done") == 1 and after[-1]["type"] == "done"
    assert "start" not in [f["type"] for f in after]
    tokens, text = _tokens_text(after)
    assert got_tokens + tokens == whole[0]
    assert got_text + text == whole[1]
    done = after[-1]
    assert done["status"] == "completed" and done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == params["max_tokens"]
    await ws.close()


async def test_what_cannot_be_continued_elsewhere_is_refused(two_servers) -> None:
    _, b = two_servers
    ws, _ = await _open(b.ws_url)
    base = {"type": "resume", "after_seq": 1, "session_id": "gone"}
    cases = {
        "n2": ({"prompt": "hi", "params": {"n": 2, "max_tokens": 4}}, [5], "n > 1"),
        "tools": ({"messages": MESSAGES, "params": {"max_tokens": 4, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}},
            [5], "resumed on the server that ran it"),
        "too-many": ({"prompt": "hi", "params": {"max_tokens": 2}}, [5, 6, 7], "max_tokens"),
        "bad-request": ({"id": "x", "prompt": "hi"}, [], "without type and id"),
    }
    for rid, (request, toks, words) in cases.items():
        await ws.send(json.dumps({**base, "id": rid, "request": request, "token_ids": toks}))
        err = json.loads(await ws.recv())
        assert err["type"] == "error" and err["code"] == "invalid_request", err
        assert err["id"] == rid and words in err["message"], err
    # token_ids without a request; a resume with nothing: the stateful refusals
    await ws.send(json.dumps({**base, "id": "t", "token_ids": [1]}))
    assert "come with request" in json.loads(await ws.recv())["message"]
    await ws.send(json.dumps({**base, "id": "u"}))
    assert "nothing to resume" in json.loads(await ws.recv())["message"]
    # the socket still serves
    await ws.send(json.dumps({"type": "ping"}))
    assert json.loads(await ws.recv())["type"] == "pong"
    await ws.close()


async def test_the_python_sdk_resumes_on_another_server(two_servers) -> None:
    """The SDK's socket goes through a TCP proxy to server A; A's connection is cut and
    the proxy now leads to B (a replica dies, the balancer sends the reconnect
    elsewhere): the stream carries on from B, seamlessly."""
    from tidewire_client import AsyncClient, DeltaEvent

    from tests.chaos.proxy import ChaosProxy

    a, b = two_servers
    port = lambda s: int(s.url.rsplit(":", 1)[1])  # noqa: E731
    proxy = ChaosProxy(port(a)).start()
    params = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
    continued = b.gateway.metrics.resumes.labels("continued")
    before = (a.gateway.inflight_total, b.gateway.inflight_total, continued._value.get())
    try:
        async with AsyncClient(b.ws_url) as direct:
            want = await direct.chat.create(MESSAGES, **params)
        async with AsyncClient(f"ws://127.0.0.1:{proxy.port}/v1/ws", affinity="conv-1") as c:
            stream = await c.chat.stream(MESSAGES, **params)
            events = []
            while len([e for e in events if isinstance(e, DeltaEvent)]) < 3:
                events.append(await stream.next_event())
            assert (a.gateway.inflight_total, b.gateway.inflight_total) == \
                (before[0] + 1, before[1])
            proxy.target = ("127.0.0.1", port(b))
            proxy.cut()
            while (ev := await stream.next_event()) is not None:
                events.append(ev)
            deltas = [e for e in events if isinstance(e, DeltaEvent)]
            assert [d.seq for d in deltas] == list(range(1, len(deltas) + 1))
            assert "".join(d.text for d in deltas) == want.text
            assert [t for d in deltas for t in d.token_ids] == want.token_ids[0]
            assert stream.done.status == "completed"
            assert stream.done.usage.completion_tokens == 48
            assert continued._value.get() == before[2] + 1  # B continued it
    finally:
        proxy.stop()

"""OpenAI-compatible endpoints with the official `openai` SDK; auth and tenancy;
metrics; overload. All against the real app under uvicorn on a free port."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import openai
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from engine import LLM, EngineConfig, SamplingParams
from service.config import Limits, ServiceConfig
from tests.servers import http_get, run_server, scrape_metrics

MSGS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    config = ServiceConfig(engine=EngineConfig(model="smollm2-135m", dtype="float32"),
                           api_keys={"key-a": "tenant-a", "key-b": "tenant-b"})
    with run_server(config) as s:
        yield s


@pytest.fixture(scope="module")
def offline():
    return LLM(model="smollm2-135m", dtype="float32")


def client(server, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_chat_non_stream_matches_offline(server, offline) -> None:
    r = client(server).chat.completions.create(model="smollm2-135m", messages=MSGS,
                                               max_tokens=24, temperature=0)
    want = offline.chat(MSGS, SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert r.choices[0].message.content == want.text and "Paris" in want.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reason == "stop"
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)


def test_chat_stream_with_usage(server, offline) -> None:
    stream = client(server).chat.completions.create(
        model="smollm2-135m", messages=MSGS, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    text = "".join(c.choices[0].delta.content for c in content)
    want = offline.chat(MSGS, SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert text == want.text
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_completions_stream_and_non_stream(server, offline) -> None:
    c = client(server)
    want = offline.generate(["The sea is"], SamplingParams(max_tokens=12, temperature=0.0))[0]
    r = c.completions.create(model="smollm2-135m", prompt="The sea is", max_tokens=12,
                             temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    parts = list(c.completions.create(model="smollm2-135m", prompt="The sea is", max_tokens=12,
                                      temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == want.text
    assert parts[-1].choices[0].finish_reason == "length"


def test_models_n_stop_and_logprobs(server) -> None:
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["smollm2-135m"]
    r = c.chat.completions.create(model="smollm2-135m", messages=MSGS, max_tokens=20, n=2,
                                  temperature=1.0, seed=3, logprobs=True, top_logprobs=2)
    assert len(r.choices) == 2 and [ch.index for ch in r.choices] == [0, 1]
    lp = r.choices[0].logprobs.content
    assert lp and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp)
    r = c.chat.completions.create(model="smollm2-135m", messages=MSGS, max_tokens=20,
                                  temperature=0, stop=["Paris"])
    assert "Paris" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"


def test_openai_errors(server) -> None:
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.chat.completions.create(model="smollm2-135m", messages=MSGS, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-9", messages=MSGS)
    with pytest.raises(openai.BadRequestError, match="context window"):
        c.completions.create(model="smollm2-135m", prompt=[5] * 8000, max_tokens=500)
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").chat.completions.create(model="smollm2-135m", messages=MSGS)


async def test_websocket_auth(server) -> None:
    with pytest.raises(InvalidStatus):  # no key: closed before the handshake completes
        async with connect(server.ws_url, subprotocols=["tidewire.v1.json"]):
            pass
    async with connect(server.ws_url, subprotocols=["tidewire.v1.json"],
                       additional_headers={"Authorization": "Bearer key-a"}) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
    token = base64.urlsafe_b64encode(b"key-b").decode().rstrip("=")
    async with connect(server.ws_url,
                       subprotocols=["tidewire.v1.json", f"tidewire.auth.{token}"]) as ws:
        assert ws.subprotocol == "tidewire.v1.json"  # the key is never echoed
        assert json.loads(await ws.recv())["type"] == "ready"


async def _cached_tokens(server, key: str, rid: str) -> int:
    async with connect(server.ws_url, subprotocols=["tidewire.v1.json"],
                       additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        await ws.recv()
        prompt = [{"role": "system", "content": "You are a meticulous assistant. " * 6},
                  {"role": "user", "content": "Hello there!"}]
        await ws.send(json.dumps({"type": "generate", "id": rid, "messages": prompt,
                                  "params": {"max_tokens": 2}}))
        while (m := json.loads(await ws.recv()))["type"] != "done":
            pass
        return sum(m["usage"]["cached_tokens"].values())  # {device, host}


async def test_tenants_do_not_share_prefix_cache(server) -> None:
    assert await _cached_tokens(server, "key-a", "t1") == 0
    assert await _cached_tokens(server, "key-a", "t2") > 0  # same tenant: a hit
    assert await _cached_tokens(server, "key-b", "t3") == 0  # another tenant: no hit


def test_metrics_parse_and_move(server) -> None:
    before = scrape_metrics(server.url)
    client(server).completions.create(model="smollm2-135m", prompt="Hi", max_tokens=3)
    after = scrape_metrics(server.url)
    assert after["tidewire_generation_tokens_total"] >= before.get(
        "tidewire_generation_tokens_total", 0) + 3
    assert after["tidewire_prompt_tokens_total"] > before.get("tidewire_prompt_tokens_total", 0)
    assert after["tidewire_time_to_first_token_seconds_count"] > before.get(
        "tidewire_time_to_first_token_seconds_count", 0)
    assert "tidewire_kv_cache_usage_ratio" in after
    # a streamed completion records each content chunk's sampled-to-written time
    stream = client(server).chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        stream=True, extra_body={"ignore_eos": True})
    chunks = sum(1 for ch in stream if ch.choices and ch.choices[0].delta.content)
    final = scrape_metrics(server.url)
    sse = final["tidewire_sse_delta_delivery_seconds_count"] - after.get(
        "tidewire_sse_delta_delivery_seconds_count", 0)
    assert 1 <= chunks <= sse <= 5  # (a chunk may carry no text: a cut character)
    assert final["tidewire_sse_delta_delivery_seconds_sum"] > after.get(
        "tidewire_sse_delta_delivery_seconds_sum", 0)
    assert http_get(server.url + "/health")[0] == 200
    assert http_get(server.url + "/")[0] == 200


def test_overloaded_is_429_with_retry_after(tiny_models) -> None:
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)), dtype="float32"),
                           model_name="tiny", limits=Limits(max_queue=0))
    with run_server(config) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as info:
            c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2)
        assert info.value.response.headers["retry-after"] == "1"


def test_sse_client_disconnect_aborts_and_max_connections(tiny_models) -> None:
    import http.client

    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)), dtype="float32"),
                           model_name="tiny", limits=Limits(max_connections=1))
    with run_server(config) as s:
        host, port = s.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1000,
                           "ignore_eos": True, "stream": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        conn.close()  # the client goes away mid-stream
        eng = s.engine
        for _ in range(500):
            if not eng.has_unfinished() and eng.kv.num_free_blocks == eng.num_blocks:
                break
            time.sleep(0.01)
        assert not eng.has_unfinished() and eng.kv.num_free_blocks == eng.num_blocks
        _, metrics = http_get(s.url + "/metrics")
        assert 'tidewire_requests_total{finish_reason="abort"} 1.0' in metrics.decode()

        async def two_sockets() -> int:
            async with connect(s.ws_url, subprotocols=["tidewire.v1.json"]) as first:
                await first.recv()
                async with connect(s.ws_url, subprotocols=["tidewire.v1.json"]) as second:
                    with pytest.raises(Exception):
                        await second.recv()
                    return second.close_code

        assert asyncio.run(two_sockets()) == 1013

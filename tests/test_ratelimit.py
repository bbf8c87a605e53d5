"""Tokens per minute per API key: the bucket (with an injected clock) and the server's
answers over HTTP (429 + Retry-After, the openai SDK) and the socket (`rate_limited`
with `retry_after`, the socket stays open), on the real app under uvicorn."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from websockets.asyncio.client import connect

from engine import EngineConfig
from service.config import Limits, ServiceConfig
from service.ratelimit import TokenBudget
from tests.servers import run_server
from tidewire_client._errors import RateLimitError, error_from_frame


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_refills_continuously_and_owes_what_it_overdrew() -> None:
    clock = Clock()
    b = TokenBudget(60, clock)  # one token a second, 60 at most
    assert b.retry_after("k") == 0 and b.level("k") == 60
    b.charge("k", 50)
    assert b.level("k") == 10 and b.retry_after("k") == 0
    b.charge("k", 25)  # a request in flight may overdraw
    assert b.level("k") == -15
    assert b.retry_after("k") == pytest.approx(16.0)  # back to one token
    clock.now += 10
    assert b.level("k") == pytest.approx(-5) and b.retry_after("k") == pytest.approx(6.0)
    clock.now += 6
    assert b.retry_after("k") == 0
    assert b.level("other") == 60  # keys are separate
    clock.now += 1000
    assert b.level("k") == 60  # never above the capacity
    assert b._buckets == {}  # a full bucket takes no memory
    b.charge("k", 0)
    assert b._buckets == {}
    with pytest.raises(ValueError):
        TokenBudget(0)


def test_sdk_errors_carry_retry_after() -> None:
    e = error_from_frame({"type": "error", "code": "rate_limited", "message": "m",
                          "retryable": True, "id": "r1", "retry_after": 12.5})
    assert isinstance(e, RateLimitError) and e.retry_after == 12.5 and e.request_id == "r1"
    assert error_from_frame({"code": "overloaded", "message": "m"}).retry_after is None


@pytest.fixture(scope="module")
def limited(tiny_models):
    # 60 tokens a minute: a 100-token request leaves its key ~40 tokens in debt, which
    # takes ~40 s to refill, far longer than the test
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)),
                                               dtype="float32"),
                           model_name="tiny", api_keys={"key-a": "a", "key-b": "b"},
                           limits=Limits(max_tokens_per_minute_per_key=60))
    with run_server(config) as s:
        yield s


def _client(s, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)


def test_a_key_over_its_tokens_per_minute_is_refused_until_refilled(limited) -> None:
    a = _client(limited, "key-a")
    r = a.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=100,
                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 100  # admitted with a full bucket, never cut off
    with pytest.raises(openai.RateLimitError) as info:
        a.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2)
    body = info.value.response.json()["error"]
    assert body["code"] == "rate_limited" and body["type"] == "rate_limit_error"
    wait = int(info.value.response.headers["retry-after"])
    assert 38 <= wait <= 50, wait  # ~43 tokens owed, 5 reserved, at one a second
    # another key has its own bucket
    r = _client(limited, "key-b").completions.create(model="tiny", prompt=[5, 6, 7],
                                                      max_tokens=2)
    assert r.usage.completion_tokens == 2

    async def over_the_socket() -> list[dict]:
        async with connect(limited.ws_url, subprotocols=["tidewire.v1.json"],
                           additional_headers={"Authorization": "Bearer key-a"}) as ws:
            assert json.loads(await ws.recv())["type"] == "ready"
            await ws.send(json.dumps({"type": "generate", "id": "g1",
                                      "prompt_token_ids": [5, 6, 7],
                                      "params": {"max_tokens": 2}}))
            await ws.send(json.dumps({"type": "ping", "t": 1}))
            frames = [json.loads(await asyncio.wait_for(ws.recv(), 30)) for _ in range(2)]
            return frames

    err, pong = asyncio.run(over_the_socket())
    assert err["type"] == "error" and err["code"] == "rate_limited" and err["id"] == "g1"
    assert err["retryable"] is True and 38 <= err["retry_after"] <= 50
    assert pong["type"] == "pong"  # the socket stays open and answers
    assert limited.gateway.inflight_total == 0


def test_a_reservation_bounds_what_concurrent_requests_take(tiny_models) -> None:
    """Each request reserves prompt + n x max_tokens at admission: requests arriving
    together cannot take more than the bucket between them (charging generated tokens
    only when each ended let any number in at once), and what one did not use comes
    back when it ends."""
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)),
                                               dtype="float32"),
                           model_name="tiny", api_keys={"key-a": "a"},
                           limits=Limits(max_tokens_per_minute_per_key=60))

    async def burst(s) -> list[dict]:  # noqa: ANN001
        async with connect(s.ws_url, subprotocols=["tidewire.v1.json"],
                           additional_headers={"Authorization": "Bearer key-a"}) as ws:
            assert json.loads(await ws.recv())["type"] == "ready"
            for i in range(10):  # 3 + 20 = 23 tokens each: two fit in 60
                await ws.send(json.dumps({"type": "generate", "id": f"g{i}",
                                          "prompt_token_ids": [5, 6, 7],
                                          "params": {"max_tokens": 20, "ignore_eos": True,
                                                     "stop_token_ids": [9]}}))
            ends: list[dict] = []
            while len(ends) < 10:
                f = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if f["type"] == "done" or (f["type"] == "error" and "id" in f):
                    ends.append(f)
            return ends

    with run_server(config) as s:
        ends = asyncio.run(burst(s))
        refused = [f for f in ends if f["type"] == "error"]
        assert len(refused) == 8 and {f["code"] for f in refused} == {"rate_limited"}
        assert [f["type"] for f in ends].count("done") == 2
        budget = s.gateway.token_budget
        used = sum(3 + f["usage"]["completion_tokens"] for f in ends if f["type"] == "done")
        assert budget.level("key-a") == pytest.approx(60 - used, abs=2)  # refunded the rest
        assert s.gateway.inflight_total == 0 and not s.gateway.inflight_by_key


def test_without_api_keys_there_is_no_token_limit(tiny_models) -> None:
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)),
                                               dtype="float32"),
                           model_name="tiny", limits=Limits(max_tokens_per_minute_per_key=5))
    with run_server(config) as s:
        assert s.gateway.token_budget is None
        c = _client(s, "anything")
        for _ in range(2):
            r = c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=8,
                                     extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 8

"""OpenAI-compatible endpoints with the official `openai` SDK; auth and tenancy;
metrics; overload. All against the real app under uvicorn on a free port."""

from __future__ import annotations

import asyncio
import base64
import importlib.metadata
import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

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


def test_a_warmed_prefix_is_invisible_to_another_tenant(server) -> None:
    """Tenant A warms a long prompt; tenant B sending the same prompt reuses nothing
    (warm's counters) and pays for the whole prefill: its time to an answer is that of
    a cold prompt, not of A's cached one, so a hit cannot be observed by timing."""
    import urllib.request

    prompt = " ".join(f"word{i}" for i in range(100))

    def post(path: str, key: str, body: dict) -> tuple[dict, float]:
        req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}",
                                              "Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        return out, time.perf_counter() - t0

    first, _ = post("/v1/warm", "key-a", {"prompt": prompt})
    assert first["prompt_tokens"] > 250 and sum(first["reused_tokens"].values()) == 0
    again, _ = post("/v1/warm", "key-a", {"prompt": prompt})
    assert again["reused_tokens"]["device"] >= first["prompt_tokens"] - 16  # A's own hit
    other, _ = post("/v1/warm", "key-b", {"prompt": prompt})
    assert other["reused_tokens"] == {"device": 0, "host": 0}  # B: nothing of A's
    # timing, on a prompt only A has sent: A's answer comes from its cache, B's is
    # computed in full
    body = {"prompt": " ".join(f"other{i}" for i in range(100)), "max_tokens": 1,
            "temperature": 0}
    post("/v1/completions", "key-a", body)  # A caches this exact prompt
    hit = min(post("/v1/completions", "key-a", body)[1] for _ in range(3))
    cold = post("/v1/completions", "key-b", body)[1]
    assert cold > 3 * hit, (cold, hit)


def test_metrics_parse_and_move(server) -> None:
    before = scrape_metrics(server.url)
    client(server).completions.create(model="smollm2-135m", prompt="Hi", max_tokens=3)
    after = scrape_metrics(server.url)
    assert after["tidewire_generation_tokens_total"] >= before.get(
        "tidewire_generation_tokens_total", 0) + 3
    assert after["tidewire_prompt_tokens_total"] > before.get("tidewire_prompt_tokens_total", 0)
    assert after["tidewire_time_to_first_token_seconds_count"] > before.get(
        "tidewire_time_to_first_token_seconds_count", 0)
    assert after["tidewire_queue_time_seconds_count"] > before.get(  # arrival to admission
        "tidewire_queue_time_seconds_count", 0)
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
                    with pytest.raises(ConnectionClosed):
                        await second.recv()
                    return second.close_code

        assert asyncio.run(two_sockets()) == 1013


# -- HTTP API edges: errors, CORS, tokenize, model, version, logprob bytes, echo, lists --

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def tiny_server(tiny_models):
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)), dtype="float32"),
                           model_name="tiny", allowed_origins=(ORIGIN,))
    with run_server(config) as s:
        yield s


def http(url: str, method: str = "GET", body: object = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One plain request: (status, lower-cased headers, body), error statuses included."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def error_of(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_unknown_path_is_json_404_and_wrong_method_405(tiny_server) -> None:
    url = tiny_server.url
    for method, path in [("POST", "/nope"), ("GET", "/v1/nope/deeper"), ("DELETE", "/v2"),
                         ("PUT", "/sdk/missing.js"), ("GET", "/missing.html")]:
        status, headers, body = http(url + path, method)
        assert status == 404 and headers["content-type"] == "application/json", (method, path)
        assert error_of(body) | {"message": ""} == {"message": "", "type": "not_found_error",
                                                    "param": None, "code": "not_found"}
    for method, path, allow in [("GET", "/v1/chat/completions", "POST"),
                                ("DELETE", "/v1/completions", "POST"),
                                ("POST", "/v1/models", "GET, HEAD"), ("POST", "/", "GET, HEAD"),
                                ("POST", "/sdk/index.js", "GET, HEAD")]:
        status, headers, body = http(url + path, method)
        allowed = {m.strip() for m in headers["allow"].split(",")}  # (a set: any order)
        assert status == 405 and allowed == set(allow.split(", ")), (method, path)
        assert error_of(body)["code"] == "method_not_allowed"
    assert http(url + "/")[1]["content-type"].startswith("text/html")  # the chat page
    status, headers, _ = http(url + "/sdk/index.js")
    assert status == 200 and "javascript" in headers["content-type"]
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:  # the SDK reads the body as an error
        c.post("/nope", cast_to=object, body={})
    assert info.value.code == "not_found"


def _preflight(url: str, origin: str) -> tuple[int, dict[str, str]]:
    status, headers, _ = http(url + "/v1/chat/completions", "OPTIONS", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    return status, headers


def test_cors_follows_allowed_origins(tiny_server, server) -> None:
    status, h = _preflight(tiny_server.url, ORIGIN)
    assert status == 200 and h["access-control-allow-origin"] == ORIGIN
    assert "POST" in h["access-control-allow-methods"]
    assert {"authorization", "content-type", "x-stainless-os"} <= {
        x.strip() for x in h["access-control-allow-headers"].lower().split(",")}
    status, h = _preflight(tiny_server.url, "HTTPS://App.Example:443/")  # as session.py matches
    assert status == 200 and h["access-control-allow-origin"] == "HTTPS://App.Example:443/"
    status, h = _preflight(tiny_server.url, "https://evil.example")
    assert status >= 400 and "access-control-allow-origin" not in h
    # the actual request: granted to the listed origin only
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 1}
    _, h, _ = http(tiny_server.url + "/v1/completions", "POST", body, {"Origin": ORIGIN})
    assert h["access-control-allow-origin"] == ORIGIN and "retry-after" in h[
        "access-control-expose-headers"].lower()
    # a refused origin's request does not run at all (CORS alone would only hide the
    # answer; a text/plain POST needs no preflight)
    gw, submitted = tiny_server.gateway, []
    submit = gw.submit
    gw.submit = lambda *a, **k: (submitted.append(a), submit(*a, **k))[1]
    try:
        status, h, out = http(tiny_server.url + "/v1/completions", "POST", body,
                              {"Origin": "https://evil.example", "Content-Type": "text/plain"})
    finally:
        gw.submit = submit
    assert status == 403 and "access-control-allow-origin" not in h
    assert error_of(out)["code"] == "origin_not_allowed" and submitted == []
    # the default (no origins listed): same-origin only, nothing granted to any other
    status, h = _preflight(server.url, ORIGIN)
    assert status >= 400 and "access-control-allow-origin" not in h
    status, h, _ = http(server.url + "/v1/models", headers={"Origin": ORIGIN,
                                                            "Authorization": "Bearer key-a"})
    assert status == 403 and "access-control-allow-origin" not in h
    # same-origin (the Origin is the server's own address): the page's own requests
    assert http(server.url + "/v1/models", headers={"Origin": server.url,
                                                    "Authorization": "Bearer key-a"})[0] == 200


def test_cors_wildcard_and_websockets_pass_through(tiny_models) -> None:
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)), dtype="float32"),
                           model_name="tiny", allowed_origins=("*",))
    with run_server(config) as s:
        status, h = _preflight(s.url, "https://anywhere.example")
        assert status == 200 and h["access-control-allow-origin"] == "*"

        async def ready() -> str:  # the CORS layer leaves WebSocket scopes alone
            async with connect(s.ws_url, subprotocols=["tidewire.v1.json"]) as ws:
                return json.loads(await ws.recv())["type"]

        assert asyncio.run(ready()) == "ready"


def test_tokenize_and_detokenize(server, offline) -> None:
    auth = {"Authorization": "Bearer key-a"}
    url = server.url
    text = "The café is open, isn't it?"
    status, _, body = http(url + "/tokenize", "POST", {"model": "smollm2-135m", "prompt": text,
                                                       "return_token_strs": True}, auth)
    r = json.loads(body)
    want = offline.tokenizer.encode(text, add_special_tokens=False)
    max_len = client(server).models.list().data[0].max_model_len
    assert status == 200 and r == {"count": len(want), "max_model_len": max_len, "tokens": want,
                                   "token_strs": offline.tokenizer.convert_ids_to_tokens(want)}
    status, _, body = http(url + "/detokenize", "POST", {"tokens": want}, auth)
    assert status == 200 and json.loads(body) == {"prompt": text}
    # messages go through the chat endpoint's template: the count is its prompt_tokens
    _, _, body = http(url + "/tokenize", "POST", {"messages": MSGS}, auth)
    r = json.loads(body)
    chat = client(server).chat.completions.create(model="smollm2-135m", messages=MSGS,
                                                  max_tokens=1)
    assert r["count"] == chat.usage.prompt_tokens == len(r["tokens"]) and r["token_strs"] is None
    _, _, body = http(url + "/tokenize", "POST", {"messages": MSGS,
                                                  "add_generation_prompt": False}, auth)
    assert json.loads(body)["tokens"] == offline.tokenizer.apply_chat_template(
        MSGS, add_generation_prompt=False, tokenize=True, return_dict=False)
    for path, bad in [("/tokenize", {}), ("/tokenize", {"prompt": 5}),
                      ("/tokenize", {"prompt": "a", "messages": MSGS}),
                      ("/tokenize", {"prompt": "a", "frobnicate": 1}),
                      ("/tokenize", {"messages": [{"role": "user"}]}),
                      ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}),
                      ("/detokenize", {"tokens": "abc"}), ("/detokenize", {"tokens": [-1]}),
                      ("/detokenize", {"tokens": [10 ** 9]})]:
        status, _, body = http(url + path, "POST", bad, auth)
        assert status == 400 and error_of(body)["type"] == "invalid_request_error", (path, bad)
    status, _, body = http(url + "/tokenize", "POST", {"model": "gpt-9", "prompt": "a"}, auth)
    assert status == 404 and error_of(body)["code"] == "model_not_found"
    assert http(url + "/tokenize", "POST", {"prompt": "a"})[0] == 401  # the API key applies


def test_model_retrieve_and_version(server) -> None:
    c = client(server)
    m = c.models.retrieve("smollm2-135m")
    assert m.id == "smollm2-135m" and m.object == "model" and m.owned_by == "tidewire"
    assert m.model_dump() == c.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as info:
        c.models.retrieve("gpt-9")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").models.retrieve("smollm2-135m")
    status, body = http_get(server.url + "/version")
    assert status == 200
    assert json.loads(body) == {"version": importlib.metadata.version("tidewire"),
                                "model": "smollm2-135m", "max_model_len": m.max_model_len}


def _check_bytes(entries: list) -> bytes:
    """Each entry's (and alternative's) bytes; returns the chosen tokens' bytes joined."""
    for t in entries:
        assert t.bytes is not None and all(0 <= b < 256 for b in t.bytes)
        if "\ufffd" not in t.token:  # a whole character (or more): bytes are its UTF-8
            assert bytes(t.bytes) == t.token.encode()
        assert t.top_logprobs and all(alt.bytes is not None for alt in t.top_logprobs)
        assert t.top_logprobs[0].bytes == t.bytes  # greedy: the chosen token is the best
    return b"".join(bytes(t.bytes) for t in entries)


def test_chat_logprobs_carry_bytes(server) -> None:
    c = client(server)
    msgs = [{"role": "user", "content": "Write three emojis: 😀🎉🚀"}]
    kw = dict(model="smollm2-135m", messages=msgs, max_tokens=16, temperature=0, logprobs=True,
              top_logprobs=2, extra_body={"ignore_eos": True})
    r = c.chat.completions.create(**kw)
    # the bytes, joined, are the text: even where a token splits a character (its text
    # alone is then U+FFFD, and its bytes are what a client reassembles)
    content = r.choices[0].logprobs.content
    assert any("\ufffd" in t.token for t in content)
    assert _check_bytes(content).decode() == r.choices[0].message.content
    chunks = [ch for ch in c.chat.completions.create(**kw, stream=True)
              if ch.choices and ch.choices[0].logprobs]
    entries = [t for ch in chunks for t in ch.choices[0].logprobs.content]
    assert _check_bytes(entries).decode() == r.choices[0].message.content


PROMPTS = ["The sea is", "Once upon a time"]


def test_completions_list_of_prompts_and_echo(server, offline) -> None:
    c = client(server)
    wants = offline.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))
    r = c.completions.create(model="smollm2-135m", prompt=PROMPTS, n=2, max_tokens=6,
                             temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]  # n per prompt, in prompt order
    assert [ch.text for ch in r.choices] == [w.text for w in wants for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in wants)
    assert r.usage.completion_tokens == sum(2 * len(w.token_ids) for w in wants)
    # echo: the prompt in front of each choice's text, streaming or not
    r = c.completions.create(model="smollm2-135m", prompt=PROMPTS, max_tokens=6, temperature=0,
                             echo=True)
    assert [ch.text for ch in r.choices] == [p + w.text for p, w in zip(PROMPTS, wants)]
    texts = {0: "", 1: ""}
    finished = set()
    for part in c.completions.create(model="smollm2-135m", prompt=PROMPTS, max_tokens=6,
                                     temperature=0, echo=True, stream=True):
        for ch in part.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert texts == {0: PROMPTS[0] + wants[0].text, 1: PROMPTS[1] + wants[1].text}
    assert finished == {0, 1}
    # echo with logprobs: the prompt's tokens lead the list, with no logprob of their own
    r = c.completions.create(model="smollm2-135m", prompt=PROMPTS[0], max_tokens=6,
                             temperature=0, echo=True, logprobs=1)
    lp, k = r.choices[0].logprobs, len(wants[0].prompt_token_ids)
    assert "".join(lp.tokens) == r.choices[0].text == PROMPTS[0] + wants[0].text
    assert lp.token_logprobs[:k] == [None] * k and all(x <= 0 for x in lp.token_logprobs[k:])
    assert len(lp.tokens) == k + len(wants[0].token_ids)
    with pytest.raises(openai.BadRequestError, match="echo"):
        c.chat.completions.create(model="smollm2-135m", messages=MSGS,
                                  extra_body={"echo": True})


def test_completions_token_id_prompts(tiny_server) -> None:
    c = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12]]
    kw = dict(model="tiny", prompt=prompts, n=2, max_tokens=4, temperature=0,
              extra_body={"ignore_eos": True})
    r = c.completions.create(**kw)
    assert [ch.index for ch in r.choices] == list(range(6))
    assert all(ch.finish_reason == "length" for ch in r.choices)
    assert r.usage.prompt_tokens == 8 and r.usage.completion_tokens == 6 * 4
    done, usage = {}, []
    for part in c.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for ch in part.choices:
            if ch.finish_reason:
                done[ch.index] = ch.finish_reason
        if part.usage:
            usage.append(part.usage.completion_tokens)
    assert done == {i: "length" for i in range(6)}
    assert usage == [6 * 4]  # one usage chunk, summed over the prompts
    for bad in [[], [[]], [5, "a"], [[5], "a", [7.5]], [True]]:
        with pytest.raises(openai.BadRequestError, match="prompt"):
            c.completions.create(model="tiny", prompt=bad, max_tokens=2)
    # one prompt refused: none runs, and the admitted ones are released
    with pytest.raises(openai.BadRequestError, match="context window"):
        c.completions.create(model="tiny", prompt=[[5, 6], [5] * 1020], max_tokens=10)
    gw, eng = tiny_server.gateway, tiny_server.engine
    for _ in range(500):
        if not gw.inflight_total and not eng.has_unfinished():
            break
        time.sleep(0.01)
    assert gw.inflight_total == 0 and not eng.has_unfinished()


def test_warm_names_the_served_model_or_none(tiny_server) -> None:
    url = tiny_server.url + "/v1/warm"
    status, _, body = http(url, "POST", {"prompt": [5, 6, 7, 8], "model": "gpt-9"})
    assert status == 404 and error_of(body)["code"] == "model_not_found"
    model = json.loads(http(tiny_server.url + "/v1/models")[2])["data"][0]["id"]
    for extra in ({"model": model}, {}):
        status, _, body = http(url, "POST", {"prompt": [5, 6, 7, 8], **extra})
        assert status == 200 and json.loads(body)["prompt_tokens"] == 4


def test_only_exact_api_keys_are_accepted(server) -> None:
    """Keys are looked up by digest and compared in constant time: a prefix, an
    extension, another case or an empty key of a valid one is refused; the key itself
    (with the header's spacing) is accepted."""
    for bad in ("key-", "key-ab", "KEY-A", "key-a.", "ey-a"):
        with pytest.raises(openai.AuthenticationError):
            client(server, bad).models.list()
    assert http_get(server.url + "/v1/models", {"Authorization": "Bearer "})[0] == 401
    assert client(server, "key-a").models.list().data[0].id == "smollm2-135m"
    status, _ = http_get(server.url + "/v1/models", {"Authorization": "Bearer   key-b  "})
    assert status == 200


def test_bodies_over_the_message_limit_and_bad_json_are_refused(tiny_models) -> None:
    """Every JSON endpoint reads at most --max-message-bytes: a larger body is 413
    message_too_big, declared (Content-Length) or streamed (chunked), and nothing is
    admitted; JSON nested too deeply is 400, not 500."""
    import http.client

    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)),
                                               dtype="float32"),
                           limits=Limits(max_message_bytes=4096))
    with run_server(config) as s:
        host, port = s.url.split("//")[1].split(":")
        big = json.dumps({"prompt": "x" * 5000}).encode()

        def post(path: str, body: bytes, chunked: bool = False) -> tuple[int, dict]:
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            headers = {"Content-Type": "application/json"}
            if chunked:
                conn.request("POST", path, body=iter([body[:2000], body[2000:]]),
                             headers=headers, encode_chunked=True)
            else:
                conn.request("POST", path, body=body, headers=headers)
            r = conn.getresponse()
            out = r.status, json.loads(r.read())
            conn.close()
            return out

        for path in ("/v1/completions", "/v1/chat/completions", "/v1/warm", "/tokenize"):
            for chunked in (False, True):
                status, err = post(path, big, chunked)
                assert status == 413 and err["error"]["code"] == "message_too_big", (path, err)
        status, err = post("/v1/completions", b"[" * 1500 + b"]" * 1500)
        assert status == 400 and "nested too deeply" in err["error"]["message"]
        assert post("/v1/completions", json.dumps({"prompt": [5, 6], "max_tokens": 2}).encode()
                    )[0] == 200
        deadline = time.monotonic() + 10  # (the engine finishes its bookkeeping after the reply)
        while s.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not s.engine.has_unfinished()


def test_metrics_behind_their_own_key(tiny_models) -> None:
    """With --metrics-key, /metrics answers 401 without it (or with a tenant's API key)
    and the Prometheus text with it; /health stays open."""
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)),
                                               dtype="float32"),
                           api_keys={"tenant-key": "t"}, metrics_key="scrape-key")
    with run_server(config) as s:
        for headers in ({}, {"Authorization": "Bearer tenant-key"},
                        {"Authorization": "Bearer scrape-ke"}):
            status, body = http_get(s.url + "/metrics", headers)
            assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized"
        status, body = http_get(s.url + "/metrics", {"Authorization": "Bearer scrape-key"})
        assert status == 200 and b"tidewire_" in body
        assert http_get(s.url + "/health")[0] == 200

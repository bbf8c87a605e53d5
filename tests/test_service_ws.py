"""The WebSocket protocol against the real app under uvicorn on a free port, with the
`websockets` client."""

from __future__ import annotations

import asyncio
import json
import random
import re

import msgpack
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from engine import LLM, EngineConfig, SamplingParams
from service.config import Limits, ServiceConfig
from tests.servers import apoll, http_get, run_server, scrape_metrics

JSON, MSGPACK = "tidewire.v1.json", "tidewire.v1.msgpack"
QUESTIONS = ["What is the capital of France?", "Name a color.", "Count to five.",
             "Say hi in French."]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    config = ServiceConfig(engine=EngineConfig(model="smollm2-135m", dtype="float32"),
                           limits=Limits(max_inflight_per_connection=8,
                                         max_message_bytes=64 * 1024))
    with run_server(config) as s:
        yield s


class Client:
    """A thin test client: send dicts, receive dicts, in either subprotocol."""

    def __init__(self, ws, proto: str) -> None:
        self.ws, self.proto = ws, proto

    async def send(self, msg: dict) -> None:
        await self.ws.send(msgpack.packb(msg) if self.proto == MSGPACK else json.dumps(msg))

    async def recv(self, timeout: float = 60) -> dict:
        data = await asyncio.wait_for(self.ws.recv(), timeout)
        return msgpack.unpackb(data) if self.proto == MSGPACK else json.loads(data)

    async def until_done(self, ids: set[str]) -> list[dict]:
        """Every message until each id has its `done`."""
        msgs, pending = [], set(ids)
        while pending:
            m = await self.recv()
            msgs.append(m)
            if m["type"] == "done":
                pending.discard(m["id"])
        return msgs


async def open_client(server, proto: str = JSON, **kw) -> tuple[object, Client]:
    ws = await connect(server.ws_url, subprotocols=[proto], **kw)
    c = Client(ws, proto)
    ready = c.ready = await c.recv()
    assert ready["type"] == "ready" and ready["protocol"] == proto
    assert ready["model"] == "smollm2-135m" and ws.subprotocol == proto
    return ws, c


def resumable(tiny_models) -> ServiceConfig:  # noqa: ANN001 - the fixture
    """A tiny model's server whose dropped sockets' requests stay resumable for 30 s."""
    return ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)), dtype="float32"),
                         limits=Limits(resume_grace=30))


async def wait_free(server, timeout: float = 10.0) -> None:
    eng = server.engine
    for _ in range(int(timeout / 0.01)):
        if eng.kv.num_free_blocks == eng.num_blocks and not eng.has_unfinished():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("blocks were not returned to the pool")


def gen(rid: str, q: str, **params) -> dict:
    p = {"max_tokens": 24, "temperature": 0.0, **params}
    return {"type": "generate", "id": rid, "messages": [{"role": "user", "content": q}],
            "params": p}


async def still_serves(c: Client, rid: str = "after") -> None:
    """The socket is open and working: a request on it runs to its done."""
    await c.send(gen(rid, "Name a color.", max_tokens=3))
    msgs = await c.until_done({rid})
    assert msgs[-1]["type"] == "done" and msgs[-1]["status"] == "completed"
    assert not [m for m in msgs if m["type"] == "error"]


def error_count(server, code: str) -> float:
    """tidewire_errors_total for one code."""
    body = http_get(server.url + "/metrics")[1].decode()
    found = re.search(rf'^tidewire_errors_total{{code="{code}"}} (\S+)$', body, re.M)
    return float(found.group(1)) if found else 0.0


def error_frame(m: dict, code: str, rid: str | None = None) -> str:
    """Check an error frame's exact shape; its message, for further checks."""
    want = {"type", "code", "message", "retryable"} | ({"id"} if rid is not None else set())
    assert m["type"] == "error" and set(m) == want, m
    assert m["code"] == code and m["retryable"] is False and m.get("id") == rid, m
    return m["message"]


async def test_concurrent_generates_interleave_and_match_offline(server) -> None:
    ws, c = await open_client(server)
    async with ws:
        for i, q in enumerate(QUESTIONS):
            await c.send(gen(f"q{i}", q))
        msgs = await c.until_done({f"q{i}" for i in range(4)})
    by_id = {f"q{i}": [m for m in msgs if m.get("id") == f"q{i}"] for i in range(4)}
    order = [m["id"] for m in msgs if m["type"] == "delta"]
    assert len(set(order[:8])) > 1  # deltas of different requests interleave
    offline = LLM(model="smollm2-135m", dtype="float32").chat(
        [[{"role": "user", "content": q}] for q in QUESTIONS],
        SamplingParams(max_tokens=24, temperature=0.0))
    for i, ms in enumerate(by_id.values()):
        kinds = [m["type"] for m in ms]
        assert kinds[0] == "start" and kinds[-1] == "done" and kinds.count("done") == 1
        deltas = [m for m in ms if m["type"] == "delta"]
        assert [d["seq"] for d in deltas] == list(range(1, len(deltas) + 1))
        assert "".join(d["text"] for d in deltas) == offline[i].text
        assert sum((d["token_ids"] for d in deltas), []) == offline[i].token_ids
        done = ms[-1]
        assert done["status"] == "completed" and done["finish_reason"] == offline[i].finish_reason
        assert done["usage"]["completion_tokens"] == len(offline[i].token_ids)
        assert set(done["timings"]) == {"queue_ms", "ttft_ms", "tokens_per_s", "total_ms"}
    await wait_free(server)


async def test_per_delta_metrics_count_every_delta_and_token(server) -> None:
    """Deltas are written on the fan-out path and observed afterwards: each delta
    written counts once in the delivery histogram, the first of a request in TTFT and
    the rest in inter-token latency, and every token in the generation counter."""
    before = scrape_metrics(server.url)
    ws, c = await open_client(server, MSGPACK)
    async with ws:
        for i, q in enumerate(QUESTIONS[:2]):
            await c.send(gen(f"m{i}", q, max_tokens=12, ignore_eos=True))
        msgs = await c.until_done({"m0", "m1"})
    await asyncio.sleep(0.05)  # (a scrape is a separate request; the loop has moved on)
    after = scrape_metrics(server.url)
    deltas = [m for m in msgs if m["type"] == "delta"]
    tokens = sum(len(d["token_ids"]) for d in deltas)
    with_tokens = sum(1 for d in deltas if d["token_ids"])

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert tokens == 24 and moved("tidewire_generation_tokens_total") == tokens
    assert moved("tidewire_delta_delivery_seconds_count") == len(deltas)
    assert moved("tidewire_time_to_first_token_seconds_count") == 2
    assert moved("tidewire_inter_token_latency_seconds_count") == with_tokens - 2
    assert 0 < moved("tidewire_delta_delivery_seconds_sum") < len(deltas)  # seconds, each < 1


async def test_cancel_mid_stream(server) -> None:
    ws, c = await open_client(server)
    async with ws:
        await c.send(gen("long", "Tell me a long story.", max_tokens=400, ignore_eos=True))
        while (await c.recv())["type"] != "delta":
            pass
        await c.send({"type": "cancel", "id": "long"})
        msgs = await c.until_done({"long"})
        done = msgs[-1]
        assert done["status"] == "cancelled" and done["finish_reason"] == "cancelled"
        assert done["usage"]["completion_tokens"] < 400
        await wait_free(server)
        await c.send({"type": "ping", "t": 7})  # the socket stays usable
        assert await c.recv() == {"type": "pong", "t": 7}


async def test_closing_the_socket_frees_blocks_within_a_step(server) -> None:
    ws, c = await open_client(server)
    for i in range(3):
        await c.send(gen(f"x{i}", "Tell me a long story.", max_tokens=400, ignore_eos=True))
    while (await c.recv())["type"] != "delta":
        pass
    assert server.engine.has_unfinished()
    await ws.close()
    steps = server.engine.num_steps
    await wait_free(server)
    assert server.engine.num_steps - steps <= 2  # the close is seen, then one step at most


@pytest.mark.parametrize("frame,code", [
    ("not json", "invalid_request"),
    ('["a list"]', "invalid_request"),
    ('{"type": "bogus"}', "invalid_request"),
    ('{"type": "generate", "id": "a"}', "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "params": {"temperature": -1}}',
     "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "params": {"nope": 1}}', "invalid_request"),
    ('{"type": "generate", "id": "", "prompt": "x"}', "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt_token_ids": [1, 99999999]}', "invalid_request"),
])
async def test_bad_frames_get_an_error_and_the_socket_stays_open(server, frame, code) -> None:
    ws, c = await open_client(server)
    async with ws:
        await ws.send(frame)
        err = await c.recv()
        assert err["type"] == "error" and err["code"] == code and err["retryable"] is False
        assert "temperature" in err["message"] if "temperature" in frame else True
        await c.send(gen("ok", "Name a color.", max_tokens=4))
        msgs = await c.until_done({"ok"})
        assert msgs[-1]["status"] == "completed"


async def test_duplicate_id_too_many_inflight_and_context_length(server) -> None:
    ws, c = await open_client(server)
    async with ws:
        await c.send(gen("d", "Tell me a story.", max_tokens=200, ignore_eos=True))
        await c.send(gen("d", "Again."))
        err = await c.recv()
        while err["type"] != "error":
            err = await c.recv()
        assert err["code"] == "duplicate_id" and err["id"] == "d"
        for i in range(8):
            await c.send(gen(f"m{i}", "Hi.", max_tokens=200, ignore_eos=True))
        errs = []
        while not errs:
            m = await c.recv()
            if m["type"] == "error":
                errs.append(m)
        assert errs[0]["code"] == "too_many_inflight" and errs[0]["retryable"] is True
        for rid in ["d"] + [f"m{i}" for i in range(7)]:  # m7 was refused: not in flight
            await c.send({"type": "cancel", "id": rid})
        await c.until_done({"d"} | {f"m{i}" for i in range(7)})
        await c.send({"type": "generate", "id": "big", "prompt_token_ids": [5] * 8000,
                      "params": {"max_tokens": 500}})
        err = await c.recv()
        assert err["code"] == "context_length_exceeded" and err["id"] == "big"
    await wait_free(server)


@pytest.mark.parametrize("proto", [JSON, MSGPACK])
async def test_message_too_big_answers_an_error_and_the_socket_stays_open(server, proto) -> None:
    """Over max_message_bytes (64 KiB here, stated in `ready`) but under the hard cap
    (4x): message_too_big naming the request, and the socket goes on serving."""
    ws, c = await open_client(server, proto)
    async with ws:
        assert c.ready["limits"]["max_message_bytes"] == 64 * 1024
        await c.send({"type": "generate", "id": "huge", "prompt": "a" * 70_000})
        msg = error_frame(await c.recv(), "message_too_big", "huge")
        assert "70" in msg and str(64 * 1024) in msg and "max_message_bytes" in msg
        await c.send({"type": "ping", "t": 1, "pad": "b" * 70_000})  # no valid id: none named
        error_frame(await c.recv(), "message_too_big")
        # over twice the limit: not decoded (the loop's time), so no id even with one
        await c.send({"type": "generate", "id": "huger", "prompt": "a" * 140_000})
        error_frame(await c.recv(), "message_too_big")
        await still_serves(c)


async def test_text_frames_are_measured_in_utf8_bytes(server) -> None:
    """40,000 characters of "é" are 80,000 bytes on the wire: over 64 KiB."""
    ws, c = await open_client(server, JSON)
    async with ws:
        # sent as raw UTF-8 (no \u escapes): 40,000 characters, 80,000 bytes
        await ws.send(json.dumps({"type": "generate", "id": "accents", "prompt": "é" * 40_000},
                                 ensure_ascii=False))
        msg = error_frame(await c.recv(), "message_too_big", "accents")
        assert "of 80051 bytes" in msg  # 80,000 + the 51 bytes around the prompt
        await still_serves(c)


@pytest.mark.parametrize("proto", [JSON, MSGPACK])
async def test_over_the_hard_cap_an_error_frame_then_1009(server, proto) -> None:
    """Past the hard cap the protocol layer refuses to buffer the message: the error
    frame, in the socket's own encoding, comes just before the 1009 close."""
    before = error_count(server, "message_too_big")
    ws, c = await open_client(server, proto)
    await c.send({"type": "generate", "id": "vast", "prompt": "a" * 300_000})
    msg = error_frame(await c.recv(), "message_too_big")  # unread, so its id is unknown
    assert str(4 * 64 * 1024) in msg and "1009" in msg
    with pytest.raises(ConnectionClosed) as info:
        await c.recv()
    assert info.value.rcvd.code == 1009
    for _ in range(200):  # counted when the app sees the disconnect
        if error_count(server, "message_too_big") == before + 1:
            break
        await asyncio.sleep(0.01)
    assert error_count(server, "message_too_big") == before + 1


@pytest.mark.parametrize("proto", [JSON, MSGPACK])
async def test_cancel_of_an_unknown_or_finished_id_is_unknown_id(server, proto) -> None:
    ws, c = await open_client(server, proto)
    async with ws:
        await c.send({"type": "cancel", "id": "never-sent"})
        msg = error_frame(await c.recv(), "unknown_id", "never-sent")
        assert "never-sent" in msg
        await c.send(gen("fin", "Name a color.", max_tokens=2))
        await c.until_done({"fin"})
        await c.send({"type": "cancel", "id": "fin"})  # its done is sent: no longer tracked
        error_frame(await c.recv(), "unknown_id", "fin")
        await still_serves(c)


@pytest.mark.parametrize("proto,frame,message", [
    (JSON, "not json", "message is not valid JSON: Expecting value at line 1 column 1"),
    (JSON, '{"type": "ping",\n "t": }',
     "message is not valid JSON: Expecting value at line 2 column 7"),
    (JSON, '{"type": "ping"} x', "message is not valid JSON: Extra data at line 1 column 18"),
    (JSON, b'{"type": "\xff"}', "message is not valid JSON: not UTF-8 text"),
    (JSON, '["a list"]', "a message must be an object, got an array"),
    (JSON, '"ping"', "a message must be an object, got a string"),
    (MSGPACK, '{"type": "ping"}',
     "the msgpack subprotocol expects binary frames; got a text frame"),
    (MSGPACK, b"", "message is not valid msgpack: incomplete input"),
    (MSGPACK, b"\x82\xa4type", "message is not valid msgpack: incomplete input"),
    (MSGPACK, b"\xc1", "message is not valid msgpack: a byte that starts no msgpack type"),
    (MSGPACK, msgpack.packb({"type": "ping"}) + b"\x01",
     "message is not valid msgpack: bytes left over after the first value"),
    (MSGPACK, msgpack.packb({1: "ping"}),
     "message is not valid msgpack: map keys must be strings, got a key of type int"),
    (MSGPACK, b"\xa1\xff", "message is not valid msgpack: a string is not valid UTF-8"),
    (MSGPACK, msgpack.packb(["a list"]), "a message must be a map, got an array"),
    (MSGPACK, msgpack.packb(None), "a message must be a map, got nil"),
])
async def test_decode_errors_say_what_was_wrong(server, proto, frame, message) -> None:
    ws, c = await open_client(server, proto)
    async with ws:
        await ws.send(frame)
        assert error_frame(await c.recv(), "invalid_request").startswith(message)
        await still_serves(c)


async def test_msgpack_and_json_give_identical_event_sequences(server) -> None:
    seqs = []
    for proto in (JSON, MSGPACK):
        ws, c = await open_client(server, proto)
        async with ws:
            await c.send(gen("same", "Name three fruits.", max_tokens=16))
            msgs = await c.until_done({"same"})
        seqs.append([(m["type"], m.get("seq"), m.get("text"), m.get("token_ids"),
                      m.get("finish_reason")) for m in msgs])
    assert seqs[0] == seqs[1] and len(seqs[0]) > 3


async def test_fuzzed_frames_leave_the_server_healthy(server) -> None:
    rng = random.Random(1234)
    keys = ["type", "id", "prompt", "messages", "params", "prompt_token_ids", "t", "x",
            "after_seq", "session_id"]
    values = [None, 0, -1, 1.5, "", "generate", "cancel", "ping", [], {}, [1, "a"],
              {"max_tokens": -3}, {"temperature": "hot"}, "a" * 50, [{"role": 1}], True]
    ws, c = await open_client(server)
    async with ws:
        for _ in range(1000):
            kind = rng.random()
            if kind < 0.3:
                frame = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40)))
                await ws.send(frame.decode("latin-1"))
            else:
                msg = {rng.choice(keys): rng.choice(values) for _ in range(rng.randint(0, 5))}
                if kind < 0.6:
                    msg["type"] = rng.choice(["generate", "cancel", "ping", "warm", "resume", "?"])
                if msg.get("type") == "generate":
                    msg["params"] = {"max_tokens": 1}
                await ws.send(json.dumps(msg))
        await c.send({"type": "ping", "t": "after"})
        seen = []
        while True:
            m = await c.recv()
            seen.append(m)
            if m == {"type": "pong", "t": "after"}:
                break
        assert all(m["type"] in {"error", "pong", "start", "delta", "done"} for m in seen)
        assert all(m["code"] in {"invalid_request", "duplicate_id", "too_many_inflight",
                                 "unknown_id"}
                   for m in seen if m["type"] == "error")
        await c.send(gen("alive", "Name a color.", max_tokens=4))
        msgs = await c.until_done({"alive"})
        assert msgs[-1]["status"] == "completed"
    await wait_free(server)


async def origin_verdict(url: str, origin: str | None) -> int:
    """101 if a handshake with this Origin (None: no header) is accepted, else its status."""
    try:
        async with connect(url, subprotocols=[JSON], origin=origin) as ws:
            assert json.loads(await ws.recv())["type"] == "ready"
            return 101
    except InvalidStatus as e:
        return e.response.status_code


async def test_origin_allow_list_and_idle_timeout(tiny_models) -> None:
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)), dtype="float32"),
                           allowed_origins=("http://good.example",),
                           limits=Limits(idle_timeout=0.5))
    with run_server(config) as s:
        assert await origin_verdict(s.ws_url, "http://evil.example") == 403
        assert await origin_verdict(s.ws_url, "http://good.example") == 101
        assert await origin_verdict(s.ws_url, None) == 101  # SDKs, curl: keys guard those
        assert await origin_verdict(s.ws_url, s.url) == 101  # same-origin (the chat page)
        async with connect(s.ws_url, subprotocols=[JSON], origin="http://good.example") as ws:
            assert json.loads(await ws.recv())["type"] == "ready"
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 5)  # closed for idleness, not timed out here


async def test_default_origin_policy_is_same_origin_only(server) -> None:
    """No allowed_origins: a browser page from another origin is refused; one served by
    this server, and any client that sends no Origin, are not."""
    port = server.url.rsplit(":", 1)[1]
    assert await origin_verdict(server.ws_url, None) == 101
    assert await origin_verdict(server.ws_url, server.url) == 101
    assert await origin_verdict(server.ws_url, f"HTTP://127.0.0.1:{port}/") == 101
    assert await origin_verdict(server.ws_url, "http://evil.example") == 403
    assert await origin_verdict(server.ws_url, f"http://localhost:{port}") == 403  # other host
    assert await origin_verdict(server.ws_url, "http://127.0.0.1:1") == 403  # other port
    assert await origin_verdict(server.ws_url, "null") == 403


@pytest.mark.parametrize("origin,host,allowed,ok", [
    (None, "a.example", (), True),
    ("http://a.example:8000", "a.example:8000", (), True),
    ("https://a.example", "a.example", (), True),
    ("https://a.example", "a.example:443", (), True),
    ("http://a.example", "a.example:8000", (), False),
    ("http://[::1]:8000", "[::1]:8000", (), True),
    ("http://b.example", "a.example", (), False),
    ("http://b.example", None, (), False),
    ("http://b.example", "a.example", ("*",), True),
    ("null", "a.example", ("*",), True),
    ("null", "a.example", (), False),
    ("http://b.example", "a.example", ("http://b.example",), True),
    ("http://B.example", "a.example", ("http://b.example:80/",), True),
    ("https://b.example", "a.example", ("http://b.example",), False),
    ("http://b.example:8080", "a.example", ("http://b.example",), False),
    ("http://c.example", "a.example", ("http://b.example",), False),
    ("http://a.example", "a.example", ("http://b.example",), True),
    ("http://b.example:bad", "a.example", ("http://b.example",), False),
])
def test_origin_allowed_semantics(origin, host, allowed, ok) -> None:
    from service.origins import origin_allowed

    assert origin_allowed(origin, host, allowed) is ok


async def test_graceful_shutdown_drains_then_closes_1001(smollm2_dir) -> None:
    config = ServiceConfig(engine=EngineConfig(model="smollm2-135m"), shutdown_grace=30)
    with run_server(config) as s:
        ws, c = await open_client(s)
        await c.send(gen("last", "Tell me a story.", max_tokens=40, ignore_eos=True))
        while (await c.recv())["type"] != "delta":
            pass
        s.server.should_exit = True
        msgs = await c.until_done({"last"})
        assert msgs[-1]["status"] == "completed" and msgs[-1]["usage"]["completion_tokens"] == 40
        with pytest.raises(ConnectionClosed) as info:
            await c.recv()
        assert info.value.rcvd.code == 1001


async def test_queued_frame_when_the_batch_is_full(tiny_models) -> None:
    from engine import SchedulerConfig

    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)), dtype="float32",
                                               scheduler=SchedulerConfig(max_num_seqs=1)))
    with run_server(config) as s:
        ws, c = await open_client(s)
        async with ws:
            await c.send({"type": "generate", "id": "first", "prompt_token_ids": [5, 6, 7],
                          "params": {"max_tokens": 300, "ignore_eos": True}})
            while (await c.recv())["type"] != "start":
                pass
            await c.send({"type": "generate", "id": "second", "prompt_token_ids": [8, 9],
                          "params": {"max_tokens": 3, "ignore_eos": True}})
            msgs = await c.until_done({"first", "second"})
        second = [m for m in msgs if m.get("id") == "second"]
        assert second[0] == {"type": "queued", "id": "second", "position": 0}
        assert [m["type"] for m in second][1] == "start" and second[-1]["status"] == "completed"


async def test_engine_failure_is_internal_error_and_unhealthy(tiny_models) -> None:
    from engine.llm_engine import MAX_STEP_FAULTS

    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)), dtype="float32"))
    with run_server(config) as s:
        ws, c = await open_client(s)
        async with ws:
            await c.send({"type": "generate", "id": "ok", "prompt_token_ids": [5, 6],
                          "params": {"max_tokens": 400, "ignore_eos": True}})
            while (await c.recv())["type"] != "delta":
                pass

            def broken(*args, **kwargs):
                raise RuntimeError("simulated kernel failure")

            s.engine.runner.execute = broken  # every step raises on the engine thread
            msgs = await c.until_done({"ok"})
            err = [m for m in msgs if m["type"] == "error"]
            assert err and err[0]["code"] == "internal_error" and err[0]["retryable"] is True
            assert "model step (RuntimeError)" in err[0]["message"]  # (no exception text)
            assert msgs[-1]["status"] == "failed" and msgs[-1]["finish_reason"] == "error"
            from tests.servers import http_get

            assert http_get(s.url + "/health")[0] == 200  # one failed batch is not a dead engine
            for i in range(MAX_STEP_FAULTS - 1):  # a model that fails every step is
                await c.send({"type": "generate", "id": f"f{i}", "prompt_token_ids": [5, 6]})
                assert (await c.until_done({f"f{i}"}))[-1]["status"] == "failed"
        assert http_get(s.url + "/health")[0] == 503
        ws, c = await open_client(s)
        async with ws:  # new work is refused cleanly, not hung
            await c.send({"type": "generate", "id": "late", "prompt_token_ids": [5]})
            m = await c.recv()
            assert m["type"] == "error" and m["code"] == "internal_error"


async def test_slow_consumer_gets_an_error_and_its_request_aborted(tiny_models) -> None:
    import socket

    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)), dtype="float32"),
                           limits=Limits(send_queue=4, slow_consumer_timeout=0.5))
    with run_server(config) as s:
        host, port = s.url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that lags
        sock.connect((host, int(port)))
        async with connect(s.ws_url, sock=sock, subprotocols=[JSON], max_size=None) as ws:
            c = Client(ws, JSON)
            assert (await c.recv())["type"] == "ready"
            await c.send({"type": "generate", "id": "flood", "prompt_token_ids": [5, 6, 7],
                          "params": {"max_tokens": 1000, "ignore_eos": True, "logprobs": 20,
                                     "n": 16, "temperature": 1.0}})
            eng = s.engine
            for _ in range(1000):  # stop reading until the server gives up on us
                if eng.num_steps > 50 and not eng.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            assert not eng.has_unfinished() and eng.kv.num_free_blocks == eng.num_blocks
            msgs = await c.until_done({"flood"})
            err = [m for m in msgs if m["type"] == "error"]
            assert err and err[0]["code"] == "slow_consumer" and err[0]["retryable"] is True
            deltas = [m for m in msgs if m["type"] == "delta"]
            assert [d["seq"] for d in deltas] == list(range(1, len(deltas) + 1))  # none lost
            assert msgs[-1]["usage"]["completion_tokens"] < 16 * 1000


async def test_per_key_inflight_limit_spans_sockets(tiny_models) -> None:
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)), dtype="float32"),
                           api_keys={"k": "t"}, limits=Limits(max_inflight_per_key=1))
    auth = {"Authorization": "Bearer k"}
    with run_server(config) as s:
        ws1, c1 = await open_client(s, additional_headers=auth)
        ws2, c2 = await open_client(s, additional_headers=auth)
        async with ws1, ws2:
            await c1.send({"type": "generate", "id": "a", "prompt_token_ids": [5],
                           "params": {"max_tokens": 900, "ignore_eos": True}})
            while (await c1.recv())["type"] != "delta":
                pass
            await c2.send({"type": "generate", "id": "b", "prompt_token_ids": [6]})
            err = await c2.recv()
            assert err["code"] == "too_many_inflight" and "key" in err["message"]
            await c1.send({"type": "cancel", "id": "a"})
            await c1.until_done({"a"})
            await c2.send({"type": "generate", "id": "b", "prompt_token_ids": [6],
                           "params": {"max_tokens": 2}})
            assert (await c2.until_done({"b"}))[-1]["status"] == "completed"


async def test_an_open_server_has_no_per_key_limit(tiny_models) -> None:
    # without --api-keys every caller is the one anonymous principal: a per-key limit
    # would cap the whole server, so it applies to keyed deployments only
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)), dtype="float32"),
                           limits=Limits(max_inflight_per_key=1))
    with run_server(config) as s:
        ws1, c1 = await open_client(s)
        ws2, c2 = await open_client(s)
        async with ws1, ws2:
            await c1.send({"type": "generate", "id": "a", "prompt_token_ids": [5],
                           "params": {"max_tokens": 900, "ignore_eos": True}})
            while (await c1.recv())["type"] != "delta":
                pass
            await c2.send({"type": "generate", "id": "b", "prompt_token_ids": [6],
                           "params": {"max_tokens": 2}})
            assert (await c2.until_done({"b"}))[-1]["status"] == "completed"
            await c1.send({"type": "cancel", "id": "a"})
            assert (await c1.until_done({"a"}))[-1]["status"] == "cancelled"


async def test_resume_after_a_drop_continues_the_stream_exactly(server) -> None:
    """A dropped socket's request is parked (blocks freed at once); a new socket resumes
    it with the last seq it holds, gets what it missed merged into one delta, and the
    stream goes on to the same greedy text as offline, with exactly one done."""
    q = "Tell me a long story about a lighthouse."
    ws, c = await open_client(server)
    ready_sid = c.ready["session_id"]
    assert "resume" in c.ready["features"] and c.ready["limits"]["resume_grace_s"] == 30
    await c.send(gen("story", q, max_tokens=48, ignore_eos=True))
    deltas = []
    while len(deltas) < 4:
        m = await c.recv()
        if m["type"] == "delta":
            deltas.append(m)
    await ws.close()
    await wait_free(server)  # parked: out of the batch, every block back in the pool
    assert "story" in server.gateway.parked.sockets[ready_sid].lives
    kept = deltas[:2]  # pretend the last two deltas were lost with the connection
    ws, c = await open_client(server)
    async with ws:
        await c.send({"type": "resume", "id": "story", "after_seq": 2,
                      "session_id": ready_sid})
        msgs = await c.until_done({"story"})
        assert msgs[0] == {"type": "resumed", "id": "story", "after_seq": 2}
        more = [m for m in msgs if m["type"] == "delta"]
        assert [d["seq"] for d in more] == list(range(3, 3 + len(more)))
        lost = deltas[2:]  # come back merged into the first resumed delta
        assert more[0]["text"].startswith("".join(d["text"] for d in lost))
        assert more[0]["token_ids"][:4] == sum((d["token_ids"] for d in lost), [])[:4]
        done = msgs[-1]
        assert [m["type"] for m in msgs].count("done") == 1 and done["status"] == "completed"
        assert done["usage"]["completion_tokens"] == 48
        offline = LLM(model="smollm2-135m", dtype="float32").chat(
            [[{"role": "user", "content": q}]],
            SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[0]
        got = kept + more
        assert "".join(d["text"] for d in got) == offline.text
        assert sum((d["token_ids"] for d in got), []) == offline.token_ids
        # It is delivered: there is nothing left to resume.
        await c.send({"type": "resume", "id": "story", "after_seq": 0, "session_id": ready_sid})
        err = await c.recv()
        assert err["type"] == "error" and err["code"] == "invalid_request"
    assert ready_sid not in server.gateway.parked.sockets
    await wait_free(server)


async def test_resume_refusals_expiry_and_a_request_that_finished_while_away(tiny_models) -> None:
    from tests.servers import http_get

    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)), dtype="float32"),
                           api_keys={"ka": "alice", "kb": "bob"},
                           limits=Limits(resume_grace=1.5))
    alice, bob = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
    with run_server(config) as s:
        gw = s.gateway
        ws, c = await open_client(s, additional_headers=alice)
        sid = c.ready["session_id"]
        await c.send({"type": "generate", "id": "short", "prompt_token_ids": [5, 6, 7],
                      "params": {"max_tokens": 6, "ignore_eos": True}})
        await c.send({"type": "generate", "id": "long", "prompt_token_ids": [8, 9],
                      "params": {"max_tokens": 900, "ignore_eos": True}})
        while (await c.recv())["type"] != "start":
            pass
        await ws.close()
        await wait_free(s)
        assert gw.parked.count == 2 and gw.inflight_total == 2  # parked ones still count
        ws, c = await open_client(s, additional_headers=bob)
        async with ws:  # another key cannot see alice's requests
            await c.send({"type": "resume", "id": "short", "after_seq": 0, "session_id": sid})
            assert (await c.recv())["code"] == "invalid_request"
        ws, c = await open_client(s, additional_headers=alice)
        async with ws:
            for bad in ({"session_id": "nope", "after_seq": 0}, {"session_id": sid, "after_seq": 99},
                        {"session_id": sid, "after_seq": -1}, {"after_seq": 0}):
                await c.send({"type": "resume", "id": "short", **bad})
                err = await c.recv()
                assert err["type"] == "error" and err["code"] == "invalid_request", bad
                assert err["id"] == "short"
            # "short" finished while nobody listened: all of it, then its done.
            await c.send({"type": "resume", "id": "short", "after_seq": 0, "session_id": sid})
            msgs = await c.until_done({"short"})
            assert msgs[0]["type"] == "resumed"
            deltas = [m for m in msgs if m["type"] == "delta"]
            assert [d["seq"] for d in deltas] == list(range(1, len(deltas) + 1))
            assert len(sum((d["token_ids"] for d in deltas), [])) == 6
            assert msgs[-1]["status"] == "completed"
            # "long" outlives the grace window: aborted, released (polled, with a deadline)
            deadline = asyncio.get_running_loop().time() + 30
            while gw.parked.count or gw.inflight_total:
                assert asyncio.get_running_loop().time() < deadline, "never expired"
                await asyncio.sleep(0.02)
            await c.send({"type": "resume", "id": "long", "after_seq": 0, "session_id": sid})
            assert (await c.recv())["code"] == "invalid_request"
        await wait_free(s)
        metrics = http_get(s.url + "/metrics")[1].decode()
        assert 'tidewire_websocket_resumable_requests_total{outcome="expired"} 1.0' in metrics
        assert 'tidewire_websocket_resumable_requests_total{outcome="resumed"} 1.0' in metrics


async def test_without_resume_a_drop_aborts(tiny_models) -> None:
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", 0)), dtype="float32"),
                           limits=Limits(resume_grace=0))
    with run_server(config) as s:
        ws, c = await open_client(s)
        assert "resume" not in c.ready["features"]
        sid = c.ready["session_id"]
        await c.send({"type": "generate", "id": "a", "prompt_token_ids": [5, 6],
                      "params": {"max_tokens": 900, "ignore_eos": True}})
        while (await c.recv())["type"] != "delta":
            pass
        await ws.close()
        await wait_free(s)
        assert s.gateway.inflight_total == 0 and not s.engine.scheduler.parked
        ws, c = await open_client(s)
        async with ws:
            await c.send({"type": "resume", "id": "a", "after_seq": 1, "session_id": sid})
            assert (await c.recv())["code"] == "invalid_request"


async def test_a_resume_ahead_of_the_old_sockets_close_waits_for_it(tiny_models,
                                                                     monkeypatch) -> None:
    """A client that reconnects at once can send its resume before this server has seen
    the old socket close: the resume waits for that close (then reattaches), and gives
    up with invalid_request when the old socket stays open."""
    import service.resume

    with run_server(resumable(tiny_models)) as s:
        old, c_old = await open_client(s)
        sid = c_old.ready["session_id"]
        await c_old.send({"type": "generate", "id": "a", "prompt_token_ids": [5, 6, 7],
                          "params": {"max_tokens": 40, "ignore_eos": True}})
        seq = 0
        while seq < 2:
            m = await c_old.recv()
            seq = m.get("seq", seq) if m["type"] == "delta" else seq
        ws, c = await open_client(s)
        async with ws:
            # the old socket is still open: the resume is held, not refused
            await c.send({"type": "resume", "id": "a", "after_seq": seq, "session_id": sid})
            await c.send({"type": "ping", "t": 1})
            assert (await c.recv())["type"] == "pong"  # (nothing came back for the resume yet)
            await old.close()
            msgs = await c.until_done({"a"})
            assert msgs[0] == {"type": "resumed", "id": "a", "after_seq": seq}
            assert [m["type"] for m in msgs].count("done") == 1
            assert msgs[-1]["status"] == "completed"
            assert msgs[-1]["usage"]["completion_tokens"] == 40
        # an old socket that never closes: the resume gives up after the wait
        monkeypatch.setattr(service.resume, "RESUME_WAIT_SECONDS", 0.3)
        old, c_old = await open_client(s)
        async with old:
            sid = c_old.ready["session_id"]
            await c_old.send({"type": "generate", "id": "b", "prompt_token_ids": [5, 6],
                              "params": {"max_tokens": 900, "ignore_eos": True}})
            ws, c = await open_client(s)
            async with ws:
                await c.send({"type": "resume", "id": "b", "after_seq": 0, "session_id": sid})
                err = await c.recv()
                assert err["code"] == "invalid_request" and "still open" in err["message"]
                assert err["id"] == "b"
            await c_old.send({"type": "cancel", "id": "b"})
            await c_old.until_done({"b"})
        await wait_free(s)


async def test_a_done_written_just_before_a_drop_can_be_resumed(tiny_models) -> None:
    """A done frame written to the transport may die with the connection: for a while
    after it, the request stays resumable from a socket that drops, and a resume replays
    all of it and its done."""
    with run_server(resumable(tiny_models)) as s:
        ws, c = await open_client(s)
        sid = c.ready["session_id"]
        await c.send({"type": "generate", "id": "s", "prompt_token_ids": [5, 6, 7],
                      "params": {"max_tokens": 5, "ignore_eos": True}})
        session = next(x for x in s.gateway.sessions if x.session_id == sid)
        deadline = asyncio.get_running_loop().time() + 30
        while "s" not in session.streams.recent:  # its done is written; this client never reads it
            assert asyncio.get_running_loop().time() < deadline, "never finished"
            await asyncio.sleep(0.01)
        await ws.close()
        await wait_free(s)
        ws, c = await open_client(s)
        async with ws:
            await c.send({"type": "resume", "id": "s", "after_seq": 0, "session_id": sid})
            msgs = await c.until_done({"s"})
            assert msgs[0]["type"] == "resumed"
            deltas = [m for m in msgs if m["type"] == "delta"]
            assert len(sum((d["token_ids"] for d in deltas), [])) == 5
            assert [m["type"] for m in msgs].count("done") == 1
            assert msgs[-1]["status"] == "completed"


async def test_ended_requests_leave_an_idle_socket_after_the_resume_window(tiny_models) -> None:
    """An ended request stays resumable for RECENT_DONE_SECONDS after its done was
    written, then the socket forgets it even if it never sends or ends anything again
    (before, each socket kept its last 64 ended requests' outputs for its lifetime)."""
    from service.streams import RECENT_DONE_SECONDS

    with run_server(resumable(tiny_models)) as s:
        ws, c = await open_client(s)
        sid = c.ready["session_id"]
        await c.send({"type": "generate", "id": "t", "prompt_token_ids": [5, 6, 7],
                      "params": {"max_tokens": 3, "ignore_eos": True}})
        await c.until_done({"t"})
        session = next(x for x in s.gateway.sessions if x.session_id == sid)
        await apoll(lambda: "t" in session.streams.recent, 30, "its done recorded as written")
        later = session.streams.recent["t"][1] + RECENT_DONE_SECONDS + 0.5
        session.streams.clock = lambda: later
        # the socket's watchdog expires it (about once a second)
        await apoll(lambda: not session.streams.recent, 10, "an idle socket forgetting its ended request")
        await ws.close()
        await wait_free(s)
        ws, c = await open_client(s)
        async with ws:
            await c.send({"type": "resume", "id": "t", "after_seq": 0, "session_id": sid})
            err = await c.recv()
            assert err["type"] == "error" and err["id"] == "t", err
            assert "expired" in err["message"]


def test_a_msgpack_socket_codec_holds_kilobytes_and_still_packs_big_frames() -> None:
    """Each socket owns an encoder; msgpack's default Packer buffer (256 KiB) held a
    quarter of a megabyte per msgpack socket, found as heap growth under a soak."""
    import tracemalloc

    from service.protocol import SUBPROTOCOL_MSGPACK, Codec

    tracemalloc.start()
    try:
        codecs = [Codec(SUBPROTOCOL_MSGPACK) for _ in range(100)]
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 1 << 20, held  # under 10 KiB a socket (was 25 MiB for these 100)
    frame = {"type": "delta", "id": "r", "text": "ü" * 300_000, "token_ids": list(range(5000))}
    for c in codecs[:2]:
        assert msgpack.unpackb(c.encode(frame)) == frame
        assert c.decode(c.encode({"type": "ping"})) == {"type": "ping"}

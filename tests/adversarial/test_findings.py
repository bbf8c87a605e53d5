"""Hostile single requests against the real app under uvicorn: each value here once
stopped the replica, leaked an admission, or let one key take what limits promised to
bound. After each: the right error (naming the field), the socket still open, the
engine alive, and no admission left behind."""

from __future__ import annotations

import asyncio
import json

import pytest
from websockets.asyncio.client import connect

from engine import EngineConfig
from engine.sampling_params import MAX_STOP_CHARS
from service.config import Limits, ServiceConfig
from tests.servers import http_get, run_server

JSON = "tidewire.v1.json"
KEYS = {"key-a": "a", "key-b": "b", "key-c": "c"}


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    config = ServiceConfig(
        engine=EngineConfig(model=str(tiny_chat_model), dtype="float32"), model_name="tiny",
        api_keys=KEYS,
        limits=Limits(max_inflight_per_key=8, max_connections_per_key=3, resume_grace=30,
                      max_detached_per_key=2, max_compiles_per_key=1))
    with run_server(config) as s:
        yield s


class Socket:
    def __init__(self, ws) -> None:  # noqa: ANN001
        self.ws = ws

    async def send(self, msg: dict) -> None:
        await self.ws.send(json.dumps(msg))

    async def recv(self, timeout: float = 30) -> dict:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def answer(self, msg: dict) -> dict:
        """The first error or done frame that answers `msg`."""
        await self.send(msg)
        while True:
            f = await self.recv()
            if f["type"] in ("error", "done") and f.get("id") == msg.get("id"):
                return f

    async def alive(self) -> None:
        """The socket answers, and the engine still serves a request."""
        await self.send({"type": "ping", "t": 7})
        while (await self.recv())["type"] != "pong":
            pass
        done = await self.answer({"type": "generate", "id": "alive", "prompt": "Hi",
                                  "params": {"max_tokens": 2}})
        assert done["type"] == "done" and done["status"] == "completed", done


async def open_socket(s, key: str = "key-a") -> tuple[object, Socket]:  # noqa: ANN001
    ws = await connect(s.ws_url, subprotocols=[JSON], max_size=None,
                       additional_headers={"Authorization": f"Bearer {key}"})
    sock = Socket(ws)
    assert (await sock.recv())["type"] == "ready"
    return ws, sock


def no_leak(s) -> None:  # noqa: ANN001
    gw = s.gateway
    assert gw.inflight_total == 0 and not gw.inflight_by_key and not gw.compiling_by_key
    assert s.app.state.engine.dead is None


def refused(f: dict, code: str, *words: str) -> None:
    assert f["type"] == "error" and f["code"] == code, f
    for w in words:
        assert w in f["message"], f


def gen(rid: str, **params) -> dict:
    return {"type": "generate", "id": rid, "prompt": "Hello", "params": params}


@pytest.mark.parametrize("params, field", [
    ({"top_k": 2**63}, "top_k"),  # once: OverflowError in torch.tensor on the engine thread
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"stop": ["x" * 60_000], "n": 16}, "stop string"),  # once: ~29 GB of stop prefixes
    ({"logit_bias": {str(i): 1 for i in range(2000)}}, "logit_bias"),
    ({"logit_bias": {str(2**40): 1}}, "logit_bias"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"logit_bias": {"60000": 1}}, "vocabulary"),  # past this model's 49,152 ids
    ({"stop_token_ids": list(range(2000))}, "stop_token_ids"),
    ({"stop_token_ids": [2**62]}, "stop_token_ids"),
    ({"n": 16, "max_tokens": 8000, "logprobs": 20}, "per-request bound"),
])
async def test_every_sampling_parameter_is_bounded(server, params, field) -> None:
    ws, s = await open_socket(server)
    async with ws:
        refused(await s.answer(gen("bad", **params)), "invalid_request", field)
        await s.alive()
    no_leak(server)


async def test_a_long_stop_string_within_the_bound_holds_text_back_and_stops(server) -> None:
    ws, s = await open_socket(server)
    async with ws:
        stop = "y" * (MAX_STOP_CHARS - 1) + "z"
        f = await s.answer(gen("ok", stop=[stop] * 16, n=16, max_tokens=4, temperature=1.0))
        assert f["type"] == "done" and f["status"] == "completed", f
    no_leak(server)


@pytest.mark.parametrize("after_seq", [10**9, 10**30, -1])
async def test_resume_after_seq_is_bounded_and_never_leaks_the_key(server, after_seq) -> None:
    """A stateless resume with an absurd after_seq once allocated 8 GB on the event loop
    (10**9) or raised after admission (10**30), leaking the key's in-flight count: a
    few hundred such frames locked the key out."""
    ws, s = await open_socket(server)
    async with ws:
        for i in range(20):  # more than the key's in-flight limit (8)
            f = await s.answer({"type": "resume", "id": f"r{i}", "after_seq": after_seq,
                                "session_id": "gone", "token_ids": [5, 6],
                                "request": {"prompt": "Hello", "params": {"max_tokens": 8}}})
            refused(f, "invalid_request", "after_seq")
        await s.alive()  # the key is not locked out
    no_leak(server)


async def test_deep_nesting_and_huge_lists_are_refused_by_name(server) -> None:
    ws, s = await open_socket(server)
    async with ws:
        # a schema 900 levels deep (built as text: json.dumps itself recurses); once:
        # RecursionError past validation, and the socket died
        deep = '{"type":"object","properties":{"a":' * 900 + "{}" + "}}" * 900
        await s.ws.send('{"type":"generate","id":"deep","prompt":"Hi","params":{'
                        '"response_format":{"type":"json_schema","json_schema":{"name":"d",'
                        f'"schema":{deep}}}}}}}}}')
        while (f := await s.recv())["type"] != "error":
            pass
        refused(f, "invalid_request", "nested")
        msgs = [{"role": "user", "content": "hi"}] * 2000
        refused(await s.answer({"type": "generate", "id": "many", "messages": msgs}),
                "invalid_request", "messages")
        regex = "(" * 600 + "a" + ")" * 600
        refused(await s.answer(gen("re", response_format={"type": "regex", "regex": regex})),
                "invalid_request")
        await s.alive()
    no_leak(server)


async def test_a_prompt_too_large_for_the_context_is_refused_by_its_size(server) -> None:
    """A 1 MiB prompt is refused by its byte length, before any tokenizing (which took
    ~2 s of the event loop on a 2-core VM, stalling every stream)."""
    ws, s = await open_socket(server)
    async with ws:
        f = await s.answer({"type": "generate", "id": "big", "prompt": "ab " * 330_000})
        refused(f, "context_length_exceeded", "bytes")
        await s.alive()
    no_leak(server)


@pytest.fixture
def off_loop_above_2k(monkeypatch) -> None:  # noqa: ANN001
    """Prompts over 2,000 bytes are tokenized off the loop (the tiny model's context,
    1,024 tokens, holds no prompt over the real threshold)."""
    from service import tokenizing

    monkeypatch.setattr(tokenizing, "INLINE_PROMPT_BYTES", 2000)


@pytest.fixture
def tokenize_calls(server, monkeypatch) -> list[tuple[str, bool]]:  # noqa: ANN001
    """(thread name, any_thread) of each call of the engine's tokenize."""
    import threading

    eng = server.app.state.engine
    where, real = [], eng.tokenize

    def tokenize(prompt, any_thread=False):  # noqa: ANN001, ANN202
        where.append((threading.current_thread().name, any_thread))
        return real(prompt, any_thread)

    monkeypatch.setattr(eng, "tokenize", tokenize)
    return where


async def test_a_large_prompt_that_fits_is_tokenized_off_the_loop(server, off_loop_above_2k,
                                                                  tokenize_calls) -> None:
    """Over INLINE_PROMPT_BYTES the prompt is tokenized on the tokenizing thread; it is
    admitted (or refused for its token count) like any other."""
    where = tokenize_calls
    ws, s = await open_socket(server)
    async with ws:
        f = await s.answer({"type": "generate", "id": "mid", "prompt": "word " * 500,
                            "params": {"max_tokens": 2}})
        assert f["type"] == "done" and f["status"] == "completed", f
        assert f["usage"]["prompt_tokens"] >= 500
        assert where[-1][0].startswith("tidewire-tokenize") and where[-1][1]
        f = await s.answer({"type": "generate", "id": "long", "prompt": "word " * 2000,
                            "params": {"max_tokens": 2}})
        refused(f, "context_length_exceeded", "tokens")
    no_leak(server)


async def test_per_key_connections_and_compiles(server) -> None:
    socks = [await open_socket(server) for _ in range(3)]
    with pytest.raises(Exception) as closed:  # the key's 4th socket: closed 1013
        ws4, s4 = await open_socket(server)
        await s4.recv()
    assert "1013" in str(closed.value)
    ws_b, s_b = await open_socket(server, "key-b")  # another key still connects
    await ws_b.close()
    for ws, _ in socks:
        await ws.close()
    ws, s = await open_socket(server)
    async with ws:
        # two distinct schemas at once: the key compiles one at a time (limit 1)
        for i in range(2):
            schema = {"type": "object", "properties": {f"f{i}": {"type": "integer"}},
                      "required": [f"f{i}"]}
            await s.send(gen(f"c{i}", max_tokens=4, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
        ends = {}
        while len(ends) < 2:
            f = await s.recv()
            if f["type"] in ("done", "error") and "id" in f:
                ends[f["id"]] = f
        refused(ends["c1"], "too_many_inflight", "compiling")
        assert ends["c0"]["type"] == "done"
    no_leak(server)


async def test_parking_space_is_shared_between_keys(server) -> None:
    ws, s = await open_socket(server)
    for i in range(4):  # four long requests, then the socket drops
        await s.send(gen(f"p{i}", max_tokens=900, ignore_eos=True))
    while (await s.recv())["type"] != "start":
        pass
    await ws.close()
    parked = server.gateway.parked
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while parked.by_key.get("key-a", 0) < 2 and loop.time() < deadline:
        await asyncio.sleep(0.01)
    assert parked.by_key == {"key-a": 2}  # max_detached_per_key; the other two aborted
    parked.expire_all()
    no_leak(server)


@pytest.mark.parametrize("where", ["queue_position", "submit_metrics", "started", "render"])
async def test_a_fault_at_any_step_of_admission_answers_and_leaks_nothing(
        server, off_loop_above_2k, monkeypatch, where) -> None:
    from service import admission as admission_mod
    from service.metrics import Metrics

    def boom(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("injected")

    gw = server.gateway
    if where == "queue_position":
        monkeypatch.setattr(gw, "queue_position", boom)
    elif where == "submit_metrics":
        monkeypatch.setattr(gw, "metrics", Metrics())
        monkeypatch.setattr(gw.metrics.prompt_tokens, "inc", boom)
    elif where == "started":
        monkeypatch.setattr(admission_mod.Admitter, "_started", boom)
    else:
        monkeypatch.setattr(admission_mod.tool_calls, "render", boom)
    ws, s = await open_socket(server)
    async with ws:
        for prompt in ("Hello", "word " * 500):  # inline, and off the loop
            f = await s.answer({"type": "generate", "id": "g",
                                "messages": [{"role": "user", "content": prompt}],
                                "params": {"max_tokens": 2}})
            refused(f, "internal_error", "RuntimeError")
        monkeypatch.undo()
        await s.alive()
    no_leak(server)
    assert http_get(server.url + "/health")[0] == 200


def test_tokenize_endpoint_takes_a_large_text_off_the_loop(server, tokenize_calls) -> None:
    import urllib.request

    where = tokenize_calls
    text = "a few words " * 3000  # 36 KB: over INLINE_PROMPT_BYTES
    req = urllib.request.Request(server.url + "/tokenize", json.dumps({"prompt": text}).encode(),
                                 {"Content-Type": "application/json",
                                  "Authorization": "Bearer key-a"})
    with urllib.request.urlopen(req, timeout=60) as r:
        body = json.loads(r.read())
    assert body["tokens"] == server.app.state.engine.engine.tokenize(text)
    assert where == [(where[0][0], True)] and where[0][0].startswith("tidewire-tokenize")


async def test_a_compile_nobody_waits_for_any_more_is_cancelled(server, monkeypatch) -> None:
    """Two workers busy with slow compiles and a third queued behind them: when its
    socket closes, the queued compile is cancelled, never run (a running one cannot be
    interrupted, and finishes)."""
    import threading

    grammars = server.app.state.engine.engine.grammars
    gate, started = threading.Event(), []
    real = grammars._compile

    def slow(fmt):  # noqa: ANN001, ANN202
        started.append(fmt.spec)
        gate.wait(30)
        return real(fmt)

    monkeypatch.setattr(grammars, "_compile", slow)

    def choice(tag: str) -> dict:
        return {"type": "choice", "choice": [f"{tag}-yes", f"{tag}-no"]}

    try:
        sockets = [await open_socket(server, key) for key in ("key-a", "key-b")]
        (ws_a, a), (ws_b, b) = sockets
        await a.send(gen("r1", max_tokens=2, response_format=choice("one")))
        await b.send(gen("r2", max_tokens=2, response_format=choice("two")))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while len(started) < 2:  # both workers are busy
            assert loop.time() < deadline
            await asyncio.sleep(0.01)
        ws_c, c = await open_socket(server, "key-c")
        await c.send(gen("r3", max_tokens=2, response_format=choice("three")))
        from engine.structured import ResponseFormat

        fmt = ResponseFormat.parse(choice("three"))
        while grammars.peek(fmt) is None:
            assert loop.time() < deadline
            await asyncio.sleep(0.01)
        queued = grammars.peek(fmt)
        await ws_c.close()  # its client left: nobody waits for the third compile
        while not queued.cancelled():
            assert loop.time() < deadline, "the queued compile was not cancelled"
            await asyncio.sleep(0.01)
        gate.set()
        for ws, _ in sockets:
            await ws.close()
        assert len(started) == 2  # the cancelled one never ran
    finally:
        gate.set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while server.gateway.inflight_by_key or server.gateway.compiling_by_key:
        assert loop.time() < deadline, (server.gateway.inflight_by_key,
                                        server.gateway.compiling_by_key)
        # a request admitted before its socket closed is parked once the server sees
        # the close: nobody resumes it here
        server.gateway.parked.expire_all()
        await asyncio.sleep(0.01)
    no_leak(server)


async def test_a_request_prepared_as_its_socket_closes_is_not_started(server,
                                                                    monkeypatch) -> None:
    """A prepare that returns although its task was cancelled (Python 3.11's wait_for
    returns a result that arrived with the cancel) must not admit the request on the
    closed socket: it would stay in flight for its key for ever."""
    entered = asyncio.Event()  # this loop's; the server runs its own loop in a thread
    loop = asyncio.get_running_loop()

    async def swallowing(params) -> None:  # noqa: ANN001
        loop.call_soon_threadsafe(entered.set)  # (a plain set() wakes this loop only at
        # its next timer: the client's 20 s keepalive)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return  # the compile "finished" just as the socket closed

    monkeypatch.setattr(server.app.state.engine, "prepare", swallowing)
    ws, sock = await open_socket(server, "key-b")
    await sock.send(gen("late", max_tokens=2,
                        response_format={"type": "choice", "choice": ["late-1", "late-2"]}))
    await asyncio.wait_for(entered.wait(), 30)
    assert server.gateway.inflight_by_key.get("key-b") == 1  # held while it prepares
    await ws.close()
    deadline = loop.time() + 30
    while server.gateway.inflight_by_key or server.gateway.compiling_by_key:
        assert loop.time() < deadline, (server.gateway.inflight_by_key,
                                        server.gateway.compiling_by_key)
        await asyncio.sleep(0.01)
    no_leak(server)

"""The Python SDK (clients/python, tidewire_client) against the real server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine import EngineConfig
from service.config import Limits, ServiceConfig
from tests.servers import free_port, http_get, run_server
from tidewire_client import (APIConnectionError, AsyncClient, AuthenticationError,
                             BadRequestError, DeltaEvent, DoneEvent, RateLimitError,
                             StartEvent)

ROOT = Path(__file__).resolve().parents[1]
ASK = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    config = ServiceConfig(engine=EngineConfig(model="smollm2-135m", dtype="float32"),
                           limits=Limits(max_inflight_per_connection=4),
                           api_keys={"sk-test": "tenant"})
    with run_server(config) as s:
        yield s


def client(server, **kw) -> AsyncClient:
    return AsyncClient(server.ws_url, api_key="sk-test", **kw)


async def wait_idle(server, timeout: float = 10.0) -> None:
    eng = server.engine
    for _ in range(int(timeout / 0.01)):
        if not eng.has_unfinished() and eng.kv.num_free_blocks == eng.num_blocks:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine still holds requests or blocks")


@pytest.mark.parametrize("protocol", ["msgpack", "json"])
async def test_concurrent_streams_share_one_socket(server, protocol: str) -> None:
    questions = ["Name three colors.", "Count to four.", "Say hello.", "What is 2+2?"]
    async with client(server, protocol=protocol) as c:
        whole = [await c.chat.create([{"role": "user", "content": q}], max_tokens=16,
                                     temperature=0.0) for q in questions]
        assert len(server.gateway.sessions) == 1

        async def one(q: str) -> tuple[list, str]:
            s = await c.chat.stream([{"role": "user", "content": q}], max_tokens=16,
                                    temperature=0.0)
            events = [ev async for ev in s]
            return events, "".join(ev.text for ev in events if isinstance(ev, DeltaEvent))

        results = await asyncio.gather(*(one(q) for q in questions))
        assert len(server.gateway.sessions) == 1  # all of them on the one socket
    for (events, text), w in zip(results, whole):
        assert isinstance(events[0], StartEvent) and isinstance(events[-1], DoneEvent)
        deltas = [e for e in events if isinstance(e, DeltaEvent)]
        assert [d.seq for d in deltas] == list(range(1, len(deltas) + 1))
        assert events[-1].status == "completed" and text == w.text and text
        assert events[-1].usage.completion_tokens == len(w.token_ids[0])


async def test_text_stream_completions_and_warm(server) -> None:
    async with client(server) as c:
        s = await c.completions.stream("The ocean is", max_tokens=8, temperature=0.0,
                                       ignore_eos=True)
        text = "".join([t async for t in s.text_stream()])
        assert text and s.done.finish_reason == "length" and s.done.usage.completion_tokens == 8
        conv = [{"role": "system", "content": "You are terse. " * 20},
                {"role": "user", "content": "Hi"}]
        w = await c.warm(messages=conv)
        assert w.cached_tokens >= 16 and w.prompt_tokens >= w.cached_tokens
        r = await c.chat.create(conv + [{"role": "assistant", "content": "Hello."},
                                        {"role": "user", "content": "Bye"}], max_tokens=4)
        assert r.cached_tokens.total >= 16  # the warmed prefix was reused
        assert await c.ping() > 0


async def test_breaking_out_of_the_loop_cancels_on_the_server(server) -> None:
    async with client(server) as c:
        s = await c.chat.stream(ASK, max_tokens=400, ignore_eos=True)
        n = 0
        async for ev in s:
            n += isinstance(ev, DeltaEvent)
            if n == 3:
                break
        await wait_idle(server)  # the server aborted it and freed its blocks
        s2 = await c.chat.stream(ASK, max_tokens=400, ignore_eos=True)
        events = []
        async for ev in s2:  # cancel() keeps the stream going until its done
            events.append(ev)
            if isinstance(ev, DeltaEvent) and len(events) == 2:
                await s2.cancel()
        assert isinstance(events[-1], DoneEvent) and events[-1].status == "cancelled"
        assert events[-1].finish_reason == "cancelled" and len(events) < 100
        await wait_idle(server)


async def test_errors_raise_typed_exceptions(server) -> None:
    async with client(server) as c:
        s = await c.chat.stream(ASK, temperature=-1)
        with pytest.raises(BadRequestError) as e:
            await s.final()
        assert e.value.code == "invalid_request" and not e.value.retryable
        s = await c.completions.stream("word " * 9000, max_tokens=4)
        with pytest.raises(BadRequestError, match="context_length_exceeded"):
            await s.final()
        streams = [await c.chat.stream(ASK, max_tokens=200, ignore_eos=True) for _ in range(5)]
        with pytest.raises(RateLimitError) as e:  # 4 in flight allowed per socket
            await streams[-1].final()
        assert e.value.code == "too_many_inflight" and e.value.retryable
        for s in streams[:-1]:
            s.close()
    with pytest.raises(AuthenticationError):
        async with AsyncClient(server.ws_url, api_key="wrong", max_retries=0) as c:
            await c.connect()
    with pytest.raises(APIConnectionError):
        async with AsyncClient(f"ws://127.0.0.1:{free_port()}/v1/ws", max_retries=1) as c:
            await c.chat.create(ASK)
    await wait_idle(server)


async def test_reconnects_for_new_requests_after_the_socket_drops(server) -> None:
    async with client(server) as c:
        await c.connect()
        for sess in list(server.gateway.sessions):
            await sess.ws.close(code=1001)
        for _ in range(100):
            if not c.connected:
                break
            await asyncio.sleep(0.01)
        assert not c.connected
        r = await c.chat.create(ASK, max_tokens=4)
        assert r.status == "completed" and c.connected


_SCRIPT = textwrap.dedent("""
    import json, sys
    from tidewire_client import Client, DeltaEvent
    with Client(sys.argv[1], api_key="sk-test", protocol="json") as c:
        whole = c.chat.create([{"role": "user", "content": "Say hi."}], max_tokens=8,
                              temperature=0.0)
        parts = []
        for ev in c.chat.stream([{"role": "user", "content": "Count to 50."}],
                                max_tokens=300, ignore_eos=True):
            if isinstance(ev, DeltaEvent):
                parts.append(ev.text)
                if len(parts) == 2:
                    break
        print(json.dumps({"text": whole.text, "status": whole.status,
                          "tokens": whole.usage.completion_tokens, "parts": len(parts)}))
""")


async def test_sync_client_from_a_plain_script(server) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "clients" / "python")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SCRIPT, server.ws_url, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    r = json.loads(out.decode().strip().splitlines()[-1])
    assert r["status"] == "completed" and r["text"] and 0 < r["tokens"] <= 8 and r["parts"] == 2
    await wait_idle(server)  # the abandoned stream was cancelled


async def test_tidewire_chat_cli_streams_an_answer(server) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "clients" / "python")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tidewire_client.cli", "--url", server.ws_url, "--api-key",
        "sk-test", "--max-tokens", "12", "--temperature", "0", env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(b"Say hello.\nNow say bye.\n"), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    text, log = out.decode(), err.decode()
    assert text.count("> ") >= 2 and len(text.replace("> ", "").strip()) > 4  # two answers
    assert "connected to smollm2-135m" in log and log.count("tok/s") == 2


async def test_streams_survive_a_dropped_connection(server) -> None:
    """The network drops mid-stream (the TCP connection dies without a close frame):
    the client reconnects and resumes; every stream ends with the same text and tokens
    as an uninterrupted run, seqs without a gap, one done each."""
    asks = [[{"role": "user", "content": f"Write a poem about the number {i}."}] for i in range(3)]
    params = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    async with client(server) as c:
        want = [await c.chat.create(a, **params) for a in asks]
        first_session = c.ready["session_id"]
        streams = [await c.chat.stream(a, **params) for a in asks]
        got: list[list[DeltaEvent]] = [[] for _ in asks]
        while not all(len(g) >= 2 for g in got):  # a few deltas each, then the wire dies
            for i, st in enumerate(streams):
                if len(got[i]) < 2:
                    ev = await st.next_event()
                    if isinstance(ev, DeltaEvent):
                        got[i].append(ev)
        c._ws.transport.abort()
        for i, st in enumerate(streams):
            async for ev in st:
                if isinstance(ev, DeltaEvent):
                    got[i].append(ev)
            assert st.done is not None and st.done.status == "completed"
            assert st.done.usage.completion_tokens == 40
        assert c.ready["session_id"] != first_session  # it really is a new socket
    for g, w in zip(got, want):
        assert [d.seq for d in g] == list(range(1, len(g) + 1))
        assert "".join(d.text for d in g) == w.text
        assert sum((d.token_ids for d in g), []) == w.token_ids[0]
    assert 'outcome="resumed"} 3.0' in http_get(server.url + "/metrics")[1].decode()
    await wait_idle(server)


async def test_parse_with_a_pydantic_model_and_tool_calls(server) -> None:
    """chat.parse() sends a Pydantic model's schema and returns its instance; a cut-off
    output raises IncompleteOutputError; tool calls come whole in the Completion."""
    from pydantic import BaseModel, Field

    from tidewire_client import IncompleteOutputError

    class Pet(BaseModel):
        name: str = Field(max_length=20)
        legs: int = Field(ge=0, le=8)

    async with client(server) as c:
        got = await c.chat.parse([{"role": "user", "content": "Describe a pet."}],
                                 response_format=Pet, max_tokens=60, temperature=0)
        assert isinstance(got.parsed, Pet) and got.parsed.legs <= 8
        assert Pet.model_validate_json(got.text) == got.parsed
        with pytest.raises(IncompleteOutputError) as e:
            await c.chat.parse(ASK, response_format=Pet, max_tokens=3, temperature=0)
        assert e.value.completion.finish_reason == "length"
        schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
                  "required": ["n"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        got = await c.chat.parse(ASK, response_format=fmt, max_tokens=20, temperature=0)
        assert isinstance(got.parsed, dict) and got.parsed["n"] <= 9
        tool = {"type": "function", "function": {"name": "paint", "parameters": {
            "type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
            "required": ["color"]}}}
        events = []
        stream = await c.chat.stream(ASK, tools=[tool], tool_choice="required", max_tokens=40,
                                     temperature=0)
        async for ev in stream:
            events.append(ev)
        done = await stream.final()
        assert done.finish_reason == "tool_calls" and done.content is None
        (call,) = done.tool_calls
        assert call["function"]["name"] == "paint"
        assert json.loads(call["function"]["arguments"])["color"] in ("red", "blue")
        frags = [t for ev in events if isinstance(ev, DeltaEvent) for t in ev.tool_calls or []]
        assert frags[0]["id"] == call["id"]
        assert "".join(t["function"]["arguments"] for t in frags) == call["function"]["arguments"]

"""A model step that raises (a fault injected into the model runner of a real server):
every request of that batch fails with `internal_error` (socket: an error frame then
done{failed}; SSE: an error event; a whole response: HTTP 500), the sockets stay open
and answer, and the replica stays healthy: one bad batch is not a dead engine. Only a
model that fails MAX_STEP_FAULTS steps in a row is reported dead: /health and /ready
say 503, new requests are refused with `internal_error` at once, and the server still
shuts down."""

from __future__ import annotations

import asyncio
import json
import time

import openai
from websockets.asyncio.client import connect

from engine import EngineConfig
from engine.llm_engine import MAX_STEP_FAULTS
from service.config import ServiceConfig
from tests.chaos.driver import Stream, check_frame
from tests.servers import apoll, http_get, run_server


class InjectedFault(RuntimeError):
    pass


def arm(engine, after: int) -> list[int]:  # noqa: ANN001 - engine.LLMEngine
    """The runner's `after`-th next call raises InjectedFault; returns a list that gets
    the step it failed in."""
    runner = engine.runner
    real = runner.execute
    calls, failed = [0], []

    def execute(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] >= after:
            failed.append(engine.num_steps)
            raise InjectedFault("injected: the forward failed")
        return real(*args, **kw)

    runner.execute = execute
    return failed


async def test_an_engine_exception_mid_step_fails_requests_and_reports_unhealthy(
        tiny_chat_model) -> None:
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_chat_model), dtype="float32"),
                           model_name="tiny")
    with run_server(config) as s:
        streams: dict[str, Stream] = {}
        sockets = [await connect(s.ws_url, subprotocols=["tidewire.v1.json"], ping_interval=None)
                   for _ in range(4)]
        for ws in sockets:
            assert json.loads(await ws.recv())["type"] == "ready"
        for k, ws in enumerate(sockets):
            for j in range(4):
                rid = f"w{k}-{j}"
                streams[rid] = Stream(rid)
                await ws.send(json.dumps({"type": "generate", "id": rid,
                                          "prompt_token_ids": [100 + k * 10 + j] * 12,
                                          "params": {"max_tokens": 900, "ignore_eos": True,
                                                     "temperature": 0.0}}))

        async def read(ws) -> None:  # noqa: ANN001
            while any(sid.startswith(f"w{sockets.index(ws)}-") and st.done is None
                      for sid, st in streams.items()):
                check_frame(streams, json.loads(await ws.recv()))

        readers = [asyncio.ensure_future(read(ws)) for ws in sockets]
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        sse_out: dict[str, str] = {}

        async def sse() -> None:
            stream = await client.completions.create(model="tiny", prompt=[7] * 12,
                                                     max_tokens=900, stream=True,
                                                     extra_body={"ignore_eos": True})
            try:
                async for _ in stream:
                    sse_out["started"] = "yes"
                sse_out["end"] = "no error"
            except openai.APIError as e:
                sse_out["end"] = f"{type(e).__name__}:{e.code}"

        async def whole() -> str:
            try:
                await client.completions.create(model="tiny", prompt=[9] * 12, max_tokens=900,
                                                extra_body={"ignore_eos": True})
                return "no error"
            except openai.APIStatusError as e:
                return f"{e.status_code}:{e.code}"

        sse_task = asyncio.ensure_future(sse())
        whole_task = asyncio.ensure_future(whole())
        await apoll(lambda: all(st.seq >= 2 for st in streams.values())
                    and "started" in sse_out, 60, "every stream under way")
        assert http_get(s.url + "/health")[0] == 200
        eng = s.engine
        failed = arm(eng, after=1)
        t_armed = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*readers, sse_task), 30)  # no hang
        whole_result = await asyncio.wait_for(whole_task, 30)
        ended = time.monotonic() - t_armed

        # every socket request: an internal_error frame, then done{failed, error}
        for st in streams.values():
            assert st.done is not None and st.done["status"] == "failed", st
            assert st.done["finish_reason"] == "error"
            assert [e["code"] for e in st.errors] == ["internal_error"], st.errors
            assert "model step (InjectedFault)" in st.errors[0]["message"]
        assert sse_out["end"] == "APIError:internal_error", sse_out
        assert whole_result == "500:internal_error"
        # one failed batch: the replica is still healthy
        assert http_get(s.url + "/health")[0] == 200
        # the sockets stay open: a ping answers; the model keeps failing, so each new
        # request fails too, and after MAX_STEP_FAULTS failed steps in a row it is dead
        ws = sockets[0]
        await ws.send(json.dumps({"type": "ping"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "pong"
        for i in range(MAX_STEP_FAULTS - 1):
            await ws.send(json.dumps({"type": "generate", "id": f"f{i}",
                                      "prompt_token_ids": [5] * 4, "params": {"max_tokens": 4}}))
            while (frame := json.loads(await asyncio.wait_for(ws.recv(), 10)))["type"] != "done":
                pass
            assert frame["status"] == "failed", frame
        await apoll(lambda: http_get(s.url + "/health")[0] == 503, 10, "reported dead")
        status, health = http_get(s.url + "/health")
        assert status == 503 and json.loads(health)["status"] == "engine_dead"
        assert http_get(s.url + "/ready")[0] == 503
        await ws.send(json.dumps({"type": "generate", "id": "after", "prompt_token_ids": [5] * 4,
                                  "params": {"max_tokens": 4}}))
        refused = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert refused["type"] == "error" and refused["code"] == "internal_error"
        assert refused["id"] == "after" and refused["retryable"]
        try:
            await client.completions.create(model="tiny", prompt=[5] * 4, max_tokens=4)
            raise AssertionError("a request was served by a dead engine")
        except openai.APIStatusError as e:
            assert (e.status_code, e.code) == (500, "internal_error")
        await client.close()
        for w in sockets:
            await w.close()
        assert s.gateway.inflight_total == 0
        print(f"\nchaos engine fault: {len(streams)} socket streams + 1 SSE + 1 whole, fault "
              f"in step {failed[0]}; all failed with internal_error {1000 * ended:.0f} ms after "
              f"the fault was armed; still healthy; dead after {MAX_STEP_FAULTS} failed steps in a "
              "row: /health 503 engine_dead, new requests refused")
    # (leaving the block shut the server down: run_server joins its thread)

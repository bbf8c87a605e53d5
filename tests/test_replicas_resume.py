"""Streams and responses across replicas on one Redis (the KV tier's, which also holds
what the replicas share: service/shared_state.py): a resumable chat stream dropped on
one replica is continued by another from its record, with the uninterrupted run's text
(raw client, and the Python SDK through the TCP cut-proxy); a running Response is followed
from another replica and taken over when its replica is killed; a stored Response is
continued, retrieved, replayed and deleted on any replica. Two servers and a Redis per
module: `make scale-out` runs this (with the replicas behind HAProxy), `make test`
leaves it out for time; `pytest` with no arguments runs it."""

from __future__ import annotations

import json
import time

import openai
import pytest

from engine import EngineConfig
from service.config import Limits, ServiceConfig
from tests.servers import run_server
from tests.test_agent_apis import _until_end, oai
from tests.test_sse_resume import BODY, MESSAGES, content, read, stream

TINY = "tiny"  # the replicas' model name

SEEDED = {"temperature": 1.0, "top_p": 0.9, "seed": 7, "frequency_penalty": 0.5}


def _replica_config(model, redis_url: str) -> ServiceConfig:  # noqa: ANN001 - a model dir
    from engine.config import TierConfig

    return ServiceConfig(engine=EngineConfig(model=str(model), dtype="float32",
                                             tier=TierConfig("redis", redis_url)),
                         model_name="tiny", limits=Limits(resume_grace=30.0))


@pytest.fixture(scope="module")
def replicas(tiny_chat_model, module_redis):
    """Two replicas on one Redis (the KV tier's, and the streams' records)."""
    config = _replica_config(tiny_chat_model, module_redis.url)
    with run_server(config) as a, run_server(config) as b:
        yield a, b


def _continued(server) -> float:  # noqa: ANN001 - a RunningServer
    return server.gateway.metrics.resumes.labels("continued")._value.get()


def _resumed_on(server, path: str, before: list[dict]) -> tuple[str, list[dict], float]:  # noqa: ANN001
    """A dropped stream's id, the events `server` sends after `before` (asked with
    Last-Event-ID: their ids run on from it) and the streams it continued meanwhile."""
    cid = json.loads(before[0]["data"])["id"]
    continued = _continued(server)
    with stream("GET", f"{server.url}{path}/{cid}/events", None,
                {"Last-Event-ID": before[-1]["id"]}) as r:
        assert r.status == 200
        after = read(r)
    first = int(before[-1]["id"].split(":")[0]) + 1
    assert [int(e["id"].split(":")[0]) for e in after] == list(range(first, first + len(after)))
    return cid, after, _continued(server) - continued


def test_a_dropped_stream_is_followed_on_another_replica(replicas) -> None:
    """Two replicas on one Redis (the KV tier's): a stream that opted in on A records
    its request, events and tokens there; its client drops after event 3 and reconnects
    to B (which never saw it) with Last-Event-ID. A still runs it (its heartbeat lives),
    so B follows A's record rather than computing it again: the text is the
    uninterrupted run's, one [DONE], ids continuing, nothing continued on B."""
    a, b = replicas
    path = "/v1/chat/completions"
    with stream("POST", a.url + path, BODY) as r:
        whole = content(read(r))
    with stream("POST", a.url + path, BODY, {"X-Tidewire-Resume": "1"}) as r:
        before = read(r, until_seq=3)
    cid, after, continued = _resumed_on(b, path, before)
    assert continued == 0  # followed, not run again
    assert content(before) + content(after) == whole
    assert [e["data"] for e in after].count("[DONE]") == 1
    # ended: replayed from the record on B (SEQ alone is enough), or not found at all
    with stream("GET", f"{b.url}{path}/{cid}/events?after=3") as r:
        assert r.status == 200 and content(read(r)) == content(after)
    with stream("GET", f"{b.url}{path}/{cid}/events?after=100000") as r:
        assert r.status == 400  # past what was recorded
    with stream("GET", f"{b.url}{path}/{cid}/events", None, {"Last-Event-ID": "3:999"}) as r:
        assert r.status == 400  # not the event the record holds at 3
    with stream("GET", f"{b.url}{path}/chatcmpl-nope/events?after=3:5") as r:
        assert r.status == 404


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SEEDED], ids=["greedy", "seeded"])
def test_a_stream_whose_replica_dies_is_taken_over(replicas, module_redis, tiny_chat_model,
                                                   sampling: dict) -> None:
    """An opted-in stream on a third replica (a process of its own), which is killed
    (SIGKILL) after event 3. Its client reconnects to B with Last-Event-ID: B follows the
    record until the dead replica's heartbeat lapses, takes the stream over and
    continues it from every recorded token: the text is the uninterrupted run's (greedy
    and seeded), ids continue, one [DONE], the token count ends at max_tokens."""
    a, b = replicas
    body = {**BODY, **sampling}
    path = "/v1/chat/completions"
    with stream("POST", a.url + path, body) as r:
        whole = content(read(r))
    with _third_replica(module_redis, tiny_chat_model) as third:
        with stream("POST", third.url + path, body, {"X-Tidewire-Resume": "1"}) as r:
            before = read(r, until_seq=3)
            third.kill()
    assert int(before[-1]["id"].split(":")[1]) < body["max_tokens"], "it ended first"
    _, after, continued = _resumed_on(b, path, before)
    assert continued == 1  # B took it over
    assert content(before) + content(after) == whole
    assert [e["data"] for e in after].count("[DONE]") == 1
    assert int(after[-2]["id"].split(":")[1]) == body["max_tokens"]


def test_the_python_sdk_resumes_through_a_cut_on_either_replica(replicas) -> None:
    """tidewire_client.sse.stream_chat through the TCP cut-proxy: cut after 3 chunks, the
    reconnect goes to the same replica (which kept the stream running), then a second
    cut sends the next one to the other replica (which continues it from the Redis
    record): the chunks' text is the uninterrupted run's, in order, once. Greedy: the
    run must be long (A still generating at the second cut), and a seeded one that long
    can part from the uninterrupted run where B's recomputed context rounds differently
    from A's step-by-step one and a draw falls right on the boundary between two tokens
    (seen once in ~900 tokens at temperature 1); seeded runs are compared on 60 tokens
    above."""
    from tests.chaos.proxy import ChaosProxy
    from tidewire_client.sse import stream_chat

    # long enough that A is still generating when its second connection is cut
    params = {"model": "tiny", "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    a, b = replicas
    continued = _continued(b)

    def port(s) -> int:  # noqa: ANN001 - a RunningServer
        return int(s.url.rsplit(":", 1)[1])
    whole = "".join(c["choices"][0]["delta"].get("content") or ""
                    for c in stream_chat(a.url + "/v1", MESSAGES, **params))
    proxy = ChaosProxy(port(a)).start()
    proxy.targets = [("127.0.0.1", port(a))] * 2 + [("127.0.0.1", port(b))]
    try:
        chunks = stream_chat(f"http://127.0.0.1:{proxy.port}/v1", MESSAGES, **params)
        text, n = "", 0
        for c in chunks:
            text += c["choices"][0]["delta"].get("content") or "" if c["choices"] else ""
            n += 1
            if n in (3, 4):  # on A, then on A again: its second connection's first event
                proxy.cut()
    finally:
        proxy.stop()
    assert proxy.accepted == 3  # the POST, the reconnect to A, the one to B
    assert text == whole
    assert _continued(b) == continued  # (A lived: B followed its record)


def test_responses_are_shared_by_replicas_on_one_redis(replicas) -> None:
    """Two replicas on one Redis (--kv-tier redis): a response stored on A is continued
    (previous_response_id), retrieved and replayed on B, event for event; deleted on B,
    it is gone on A too."""
    a, b = replicas
    ca, cb = oai(a), oai(b)
    first = ca.responses.create(model=TINY, input="My name is Ada.", max_output_tokens=4)
    second = cb.responses.create(model=TINY, input="What is my name?",
                                 previous_response_id=first.id, max_output_tokens=4)
    alone = cb.responses.create(model=TINY, input="What is my name?", store=False,
                                max_output_tokens=1)
    assert second.usage.input_tokens > alone.usage.input_tokens + 5  # A's turn came along
    assert cb.responses.retrieve(first.id).output_text == first.output_text
    on_a = [e.model_dump() for e in ca.responses.retrieve(first.id, stream=True)]
    on_b = [e.model_dump() for e in cb.responses.retrieve(first.id, stream=True)]
    assert on_a == on_b and on_b[-1]["type"] == "response.incomplete"
    cb.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        ca.responses.retrieve(first.id)
    assert ca.responses.retrieve(second.id).id == second.id  # (B's, shared with A)
    # a follower (not the driving connection) gets the last event though the run is
    # shared before it goes out: a background stream, and the WebSocket mode
    events = list(ca.responses.create(model=TINY, input="Hi", max_output_tokens=6,
                                      stream=True, background=True))
    assert events[-1].type == "response.incomplete"
    with ca.responses.connect() as conn:
        conn.send({"type": "response.create", "model": TINY, "input": "Hi",
                   "max_output_tokens": 6})
        assert _until_end(conn)[-1].type == "response.incomplete"


# -- a Response still running when its replica goes --------------------------------------------

# (seeded text stays the uninterrupted run's while the continuing replica's prefill of the
# sent tokens gives the logits their decode steps gave to the last bit that matters: on
# this tiny random model, whose 49k-token distributions are nearly flat, 120 tokens held
# and one run of 400 parted after ~190; greedy held for 400)
RESPONSE = {"model": TINY, "input": "Write a long story about a lighthouse keeper.",
            "max_output_tokens": 120, "ignore_eos": True, "stream": True, "background": True}


def response_events(r, until: int | None = None) -> list[dict]:  # noqa: ANN001 - HTTPResponse
    """The Responses events of an SSE stream (to its end, or to sequence number `until`)."""
    events = []
    while raw := r.readline():
        line = raw.decode().rstrip("\r\n")
        if line.startswith("data: "):
            events.append(json.loads(line[6:]))
            if until is not None and events[-1]["sequence_number"] >= until:
                break
    return events


def output_text(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def test_a_running_response_is_followed_from_another_replica(replicas) -> None:
    """A background response runs on A; B, asked for its events, reads them from A's
    live record as A records them (A's heartbeat is alive: B does not take it over),
    event for event what A sends its own follower."""
    a, b = replicas
    body = {**RESPONSE, "max_output_tokens": 400}
    with stream("POST", a.url + "/v1/responses", body) as r:
        first = response_events(r, until=2)
        rid = first[0]["response"]["id"]
        continued = _continued(b)
        with stream("GET", f"{b.url}/v1/responses/{rid}?stream=true&starting_after=0") as rb:
            assert rb.status == 200
            on_b = response_events(rb, until=5)
            assert not a.app.state.responses._runs[rid].ended  # (read live, not its end)
            on_b += response_events(rb)
        on_a = first + response_events(r)
    assert on_b == on_a[1:]
    assert on_b[-1]["type"] == "response.incomplete"  # (max_output_tokens)
    # the WebSocket mode's response.resume on B, the same way
    from websockets.sync.client import connect

    with stream("POST", a.url + "/v1/responses", body) as r:
        first = response_events(r, until=1)
        rid = first[0]["response"]["id"]
        with connect(b.url.replace("http", "ws") + "/v1/responses") as ws:
            ws.send(json.dumps({"type": "response.resume", "response_id": rid,
                                "starting_after": 1}))
            on_b = [json.loads(ws.recv(timeout=30)) for _ in range(3)]
            assert not a.app.state.responses._runs[rid].ended
            while on_b[-1]["type"] != "response.incomplete":
                on_b.append(json.loads(ws.recv(timeout=30)))
        assert on_b == response_events(r)
    assert _continued(b) == continued  # followed, not taken over


def _third_replica(redis, model):  # noqa: ANN001, ANN202 - a RedisServer, a model dir
    from tests.servers import ServeProcess

    return ServeProcess("--model", str(model), "--dtype", "float32", "--served-model-name",
                        TINY, "--kv-tier", "redis", "--redis-url", redis.url,
                        "--resume-grace", "30", "--no-kv-prefault")


def _kill_mid_response(replica, body: dict, after: int) -> tuple[str, list[dict]]:  # noqa: ANN001
    """Start `body` on `replica` (a process), read its events to `after`, kill it."""
    with stream("POST", replica.url + "/v1/responses", body) as r:
        seen = response_events(r, until=after)
        replica.kill()
    assert seen[-1]["sequence_number"] == after, "the response ended before its replica"
    return seen[0]["response"]["id"], seen


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SEEDED], ids=["greedy", "seeded"])
def test_a_response_whose_replica_dies_is_taken_over(replicas, module_redis, tiny_chat_model,
                                                     sampling: dict) -> None:
    """A third replica (a process of its own) runs a background response and is killed
    (SIGKILL) mid-stream. B, asked for the events after the last one the client had,
    follows the live record until the dead replica's heartbeat lapses, takes it over,
    and continues it from the recorded tokens: sequence numbers run on, the text is the
    uninterrupted run's, one end; the stored response is then B's, on any replica."""

    a, b = replicas
    body = {**RESPONSE, **sampling}
    with stream("POST", a.url + "/v1/responses", body) as r:
        whole = response_events(r)
    with _third_replica(module_redis, tiny_chat_model) as third:
        rid, before = _kill_mid_response(third, body, after=8)
    continued, started = _continued(b), time.monotonic()
    with stream("GET", f"{b.url}/v1/responses/{rid}?stream=true&starting_after=8") as r:
        after = response_events(r)
    assert _continued(b) == continued + 1  # B took it over
    assert time.monotonic() - started < 30
    assert [e["sequence_number"] for e in after] == list(range(9, 9 + len(after)))
    assert output_text(before) + output_text(after) == output_text(whole)
    assert [e["type"] for e in after].count("response.incomplete") == 1
    assert after[-1]["response"]["usage"]["output_tokens"] == body["max_output_tokens"]
    done = oai(a).responses.retrieve(rid)  # shared by B when it ended
    assert done.output_text == output_text(whole)

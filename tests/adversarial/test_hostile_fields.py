"""Every field of `generate`, `resume`, `warm`, `cancel` and `ping`, and of both HTTP
completion endpoints, driven with hostile values over the whole range of their types
(hypothesis): integers to +-2**64, floats nan/inf/subnormal, strings to 1 MiB, lists to
100k, nesting to 10k, invalid UTF-8 in msgpack. After every frame:

- the engine is alive and the socket open (the frame was answered, then a ping);
- a bystander's stream on another socket keeps getting deltas;
- the server's memory stays bounded;
- no admission leaks (in-flight counts, holds, compiles back to zero once idle);
- every accepted request gets exactly one `done`.

`TIDEWIRE_ADVERSARIAL_FRAMES` sets the hostile frames per protocol (40 by default, as
`pytest` with no arguments runs it; 2,000 in `make fuzz`; `make test` leaves it out).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from engine import EngineConfig
from service.config import Limits, ServiceConfig
from tests.servers import run_server

FRAMES = int(os.environ.get("TIDEWIRE_ADVERSARIAL_FRAMES", "40"))
JSON, MSGPACK = "tidewire.v1.json", "tidewire.v1.msgpack"
RSS_GROWTH_LIMIT = 1500 << 20  # bytes the server process may grow by over the run

pytestmark = pytest.mark.slow


def rss() -> int:
    with open("/proc/self/status") as f:  # the server runs in this process (a thread)
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


class Nested:
    """A value nested `depth` lists deep, written as raw JSON / msgpack (the encoders
    themselves recurse, and refuse such depths)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def json(self) -> str:
        return "[" * self.depth + "]" * self.depth

    def msgpack(self) -> bytes:
        return b"\x91" * self.depth + b"\x90"  # fixarray(1) x depth, then []

    def __repr__(self) -> str:
        return f"Nested({self.depth})"


class BadUtf8:
    """A msgpack str whose bytes are not UTF-8."""

    def __repr__(self) -> str:
        return "BadUtf8()"


HUGE_INTS = st.one_of(st.integers(-2**64, 2**64),
                      st.sampled_from([2**63, 2**63 - 1, -2**63, 2**64, -2**64, 2**31, -1, 0]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
                   st.sampled_from([float("nan"), float("inf"), -float("inf"), 5e-324, 1e308]))
STRINGS = st.one_of(st.text(max_size=40),
                    st.sampled_from([1 << 10, 60_000, 1 << 20]).map(lambda n: "x" * n))
LISTS = st.one_of(st.lists(HUGE_INTS, max_size=8),
                  st.sampled_from([10, 1000, 100_000]).map(lambda n: list(range(n))),
                  st.sampled_from([100_000]).map(lambda n: ["s"] * n))
NESTED = st.sampled_from([40, 1000, 10_000]).map(Nested)
SCALARS = st.one_of(st.none(), st.booleans(), HUGE_INTS, FLOATS, STRINGS)
HOSTILE = st.one_of(SCALARS, LISTS, NESTED,
                    st.dictionaries(st.text(max_size=8), SCALARS, max_size=4),
                    st.dictionaries(STRINGS, st.integers(), max_size=3))

PARAM_FIELDS = ["max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
                "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "n",
                "skip_special_tokens", "response_format", "speculative", "tools",
                "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "enable_thinking",
                "reasoning_effort", "max_reasoning_tokens"]
FIELDS = {
    "generate": ["id", "prompt", "prompt_token_ids", "messages", "priority", "params",
                 *(f"params.{p}" for p in PARAM_FIELDS)],
    "resume": ["id", "after_seq", "session_id", "request", "token_ids",
               "request.params.max_tokens", "request.prompt"],
    "warm": ["id", "prompt", "prompt_token_ids", "messages"],
    "cancel": ["id"],
    "ping": ["t"],
}


def base(kind: str, rid: str) -> dict[str, Any]:
    return {
        "generate": {"type": "generate", "id": rid, "prompt": "Hi", "params": {"max_tokens": 3}},
        "resume": {"type": "resume", "id": rid, "after_seq": 0, "session_id": "gone",
                   "request": {"prompt": "Hi", "params": {"max_tokens": 3}}, "token_ids": [5]},
        "warm": {"type": "warm", "id": rid, "prompt": "Hi"},
        "cancel": {"type": "cancel", "id": rid},
        "ping": {"type": "ping", "t": 1},
    }[kind]


def put(msg: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    *parents, last = path.split(".")
    node = msg
    for p in parents:
        node = node.setdefault(p, {})
    if last == "prompt_token_ids" or last == "messages":
        node.pop("prompt", None)
    node[last] = value
    return msg


def encode(msg: Any, proto: str) -> str | bytes:
    """The message with its placeholders (Nested, BadUtf8) written raw."""
    if proto == JSON:
        marks: list[str] = []

        def default(o: Any) -> Any:
            marks.append(o.json() if isinstance(o, Nested) else '"?"')
            return f"\x00{len(marks) - 1}\x00"

        text = json.dumps(msg, default=default, allow_nan=True)
        for i, raw in enumerate(marks):
            text = text.replace(f'"\\u0000{i}\\u0000"', raw)
        return text
    raws: list[bytes] = []

    def default_mp(o: Any) -> Any:
        raws.append(o.msgpack() if isinstance(o, Nested) else b"\xa2\xff\xfe")
        return msgpack.ExtType(99, len(raws).to_bytes(4, "big"))

    data = msgpack.packb(msg, default=default_mp)
    for i, raw in enumerate(raws, 1):
        data = data.replace(msgpack.packb(msgpack.ExtType(99, i.to_bytes(4, "big"))), raw)
    return data


class Bystander(threading.Thread):
    """One long stream after another on its own socket; records when deltas arrive."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.arrivals, self.ends = url, threading.Event(), [], []

    def run(self) -> None:
        with connect(self.url, subprotocols=[JSON], max_size=None) as ws:
            json.loads(ws.recv())
            n = 0
            while not self.stop.is_set():
                n += 1
                ws.send(json.dumps({"type": "generate", "id": f"b{n}", "prompt": "Tell me",
                                    "params": {"max_tokens": 800, "ignore_eos": True}}))
                while True:
                    f = json.loads(ws.recv())
                    if f["type"] == "delta":
                        self.arrivals.append(time.monotonic())
                    elif f["type"] == "done":
                        self.ends.append(f["status"])
                        break


class Checker:
    """One socket's hostile frames and what the server answered."""

    def __init__(self, server, proto: str) -> None:  # noqa: ANN001
        self.server, self.proto = server, proto
        self.ws = connect(server.ws_url, subprotocols=[proto], max_size=None)
        self.recv()  # ready
        self.accepted: set[str] = set()
        self.dones: dict[str, int] = {}
        self.frames = 0
        self.rss_max = 0

    def recv(self) -> dict[str, Any]:
        data = self.ws.recv(timeout=60)
        return msgpack.unpackb(data) if self.proto == MSGPACK else json.loads(data)

    def send_raw(self, data: str | bytes) -> None:
        self.ws.send(data)

    def sync(self, t: int) -> None:
        """Send ping t, read up to its pong, and account for everything before it."""
        self.ws.send(encode({"type": "ping", "t": t}, self.proto))
        while True:
            f = self.recv()
            kind, rid = f.get("type"), f.get("id")
            if kind == "pong" and f.get("t") == t:
                return
            if kind in ("start", "queued", "resumed") and isinstance(rid, str):
                assert rid not in self.dones, f"{rid}: {kind} after its done"
                self.accepted.add(rid)
            elif kind == "done":
                self.dones[rid] = self.dones.get(rid, 0) + 1
                assert self.dones[rid] == 1, f"{rid}: a second done"

    def hostile(self, kind: str, field: str, value: Any, n: int) -> None:
        rid = f"{kind[0]}{n}"
        msg = put(base(kind, rid), field, value)
        self.send_raw(encode(msg, self.proto))
        self.frames += 1
        self.sync(n)
        assert self.server.app.state.engine.dead is None, "the engine died"
        self.rss_max = max(self.rss_max, rss())

    def settle(self, timeout: float = 60) -> None:
        """Every accepted request ends (cancelled), then nothing is left in flight."""
        for rid in self.accepted - set(self.dones):
            self.ws.send(encode({"type": "cancel", "id": rid}, self.proto))
        deadline = time.monotonic() + timeout
        while self.accepted - set(self.dones):
            assert time.monotonic() < deadline, self.accepted - set(self.dones)
            self.sync(-1)
        self.ws.close()
        gw = self.server.gateway
        while gw.inflight_total or gw.inflight_by_key or gw.compiling_by_key or gw.sessions:
            assert time.monotonic() < deadline, (gw.inflight_total, gw.inflight_by_key)
            time.sleep(0.01)


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    config = ServiceConfig(
        engine=EngineConfig(model=str(tiny_chat_model), dtype="float32"), model_name="tiny",
        limits=Limits(resume_grace=5, max_message_bytes=4 << 20))
    with run_server(config) as s:
        yield s


@pytest.mark.parametrize("proto", [JSON, MSGPACK])
def test_hostile_values_in_every_socket_field(server, proto) -> None:
    bystander = Bystander(server.ws_url)
    bystander.start()
    start_rss = rss()
    checker = Checker(server, proto)
    counter = iter(range(1, 10**9))
    values = HOSTILE if proto == MSGPACK else HOSTILE.filter(lambda v: not isinstance(v, bytes))
    msgpack_only = st.just(BadUtf8()) if proto == MSGPACK else st.nothing()

    @settings(max_examples=FRAMES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(kind=st.sampled_from(list(FIELDS)), data=st.data())
    def one(kind: str, data: st.DataObject) -> None:
        field = data.draw(st.sampled_from(FIELDS[kind]))
        value = data.draw(st.one_of(values, msgpack_only))
        checker.hostile(kind, field, value, next(counter))

    try:
        one()
    finally:
        bystander.stop.set()
        bystander.join(120)
    checker.settle()
    arrivals = bystander.arrivals
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    grown = checker.rss_max - start_rss
    print(f"\nadversarial {proto}: {checker.frames} hostile frames, "
          f"{len(checker.accepted)} accepted (each one done), bystander: {len(arrivals)} "
          f"deltas, max gap {max(gaps):.3f} s; RSS max {checker.rss_max >> 20} MB "
          f"(+{grown >> 20} MB)")
    assert checker.frames == FRAMES
    assert len(arrivals) > 50 and "failed" not in bystander.ends
    assert max(gaps) < 10, "the bystander's stream stalled"
    assert grown < RSS_GROWTH_LIMIT


HTTP_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens",
               "temperature", "top_p", "n", "stop", "seed", "logit_bias", "logprobs",
               "top_logprobs", "top_k", "min_tokens", "stop_token_ids", "response_format",
               "tools", "tool_choice", "stream", "stream_options", "echo", "user",
               "chat_template_kwargs", "enable_thinking", "reasoning_effort",
               "max_reasoning_tokens"]


def post(url: str, body: str) -> int:
    req = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


@pytest.mark.parametrize("chat", [True, False])
def test_hostile_values_in_every_http_field(server, chat) -> None:
    url = server.url + ("/v1/chat/completions" if chat else "/v1/completions")
    statuses: dict[int, int] = {}

    @settings(max_examples=FRAMES // 2, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(field=st.sampled_from(HTTP_FIELDS), value=HOSTILE)
    def one(field: str, value: Any) -> None:
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 3}
        body.update({"messages": [{"role": "user", "content": "Hi"}]} if chat else
                    {"prompt": "Hi"})
        body[field] = value
        status = post(url, encode(body, JSON))  # type: ignore[arg-type]
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (field, status)
        assert server.app.state.engine.dead is None

    one()
    gw = server.gateway
    deadline = time.monotonic() + 30
    while gw.inflight_total or gw.inflight_by_key or gw.http_inflight:
        assert time.monotonic() < deadline, (gw.inflight_total, gw.inflight_by_key)
        time.sleep(0.01)
    print(f"\nadversarial HTTP {'chat' if chat else 'completions'}: {sum(statuses.values())} "
          f"bodies, statuses {dict(sorted(statuses.items()))}")

"""Stateful fuzzing of the WebSocket protocol with hypothesis: random valid and invalid
messages in random order on one socket (generate, cancel, resume, warm, ping, garbage,
over-limit messages, wrong types, unicode edge cases), in JSON and msgpack, with the
protocol's invariants checked after every frame:

- every server frame decodes and has a known type; error frames carry a known code;
- the socket stays open and usable (no close) after every recoverable error;
- every accepted request (a `queued` or `start` frame) gets exactly one `done`, its
  deltas' `seq` run 1, 2, 3, ... and nothing of it arrives after its `done`;
- when the machine ends, every request still in flight is cancelled and ends, and the
  engine holds no request and no KV block.

`TIDEWIRE_WS_FUZZ_FRAMES` sets the frames per run: 1,500 in `make test`, 10,000 in
`make fuzz`."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from engine import EngineConfig
from service.config import Limits, ServiceConfig
from service.protocol import ERROR_CODES
from tests.servers import run_server

FRAMES = int(os.environ.get("TIDEWIRE_WS_FUZZ_FRAMES", "1500"))
STEPS = 50  # frames per socket (one hypothesis example)
MAX_MESSAGE = 8 * 1024
KNOWN = {"ready", "queued", "start", "delta", "done", "error", "pong", "warmed"}

pytestmark = pytest.mark.slow

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24)
JUNK = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1)  # (msgpack's)
                    | st.floats(allow_nan=False) | TEXT,
                    lambda kids: st.lists(kids, max_size=3)
                    | st.dictionaries(TEXT, kids, max_size=3), max_leaves=8)
PARAMS = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 4)},
    optional={"temperature": st.sampled_from([0, 0.7, 1.5]), "n": st.integers(1, 3),
              "seed": st.integers(0, 9), "logprobs": st.integers(0, 2),
              "stop": st.sampled_from(["\n", "e", ["a", "b"]]), "top_k": st.integers(0, 60),
              "response_format": st.sampled_from([{"type": "choice", "choice": ["x", "yz"]},
                                                  {"type": "regex", "regex": "[0-9]{1,3}"}])})
BAD_PARAMS = st.one_of(
    st.fixed_dictionaries({"max_tokens": st.sampled_from([0, -1, "4", 2.5, None, 10**9])}),
    st.fixed_dictionaries({"temperature": st.sampled_from(["hot", -1, 1e9])}),
    st.fixed_dictionaries({"bogus": JUNK}),
    st.fixed_dictionaries({"response_format": st.sampled_from(
        [{"type": "regex", "regex": "(?<=a)"}, {"type": "nope"}, "json"])}),
    st.dictionaries(TEXT, JUNK, max_size=3))


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_chat_model), dtype="float32",
                                               max_model_len=512),
                           limits=Limits(max_inflight_per_connection=8,
                                         max_message_bytes=MAX_MESSAGE))
    with run_server(config) as s:
        yield s


class Attempt:
    """One accepted request on the socket, by what its frames said."""

    def __init__(self) -> None:
        self.seq = 0
        self.done = False


class SocketMachine(RuleBasedStateMachine):
    url = ""
    sent = 0  # frames, over every run of the machine
    dones = 0  # requests that ended (each exactly once)

    def __init__(self) -> None:
        super().__init__()
        self.ws: Any = None
        self.proto = "tidewire.v1.json"
        self.ids = 0
        self.issued: list[str] = []  # ids sent in generates (any may still be live)
        self.live: dict[str, Attempt] = {}  # started, no done yet
        self.errors: dict[str, int] = {}
        self.generates: dict[str, int] = {}  # generate frames sent, by id
        self.refused: dict[str, int] = {}  # generates answered with an error, by id
        self.started: dict[str, int] = {}
        self.ended: dict[str, int] = {}
        self.pongs: list[Any] = []

    # -- plumbing ---------------------------------------------------------------------

    @initialize(proto=st.sampled_from(["tidewire.v1.json", "tidewire.v1.msgpack"]))
    def open(self, proto: str) -> None:
        self.proto = proto
        self.ws = connect(self.url, subprotocols=[proto], max_size=None, open_timeout=30)
        ready = self._decode(self.ws.recv(timeout=30))
        assert ready["type"] == "ready"

    def _encode(self, msg: Any) -> str | bytes:
        return msgpack.packb(msg) if self.proto.endswith("msgpack") else json.dumps(msg)

    def _decode(self, data: str | bytes) -> dict[str, Any]:
        if self.proto.endswith("msgpack"):
            return msgpack.unpackb(data)
        return json.loads(data)

    def _send(self, data: str | bytes) -> None:
        SocketMachine.sent += 1
        self.ws.send(data)

    def _generate(self, rid: str, body: dict[str, Any]) -> None:
        self.generates[rid] = self.generates.get(rid, 0) + 1
        self._send(self._encode({"type": "generate", "id": rid, **body}))

    def _drain(self, wait: float = 0.0) -> None:
        """Take every frame that has arrived (waiting up to `wait` for the first) and
        check it against what the socket has seen so far."""
        timeout: float | None = wait
        while True:
            try:
                data = self.ws.recv(timeout=timeout)
            except TimeoutError:
                return
            except ConnectionClosed as e:
                raise AssertionError(f"the server closed the socket: {e}") from None
            self._frame(self._decode(data))
            timeout = 0

    def _frame(self, m: dict[str, Any]) -> None:
        kind = m.get("type")
        assert kind in KNOWN, m
        rid = m.get("id")
        if kind == "error":
            assert m["code"] in ERROR_CODES and isinstance(m["message"], str), m
            self.errors[m["code"]] = self.errors.get(m["code"], 0) + 1
            if rid in self.generates and m["code"] != "unknown_id":  # (cancel's answer)
                self.refused[rid] = self.refused.get(rid, 0) + 1
            return
        if kind == "pong":
            self.pongs.append(m.get("t"))
            return
        if kind in ("queued", "start"):
            if rid not in self.live:
                self.live[rid] = Attempt()
                self.started[rid] = self.started.get(rid, 0) + 1
            return
        if kind == "delta":
            a = self.live.get(rid)
            assert a is not None, f"a delta of {rid!r}, which is not in flight: {m}"
            a.seq += 1
            assert m["seq"] == a.seq, (m, a.seq)
        elif kind == "done":
            a = self.live.pop(rid, None)
            assert a is not None, f"a done of {rid!r}, which is not in flight: {m}"
            self.ended[rid] = self.ended.get(rid, 0) + 1
            SocketMachine.dones += 1

    # -- rules: one frame each -------------------------------------------------------

    @rule(params=PARAMS, chat=st.booleans())
    def generate(self, params: dict[str, Any], chat: bool) -> None:
        self.ids += 1
        rid = f"g{self.ids}"
        self.issued.append(rid)
        body = ({"messages": [{"role": "user", "content": "hi"}]} if chat
                else {"prompt": "count:"})
        self._generate(rid, {**body, "params": params})

    @rule(params=BAD_PARAMS)
    def generate_bad_params(self, params: dict[str, Any]) -> None:
        self._generate("bad", {"prompt": "x", "params": params})

    @precondition(lambda self: self.issued)
    @rule(data=st.data())
    def reuse_an_id(self, data: st.DataObject) -> None:
        """A generate with an id sent before: refused while that one is in flight."""
        rid = data.draw(st.sampled_from(self.issued))
        self._generate(rid, {"prompt": "again", "params": {"max_tokens": 2}})

    @precondition(lambda self: self.issued)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.issued))
        self._send(self._encode({"type": "cancel", "id": rid}))

    @rule(rid=TEXT, seq=st.integers(-2, 10**12) | JUNK)
    def resume_unknown(self, rid: str, seq: Any) -> None:
        self._send(self._encode({"type": "resume", "id": "r" + rid, "after_seq": seq,
                                 "session_id": "0" * 32}))

    @rule(prompt=TEXT.filter(bool))
    def warm(self, prompt: str) -> None:
        self._send(self._encode({"type": "warm", "prompt": prompt}))

    @rule(t=JUNK)
    def ping(self, t: Any) -> None:
        self._send(self._encode({"type": "ping", "t": t}))

    @rule(msg=st.dictionaries(TEXT, JUNK, max_size=5) | JUNK)
    def wrong_shapes(self, msg: Any) -> None:
        self._send(self._encode(msg))

    @rule(kind=st.sampled_from(["generate", "cancel", "warm", "resume", "ping", "??"]),
          fields=st.dictionaries(st.sampled_from(["id", "prompt", "messages", "params",
                                                  "prompt_token_ids", "after_seq"]), JUNK,
                                 max_size=4))
    def wrong_types(self, kind: str, fields: dict[str, Any]) -> None:
        self._send(self._encode({"type": kind, **fields}))

    @rule(raw=st.binary(max_size=64) | TEXT)
    def garbage(self, raw: bytes | str) -> None:
        self._send(raw)

    @rule(factor=st.floats(1.01, 1.9))
    def over_the_limit(self, factor: float) -> None:
        """Over max_message_bytes but under the hard cap: an error, the socket stays."""
        self._send(self._encode({"type": "ping", "t": "x" * int(MAX_MESSAGE * factor)}))

    @rule(text=st.sampled_from(["\u0000", "\ud7ff\ue000", "\U0010ffff", "e\u0301", "\u202e",
                                "🧑‍🚀", "\ufeff"]))
    def unicode_edges(self, text: str) -> None:
        self.ids += 1
        rid = f"u{self.ids}"  # (an id must be printable: the text goes in the prompt)
        self.issued.append(rid)
        self._generate(rid, {"prompt": text, "params": {"max_tokens": 2, "stop": [text]}})

    @invariant()
    def frames_check_out(self) -> None:
        if self.ws is not None:
            self._drain()

    def teardown(self) -> None:
        """A ping as a barrier: every refusal is written before its pong (refusals are
        answered as messages are read), so by then each generate is known refused or
        accepted. The accepted ones still running are cancelled; each must end."""
        if self.ws is None:
            return
        try:
            self.ws.send(self._encode({"type": "ping", "t": "barrier"}))
            deadline = time.monotonic() + 20
            while "barrier" not in self.pongs and time.monotonic() < deadline:
                self._drain(wait=0.5)
            assert "barrier" in self.pongs
            # (a constraint that fails to compile is refused once its compile ends,
            # which may be after the barrier: `accepted` is recounted as errors arrive)
            def accepted() -> dict[str, int]:
                return {rid: n - self.refused.get(rid, 0) for rid, n in self.generates.items()}

            for rid, n in accepted().items():
                if self.ended.get(rid, 0) < n:
                    self.ws.send(self._encode({"type": "cancel", "id": rid}))
            while any(self.ended.get(r, 0) < n for r, n in accepted().items()) \
                    and time.monotonic() < deadline:
                self._drain(wait=0.2)
            accepted_now = accepted()
            assert all(n >= 0 for n in accepted_now.values()), (accepted_now, self.refused)
            # exactly one start and one done for each accepted generate, none for others
            assert {r: n for r, n in accepted_now.items() if n} == self.started, \
                (accepted_now, self.started)
            assert self.ended == self.started and not self.live, (self.ended, self.live)
        finally:
            self.ws.close()


def _wait_idle(server, timeout: float = 30.0) -> None:
    eng = server.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not eng.has_unfinished() and eng.kv.num_free_blocks == eng.num_blocks:
            return
        time.sleep(0.01)
    raise AssertionError(f"{eng.kv.num_free_blocks}/{eng.num_blocks} blocks free, "
                         f"unfinished: {eng.has_unfinished()}")


def test_fuzzed_sockets_keep_every_invariant(server) -> None:
    SocketMachine.url = server.ws_url
    SocketMachine.sent = 0
    # Batches of examples until FRAMES frames have gone out (an example can stop before
    # its last step); the first batch is derandomized, later ones draw fresh examples.
    batch = 0
    while SocketMachine.sent < FRAMES:
        left = FRAMES - SocketMachine.sent
        run_state_machine_as_test(SocketMachine, settings=settings(
            max_examples=max(1, int(left / STEPS / 0.8)), stateful_step_count=STEPS,
            deadline=None, derandomize=batch == 0, database=None,
            suppress_health_check=list(HealthCheck)))
        batch += 1
    _wait_idle(server)
    print(f"fuzzed frames: {SocketMachine.sent}, requests ended: {SocketMachine.dones}")
    assert SocketMachine.sent >= FRAMES and SocketMachine.dones > 0

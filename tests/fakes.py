"""Test doubles for the socket code: a FrameSink, a client WebSocket and an AsyncEngine,
so that Session, Sender and Gateway run without uvicorn, a model or threads.

FakeEngine is not a stub: it really produces outputs. Each request echoes its prompt's
token ids, one token per sample per tick of a loop task, through the engine's own
RequestStream (as AsyncEngine's dispatch does), until max_tokens ("length"), an abort
("abort"), or for ever while parked (no tokens then). A wrong listener, a lost step or a
missing done therefore fails a test."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from engine import SamplingParams
from engine.request_stream import RequestStream
from engine.outputs import StepOutput
from engine.request import Request
from engine.stats import EngineStats
from service.protocol import Codec
from service.sink import SocketState


class FakeEngine:
    """The AsyncEngine methods Gateway and Session call (see the module docstring)."""

    max_model_len = 1024
    block_size = 16
    prefix_caching = True
    template_renders_tools = False
    max_prompt_bytes: int | None = None
    sampling_defaults: dict[str, float] = {}
    running = True
    dead = None

    def __init__(self, tick: float = 0.001) -> None:
        self.tick = tick
        self.stats = EngineStats(max_num_seqs=64)
        self.streams: dict[str, _Job] = {}
        self.parked: set[str] = set()
        self.aborting: set[str] = set()
        self.calls: list[tuple[str, str]] = []  # (abort | park | unpark, request id)
        self._loop_task: asyncio.Task[None] | None = None

    # -- what Gateway and Session call ---------------------------------------------------

    def queued(self) -> int:
        return 0

    def tokenize(self, prompt: str | list[int], any_thread: bool = False) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else [ord(c) % 300 for c in prompt]

    def apply_chat_template(self, messages: list[dict[str, Any]], generation_prompt: bool,
                            tools: Any = None, any_thread: bool = False) -> list[int]:
        return self.tokenize(" ".join(str(m.get("content")) for m in messages))

    def format_ready(self, params: SamplingParams) -> bool:
        return params.response_format is None

    def format_started(self, params: SamplingParams) -> bool:
        return False

    async def prepare(self, params: SamplingParams) -> None:
        await asyncio.sleep(0)

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, salt: bytes = b"",
                    output_token_ids: Any = ()) -> RequestStream:
        rid = request_id or f"r{len(self.streams)}"
        req = Request(rid, self.tokenize(prompt), params)
        stream = RequestStream(req)
        if output_token_ids:
            first = stream.output.outputs[0]
            first.token_ids.extend(output_token_ids)
            first.add_text("".join(f"{t} " for t in output_token_ids))
        produced = [len(output_token_ids)] + [0] * (params.n - 1)
        self.streams[rid] = _Job(req, stream, produced)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._run())
        return stream

    def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))
        if request_id in self.streams:
            self.aborting.add(request_id)

    def park(self, request_id: str) -> None:
        self.calls.append(("park", request_id))
        self.parked.add(request_id)

    def unpark(self, request_id: str) -> None:
        self.calls.append(("unpark", request_id))
        self.parked.discard(request_id)

    # -- the "engine thread": a loop task ------------------------------------------------

    async def _run(self) -> None:
        while self.streams:
            await asyncio.sleep(self.tick)
            for rid, job in list(self.streams.items()):
                if rid in self.aborting or rid not in self.parked:
                    self._step(rid, job)

    def _step(self, rid: str, job: _Job) -> None:
        """One step of every unfinished sample: the next prompt token, echoed."""
        aborted = rid in self.aborting
        prompt, done = job.req.prompt_token_ids, False
        for i, n in enumerate(job.produced):
            if n < 0:  # finished
                continue
            token = prompt[n % len(prompt)]
            last = aborted or n + 1 >= job.req.params.max_tokens
            out = StepOutput(request_id=rid, new_token_ids=[] if aborted else [token],
                             text_delta="" if aborted else f"{token} ", finished=last,
                             finish_reason=("abort" if aborted else "length") if last else None,
                             index=i, num_prompt_tokens=len(prompt),
                             sampled_at=time.monotonic())
            job.produced[i] = -1 if last else n + 1
            done = job.stream._push(out)  # (AsyncEngine._dispatch does the same)
        if done:
            del self.streams[rid]
            self.aborting.discard(rid)


@dataclass
class _Job:
    req: Request
    stream: RequestStream
    produced: list[int]  # tokens of each sample so far; -1 once it finished


class FakeSink:
    """A FrameSink in memory: what is written lands decoded in `frames`. `block()`
    makes writes wait (the transport's flow control) until `unblock()`; `die()` makes
    every write fail, as a socket whose client is gone."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.state = SocketState.OPEN
        self.blocked_since: float | None = None
        self.frames: list[dict[str, Any]] = []
        self.states: list[SocketState] = []  # every transition, in order
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._dead = False
        self._half_sent: bytes | str | None = None

    def block(self) -> None:
        self._flowing.clear()

    def unblock(self) -> None:
        self._flowing.set()

    def die(self) -> None:
        self._dead = True
        self._flowing.set()  # (a waiting send fails now)

    def _set(self, state: SocketState) -> None:
        if state is not self.state:
            self.state = state
            self.states.append(state)

    def _take(self, data: bytes | str) -> None:
        self.frames.append(json.loads(data) if isinstance(data, str)
                           else self.codec.decode(data))

    def try_write(self, data: bytes | str) -> bool:
        if self._dead:
            self._set(SocketState.GONE)
            return False
        if not self._flowing.is_set():
            self._half_sent = data
            self._set(SocketState.DRAINING)
            return False
        self._take(data)
        return True

    async def flush(self) -> bool:
        if self._half_sent is None:
            return self.state is not SocketState.GONE
        data, self._half_sent = self._half_sent, None
        return await self._wait(data)

    async def send(self, data: bytes | str) -> bool:
        if self.state is SocketState.GONE:
            return False
        if self._flowing.is_set() and not self._dead:
            self._take(data)
            return True
        return await self._wait(data)

    async def _wait(self, data: bytes | str) -> bool:
        self._set(SocketState.DRAINING)
        self.blocked_since = time.monotonic()
        try:
            await self._flowing.wait()
        finally:
            self.blocked_since = None
        if self._dead:
            self._set(SocketState.GONE)
            return False
        self._take(data)
        self._set(SocketState.OPEN)
        return True


class FakeSocket:
    """The client end of a Session: `send(msg)` is a client message, `drop()` the
    client going away; what the server closed with is in `closed`."""

    def __init__(self) -> None:
        self.incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.closed: tuple[int, str] | None = None

    def send(self, msg: dict[str, Any]) -> None:
        self.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(msg)})

    def drop(self) -> None:
        self.incoming.put_nowait({"type": "websocket.disconnect", "code": 1006})

    async def receive(self) -> dict[str, Any]:
        return await self.incoming.get()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed = (code, reason)
        self.drop()

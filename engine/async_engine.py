"""The event loop's side of the engine: AsyncEngine (each request's stream of outputs:
engine/request_stream.py).

One dedicated thread owns the LLMEngine (engine/engine_thread.py). The loop talks to it
only through its inbox of commands (add, abort / park / unpark, stop) and reads only
what it publishes: each step's outputs through the Outbox (engine/outbox.py), which
AsyncEngine routes to the requests' streams, and a frozen stats snapshot.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from engine import prepare
from engine.engine_thread import Add, Control, EngineThread, Stop
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import cache_root
from engine.outbox import Outbox
from engine.outputs import RequestOutput, StepOutput
from engine.progress import LoadProgress
from engine.request_stream import RequestStream
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats


class AsyncEngine:
    """The loop's client of the engine thread; `await start()` inside a running event loop.

    Thread ownership: call it on the loop, except `stats` and `dead` (any thread),
    `tokenize` / `apply_chat_template` with `any_thread`, and `byte_table` (the service
    builds it on a worker thread at startup). Every torch op, loading included, runs on
    the engine thread (EngineThread); the loop reads only the LLMEngine's parts that are
    read-only after load (tokenizer, limits, grammar compiler) and what the thread
    publishes."""

    def __init__(self, config: EngineConfig, handoff: float = 0.005) -> None:
        """`handoff`: after publishing a step, the engine thread waits up to this many
        seconds for the event loop to take the outputs and run the tasks they woke (the
        socket writers) before it starts the next step (0: never waits). Without it the
        loop had to win the GIL back from the next step's Python work (0.4 ms on average
        before dispatch even began) and the writers were stretched by the same
        contention. The wait is what the fan-out costs (the loop writes every socket
        inside the dispatch: ~1.5-3 ms at 64 streams on a 2-core VM, against a ~900 ms
        CPU step at that batch); the bound only matters when the loop is busy."""
        self.config = config
        c = config
        self.progress = LoadProgress(  # read by the loop (/health) while the thread loads
            f"{c.model}|{c.dtype}|{c.quantization}|{c.attention_backend}|{c.kv_cache_memory}"
            f"{'|kv' + c.cache.dtype if c.cache.dtype != 'auto' else ''}",
            cache_root() / "startup")
        self._engine_thread = EngineThread(config, self.progress, handoff)
        self._thread: threading.Thread | None = None
        self._outbox: Outbox | None = None
        self._streams: dict[str, RequestStream] = {}
        self._adds_sent = 0  # requests put in the inbox

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread and wait until it has loaded the model."""
        loop = asyncio.get_running_loop()
        self._outbox = Outbox(loop, self._dispatch)
        loaded: asyncio.Future[None] = loop.create_future()
        self._thread = self._engine_thread.start(loop, self._outbox, loaded,
                                                 self._fail_streams)
        try:
            await loaded
        except BaseException:  # the model did not load, or start() was cancelled while it
            self._thread = None  # loaded: then the thread stops itself once loaded
            self._outbox.close()
            raise

    async def shutdown(self) -> None:
        """Abort everything still running and join the engine thread."""
        if self._thread is None:
            return
        self._engine_thread.put(Stop())
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        assert self._outbox is not None
        self._outbox.take()  # the aborts published on the way out
        self._outbox.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def dead(self) -> BaseException | None:
        """What killed the engine thread (None while it lives)."""
        return self._engine_thread.dead

    # -- what the service may read (set at load, or published by the engine thread) ------

    @property
    def engine(self) -> LLMEngine:
        """The LLMEngine, once loaded: the engine thread's. The loop reads only what
        this class exposes; tests reach in."""
        return self._engine_thread.engine

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer or None
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def template_renders_tools(self) -> bool:
        return self.engine.template_renders_tools

    @property
    def vocab_size(self) -> int:
        return self.engine.arch.vocab_size

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """The model's sampling defaults (generation_config.json, else the registry)."""
        return dict(self.engine.sampling_defaults)

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def prefix_caching(self) -> bool:
        return self.config.cache.enable_prefix_caching

    @property
    def stats(self) -> EngineStats:
        """The engine as of its last step (a frozen snapshot; any thread may read it)."""
        return self._engine_thread.stats

    def queued(self) -> int:
        """Requests waiting for a batch slot: the last snapshot's, plus those sent since
        that the engine thread has not taken yet."""
        st = self._engine_thread.stats
        return st.waiting + self._adds_sent - st.adds_taken

    def tokenize(self, prompt: str | list[int], any_thread: bool = False) -> list[int]:
        """The prompt's ids, as /v1/completions feeds them to the model (no special
        tokens added; ids are checked). The tokenizer is read-only after load: safe
        from the loop; `any_thread` also from another thread (LLMEngine.tokenize)."""
        return self.engine.tokenize(prompt, any_thread)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            any_thread: bool = False) -> list[int]:
        return self.engine.apply_chat_template(messages, generation_prompt, tools, any_thread)

    @property
    def max_prompt_bytes(self) -> int | None:
        """The most UTF-8 bytes a prompt that fits the context can have (None: unknown)."""
        return self.engine.max_prompt_bytes

    def byte_table(self, skip_special_tokens: bool) -> list[bytes] | None:
        """The detokenizer's per-token bytes (built once, on first use)."""
        return self.engine.byte_table(skip_special_tokens)

    # -- requests --------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, salt: bytes = b"",
                    output_token_ids: Sequence[int] = ()) -> RequestStream:
        """Validate and enqueue; raises ValueError for a bad prompt or parameters.
        `output_token_ids`: continue a stream begun elsewhere from the tokens it had
        produced (LLMEngine.make_request); the stream's output starts with them."""
        if not self.running or self.dead is not None:
            raise RuntimeError("engine is not running"
                               + (f" (its thread died: {self.dead!r})" if self.dead else ""))
        req = self.engine.make_request(prompt, params, request_id, salt, output_token_ids)
        if req.request_id in self._streams:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        stream = RequestStream(req)
        if req.output_token_ids:
            first = stream.output.outputs[0]
            first.token_ids.extend(req.output_token_ids)
            first.add_text(self.engine.continued_text(req))
        self._streams[req.request_id] = stream
        self._adds_sent += 1
        self._engine_thread.put(Add(req))
        return stream

    def format_ready(self, params: SamplingParams) -> bool:
        """Whether the request can be added without waiting for a compile (see
        engine/prepare.py). Starts nothing: `prepare` compiles."""
        return prepare.format_ready(self.engine.grammars, params)

    def format_started(self, params: SamplingParams) -> bool:
        """Whether the request's constraint is compiled or compiling already."""
        return prepare.format_started(self.engine.grammars, params)

    async def prepare(self, params: SamplingParams) -> None:
        """Compile the request's response_format before it is added (a no-op when it is
        unconstrained or compiled); raises ValueError naming the problem."""
        await prepare.prepare(self.engine.grammars, params)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed before the engine's next step."""
        if request_id in self._streams:
            self._engine_thread.put(Control("abort", request_id))

    def park(self, request_id: str) -> None:
        """Take a request out of the batch before the next step, freeing its blocks but
        keeping its state (its client went away and may come back to resume)."""
        if request_id in self._streams:
            self._engine_thread.put(Control("park", request_id))

    def unpark(self, request_id: str) -> None:
        """Put a parked request back in the queue; it recomputes its KV (mostly cache
        hits) and goes on generating where it stopped."""
        if request_id in self._streams:
            self._engine_thread.put(Control("unpark", request_id))

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None,
                       salt: bytes = b"") -> AsyncIterator[RequestOutput]:
        """Stream outputs; leaving the loop early (break, cancel) aborts the request."""
        stream = self.add_request(prompt, params, request_id, salt)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def _dispatch(self, outs: list[StepOutput]) -> None:
        """Route one published output list to its streams (the Outbox's delivery)."""
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if stream._push(out):  # every sample has finished: no more outputs can come
                del self._streams[out.request_id]

    def _fail_streams(self, message: str) -> None:
        """After the engine thread died: everything it published goes out first, then
        each stream still open gets an error output per unfinished sample."""
        assert self._outbox is not None
        self._outbox.take()
        outs = [StepOutput(request_id=rid, new_token_ids=[], finished=True,
                           finish_reason="error", index=i, error=message)
                for rid, stream in list(self._streams.items())
                for i in range(len(stream.output.outputs)) if i not in stream.done_indexes]
        if outs:
            self._dispatch(outs)

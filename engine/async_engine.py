"""asyncio facade over the engine thread.

One dedicated thread owns the LLMEngine (scheduler, blocks, KV tensors, model). The
event loop talks to it only through a thread-safe inbox of commands (Add, abort / park /
unpark, Stop), and the thread publishes each step's outputs (sampled and detokenized)
with a single wake-up of the loop (a byte on a socket pair; see `_publish`) — never one
callback per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import queue
import socket
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from engine.llm_engine import EngineConfig, LLMEngine
from engine.loader import cache_root
from engine.runtime import HeapTrimmer
from engine.outputs import CompletionOutput, RequestOutput, StepOutput
from engine.progress import LoadProgress
from engine.request import Request, RequestStatus
from engine.runner import request_fault
from engine.sampling_params import SamplingParams
from engine.structured import GrammarError
from engine.stats import EngineStats

log = logging.getLogger("tidewire.engine")


@dataclass
class _Add:
    request: Request


@dataclass
class _Control:
    op: str  # abort | park | unpark
    request_id: str


class _Stop:
    pass


class RequestStream:
    """Async iterator of RequestOutput for one request; ends once every sample is done.

    Each yielded RequestOutput carries one delta (`index`, `new_token_ids`,
    `delta_text`) and shares the live cumulative `outputs` list. Steps that queued up
    while the consumer was busy are merged into one delta per sample, never dropped."""

    __slots__ = ("request_id", "output", "_pending", "_ready", "listener", "queue_time",
                 "sampled_at", "done_indexes", "finished")

    def __init__(self, request: Request) -> None:
        self.request_id = request.request_id
        self.output = RequestOutput(request.request_id, list(request.prompt_token_ids),
                                    [CompletionOutput(i) for i in range(request.params.n)])
        self._pending: deque[StepOutput] = deque()
        self._ready = asyncio.Event()
        # Called (on the loop thread) instead of waking an iterator when outputs arrive;
        # a consumer that owns many streams (a socket's writer) pulls them with take().
        self.listener: Callable[[], None] | None = None
        self.queue_time = 0.0
        self.sampled_at = 0.0
        self.done_indexes: set[int] = set()  # samples whose finished output has arrived
        self.finished = False

    def _push(self, out: StepOutput) -> bool:
        """Queue a step's output; True once every sample has its finished output."""
        self._pending.append(out)
        if out.finished:
            self.done_indexes.add(out.index)
        if self.listener is not None:
            self.listener()
        else:
            self._ready.set()
        return len(self.done_indexes) == len(self.output.outputs)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        out = self.take()
        assert out is not None
        return out

    def take_step(self) -> StepOutput | None:
        """The next delta without waiting (consecutive steps of one sample merged into
        one), already folded into `output`; None when nothing is pending."""
        pending = self._pending
        if not pending:
            return None
        step = pending.popleft()
        while pending and pending[0].index == step.index and not step.finished:
            step = _merge(step, pending.popleft())
        o = self.output
        o.apply(step)
        self.queue_time = step.queue_time
        self.sampled_at = step.sampled_at  # of the oldest token in this (merged) delta
        self.finished = o.finished
        return step

    def take(self) -> RequestOutput | None:
        """take_step() as a RequestOutput: the delta plus the cumulative samples."""
        if self.take_step() is None:
            return None
        o = self.output
        return RequestOutput(o.request_id, o.prompt_token_ids, o.outputs, o.finished,
                             o.num_cached_tokens, o.index, o.new_token_ids, o.delta_text, o.error,
                             o.num_host_cached_tokens, o.spec_by_sample)


def _merge(a: StepOutput, b: StepOutput) -> StepOutput:
    """Two consecutive deltas of one sample as one."""
    lps = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return StepOutput(request_id=a.request_id, new_token_ids=a.new_token_ids + b.new_token_ids,
                      text_delta=a.text_delta + b.text_delta, finished=b.finished,
                      finish_reason=b.finish_reason, index=a.index,
                      num_prompt_tokens=b.num_prompt_tokens,
                      num_cached_tokens=b.num_cached_tokens, logprobs=lps,
                      stop_reason=b.stop_reason, error=b.error, queue_time=a.queue_time,
                      sampled_at=a.sampled_at or b.sampled_at,
                      num_host_cached_tokens=b.num_host_cached_tokens,
                      spec=b.spec if b.spec is not None else a.spec)


class AsyncEngine:
    """Owns the engine thread; `await start()` inside a running event loop.

    Every torch op, loading included, runs on the engine thread. (With GNU OpenMP, once
    another thread has run a parallel region its idle worker keeps spinning on a core,
    and the engine's own parallel regions then ran 4-10x slower on this 2-core machine;
    see docs/performance.md.)"""

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
        self.handoff = handoff
        self._handed = threading.Event()
        self._handed_off = False  # this iteration's outputs went out
        self.engine: LLMEngine = None  # type: ignore[assignment]  # built by the thread
        c = config
        self.progress = LoadProgress(  # read by the loop (/health) while the thread loads
            f"{c.model}|{c.dtype}|{c.quantization}|{c.attention_backend}|{c.kv_cache_memory}"
            f"{'|kv' + c.cache.dtype if c.cache.dtype != 'auto' else ''}",
            cache_root() / "startup")
        self._inbox: queue.SimpleQueue[_Add | _Control | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Step outputs cross to the loop through this deque; a byte on the socket pair
        # wakes the loop to take them (see _publish).
        self._outbox: deque[list[StepOutput]] = deque()
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self.dead: BaseException | None = None
        # Published by the engine thread after every step (one reference swap), read by
        # the loop: the service never reads the scheduler or the block manager itself.
        self._stats = EngineStats()
        self._adds_sent = 0  # loop side: requests put in the inbox
        self._adds_taken = 0  # engine side: requests taken out of it

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread and wait until it has loaded the model."""
        self._loop = asyncio.get_running_loop()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._loop.add_reader(self._wake_r.fileno(), self._take_outbox)
        loaded: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(loaded,), name="tidewire-engine",
                                        daemon=True)
        self._thread.start()
        try:
            await loaded
        except BaseException:  # the model did not load, or start() was cancelled while it
            self._thread = None  # loaded: then the thread stops itself once loaded
            self._close_wake()
            raise

    # -- what the service may read (set at load, or published by the engine thread) ------

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
        return self._stats

    def queued(self) -> int:
        """Requests waiting for a batch slot: the last snapshot's, plus those sent since
        that the engine thread has not taken yet (call it on the loop)."""
        st = self._stats
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

    async def shutdown(self) -> None:
        """Abort everything still running and join the engine thread."""
        if self._thread is None:
            return
        self._inbox.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self._take_outbox()  # the aborts published on the way out
        self._close_wake()

    def _close_wake(self) -> None:
        assert self._loop is not None and self._wake_r is not None and self._wake_w is not None
        self._loop.remove_reader(self._wake_r.fileno())
        self._wake_r.close()
        self._wake_w.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- requests (event loop side) ------------------------------------------------------

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
        self._inbox.put(_Add(req))
        return stream

    def format_ready(self, params: SamplingParams) -> bool:
        """Whether the request can be added without waiting for a compile: it is
        unconstrained, or its constraint has compiled. Raises ValueError when that
        compile failed. (Starts nothing: `prepare` compiles.)"""
        fmt = params.response_format
        if fmt is None:
            return True
        if self.engine.grammars is None:
            raise ValueError("response_format needs a model with a tokenizer")
        fut = self.engine.grammars.peek(fmt)
        if fut is None or not fut.done() or fut.cancelled():
            return False
        fut.result()
        return True

    def format_started(self, params: SamplingParams) -> bool:
        """Whether the request's constraint is compiled or compiling already (a request
        that waits for it starts no compile of its own)."""
        fmt, grammars = params.response_format, self.engine.grammars
        fut = grammars.peek(fmt) if fmt is not None and grammars is not None else None
        return fut is not None and not fut.cancelled()

    async def prepare(self, params: SamplingParams) -> None:
        """Compile the request's response_format on the engine's grammar workers (a
        no-op when it is unconstrained or already compiled), so that a bad constraint
        is refused before the request is added; raises ValueError naming the problem.
        The engine keeps stepping meanwhile. A wait that times out or is cancelled (the
        client left) stops waiting for the compile: one nobody waits for any more is
        cancelled if it has not started (GrammarCompiler.release)."""
        fmt = params.response_format
        grammars = self.engine.grammars
        if fmt is None:
            return
        if grammars is None:
            raise ValueError("response_format needs a model with a tokenizer")
        fut = grammars.submit(fmt)
        if fut.done():
            fut.result()
            return
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), grammars.timeout)
        except asyncio.TimeoutError:
            grammars.release(fmt)
            raise GrammarError(f"the {fmt.kind} constraint took over {grammars.timeout:g}s "
                               "to compile; simplify it") from None
        except asyncio.CancelledError:
            grammars.release(fmt)
            task = asyncio.current_task()
            if fut.cancelled() and not (task is not None and task.cancelling()):
                raise GrammarError(f"the {fmt.kind} constraint's compile was cancelled; "
                                   "send the request again") from None
            raise

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed before the engine's next step."""
        if request_id in self._streams:
            self._inbox.put(_Control("abort", request_id))

    def park(self, request_id: str) -> None:
        """Take a request out of the batch before the next step, freeing its blocks but
        keeping its state (its client went away and may come back to resume)."""
        if request_id in self._streams:
            self._inbox.put(_Control("park", request_id))

    def unpark(self, request_id: str) -> None:
        """Put a parked request back in the queue; it recomputes its KV (mostly cache
        hits) and goes on generating where it stopped."""
        if request_id in self._streams:
            self._inbox.put(_Control("unpark", request_id))

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
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if stream._push(out):  # every sample has finished: no more outputs can come
                del self._streams[out.request_id]
        # Runs after the callbacks and task steps this dispatch scheduled (FIFO), i.e.
        # after the writers it woke have sent their frames.
        self._loop.call_soon(self._handed.set)  # type: ignore[union-attr]

    # -- the engine thread -------------------------------------------------------------

    def _run(self, loaded: asyncio.Future[None]) -> None:
        assert self._loop is not None
        try:
            self.engine = LLMEngine(self.config, self.progress)
        except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
            self._tell_loaded(loaded, e)
            return
        log.info("engine ready in %.1f s", self.progress.finish())
        self._stats = self.engine.stats()
        if not self._tell_loaded(loaded, None):
            return
        eng = self.engine
        self.trimmer = HeapTrimmer()  # (off unless the entry point tuned the allocator)
        overlap = self.config.async_output and eng.runner.overlaps
        # The loop is a pipeline: take commands, then schedule and launch a step, and
        # finish the previous one (send its outputs) once this one is under way.
        # `pending` carries what is still to go out from one turn to the next.
        pending: list[StepOutput] = []
        try:
            while True:
                idle = not pending and not eng.has_unfinished()
                if not self._drain(block=idle, outs=pending):  # aborts' outputs join pending
                    break
                pending = self._step(pending, overlap)
                self._stats = eng.stats(self._adds_taken)
                if self.trimmer.maybe():
                    log.debug("heap trimmed (%d trims, %.3f s in all)", self.trimmer.trims,
                              self.trimmer.seconds)
        except BaseException as e:  # the engine is broken: fail every request, loudly
            log.exception("engine thread died")
            self.dead = e
            self._fail_all(repr(e))
            return
        # what was drained before the stop, then every request still running, aborted
        self._publish(pending + eng.abort(eng.request_ids()))
        try:
            eng.close()  # flush cached prefix blocks to the host tier
        except Exception:  # noqa: BLE001 - shutting down regardless
            log.exception("closing the engine failed")

    def _step(self, previous: list[StepOutput], overlap: bool) -> list[StepOutput]:
        """One turn of the pipeline: run a step (if there is work), handing `previous`
        off while it runs; returns this step's outputs when they must wait for the next
        step (overlap), else []. With `overlap` (a GPU step is one graph enqueue) the
        previous outputs go out once this step's forward is on the device, so the
        loop's fan-out overlaps the GPU's work. Without it (the CPU computes the whole
        step) they go out with this step's own, before its block bookkeeping."""
        eng = self.engine
        self._handed_off = False
        if not eng.has_unfinished():
            self._hand_off(previous)
            return []
        current: list[StepOutput] = []
        if overlap:
            current = eng.step(launched=partial(self._hand_off, previous))
        else:
            eng.step(lambda outs: self._hand_off(previous + outs))
        if not self._handed_off:  # the step ran nothing
            self._hand_off(previous)
        if current and not eng.has_unfinished():  # no next step to wait for
            self._hand_off(current)
            current = []
        return current

    def _tell_loaded(self, loaded: asyncio.Future[None], error: BaseException | None) -> bool:
        """Resolve start()'s future from the engine thread; False if the loop is gone."""
        def resolve() -> None:
            if loaded.cancelled():  # start() was cancelled while loading: nobody will
                self._inbox.put(_Stop())  # use this engine, so the thread ends
            elif error is not None:
                loaded.set_exception(error)
            else:
                loaded.set_result(None)

        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(resolve)
        except RuntimeError:  # the event loop is closed (the process is shutting down)
            return False
        return True

    def _drain(self, block: bool, outs: list[StepOutput]) -> bool:
        """Apply queued commands; False once Stop arrives."""
        cmds = [self._inbox.get()] if block else []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for cmd in cmds:
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Add):
                self._adds_taken += 1
                try:
                    outs.extend(self.engine.add(cmd.request))
                except ValueError as e:  # an id still in flight: fail it, keep running
                    r = cmd.request
                    outs.extend(StepOutput(request_id=r.request_id, new_token_ids=[],
                                           finished=True, finish_reason="error", index=i,
                                           error=str(e)) for i in range(r.params.n))
                continue
            try:
                outs.extend(self._control(cmd))
            except Exception as e:  # noqa: BLE001 - one request's fault: it fails alone
                outs.extend(self.engine.fail(cmd.request_id, request_fault(cmd.op, e)))
        # (no stats here: requests just taken are not waiting until a schedule says so)
        return True

    def _control(self, cmd: _Control) -> list[StepOutput]:
        if cmd.op == "abort":
            return self.engine.abort([cmd.request_id])
        if cmd.op == "park":
            self.engine.park([cmd.request_id])
        else:
            self.engine.unpark([cmd.request_id])
        return []

    def _hand_off(self, outs: list[StepOutput]) -> None:
        """Publish, then give the loop the time to send them (see `handoff`). The stats
        go first: whoever sees a step's outputs sees stats at least that new."""
        self._handed_off = True
        if not outs:
            return
        self._stats = self.engine.stats(self._adds_taken)
        self._handed.clear()
        self._publish(outs)
        if self.handoff > 0:
            self._handed.wait(self.handoff)

    def _publish(self, outs: list[StepOutput]) -> None:
        """Hand a step's outputs to the event loop (from the engine thread).

        Why a socket pair rather than call_soon_threadsafe (an eventfd under uvloop):
        the engine thread blocks right after this (the hand-off wait), and a write to
        a socket is a wake-up the kernel may treat as synchronous (the waker is about
        to sleep), running the loop on this core instead of waking the idle one. On
        this project's 2-vCPU VM, where waking an idle vCPU is expensive, the time
        from sampling to the dispatch starting fell by 0.03-0.08 ms at 64 streams in
        paired runs."""
        if not outs:
            return
        self._outbox.append(outs)
        try:
            self._wake_w.send(b"\0")  # type: ignore[union-attr]
        except OSError:  # full of wake-ups already (the loop is coming), or shut down
            pass

    def _take_outbox(self) -> None:
        """On the loop: dispatch every output list published so far, in order."""
        try:  # one read: any wake-ups left over just run this once more, with nothing to do
            self._wake_r.recv(4096)  # type: ignore[union-attr]
        except OSError:  # nothing there (BlockingIOError), or closed at shutdown
            pass
        box = self._outbox
        # No garbage collection in the middle of a fan-out: the allocations of 64
        # deltas trip a young-generation pass in front of some socket's write. It
        # runs on the next allocation past the threshold instead, after the writes.
        collecting = gc.isenabled()
        if collecting:
            gc.disable()
        try:
            while box:
                self._dispatch(box.popleft())
        finally:
            if collecting:
                gc.enable()

    def _fail_all(self, message: str) -> None:
        """(Engine thread, which then exits.) Finish every request the engine holds with
        an error, then, on the loop, every stream still unfinished (ones in the inbox):
        `dead` is set by then, so add_request refuses anything newer, and the sweep
        running on the loop cannot miss a stream added concurrently."""
        try:
            outs = self.engine.abort(self.engine.request_ids(), RequestStatus.FINISHED_ERROR)
        except Exception:  # noqa: BLE001 - the engine's state may be what broke
            log.exception("aborting the engine's requests failed")
            outs = []
        for o in outs:
            o.error = message
        self._publish(outs)
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(self._fail_streams, message)

    def _fail_streams(self, message: str) -> None:
        """On the loop, after the engine thread died: everything it published goes out
        first, then each stream still open gets an error output per unfinished sample."""
        self._take_outbox()
        outs = [StepOutput(request_id=rid, new_token_ids=[], finished=True,
                           finish_reason="error", index=i, error=message)
                for rid, stream in list(self._streams.items())
                for i in range(len(stream.output.outputs)) if i not in stream.done_indexes]
        if outs:
            self._dispatch(outs)

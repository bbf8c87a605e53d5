"""The engine thread: the one thread that owns an LLMEngine, and its inbox of commands.

The event loop sends commands (`Add`, `Control`: abort / park / unpark, `Stop`); the
thread applies them between steps, runs the steps as a two-stage pipeline (the previous
step's outputs go out while this one runs; mini-sglang's overlap loop carries it in one
variable the same way) and hands each step's outputs to the loop through an `Outbox`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outbox import Outbox
from engine.outputs import StepOutput
from engine.progress import LoadProgress
from engine.request import Request, RequestStatus
from engine.runner import request_fault
from engine.runtime import HeapTrimmer
from engine.stats import EngineStats

log = logging.getLogger("tidewire.engine")


@dataclass
class Add:
    request: Request


@dataclass
class Control:
    """A command about one request the engine may hold: `abort` ends it (finish reason
    "abort"), `park` takes it out of the batch keeping its state, `unpark` puts it back."""
    op: Literal["abort", "park", "unpark"]
    request_id: str


class Stop:
    """Abort every request, close the engine, end the thread."""


Command = Add | Control | Stop


class EngineThread:
    """Builds the LLMEngine on its own thread and runs it there until `Stop`.

    Thread ownership: `start` and `put` are called from the loop; everything else runs
    on the engine thread, which alone calls the LLMEngine (loading included: with GNU
    OpenMP, a parallel region run by another thread made the engine's own several times
    slower; see docs/performance.md). The thread publishes `stats` (a frozen snapshot,
    one reference swap) and `dead`; any thread may read them. `engine` is set once
    loaded, and then only its read-only-after-load parts (tokenizer, grammar compiler)
    are for other threads."""

    def __init__(self, config: EngineConfig, progress: LoadProgress, handoff: float,
                 build: Callable[[EngineConfig, LoadProgress], LLMEngine] = LLMEngine) -> None:
        """`handoff`: see AsyncEngine. `build` makes the engine (on the thread)."""
        self.config, self.progress, self.handoff = config, progress, handoff
        self._build = build
        self.engine: LLMEngine = None  # type: ignore[assignment]  # built by the thread
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.stats = EngineStats()
        self.adds_taken = 0  # requests taken out of the inbox
        self.dead: BaseException | None = None
        self._handed_off = False  # this turn's outputs went out
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: Outbox | None = None

    # -- called from the loop --------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, outbox: Outbox,
              loaded: asyncio.Future[None],
              on_death: Callable[[str], None]) -> threading.Thread:
        """Start the thread; it resolves `loaded` (on `loop`) once the model is loaded or
        failed to load, and calls `on_death(message)` on the loop if it dies later."""
        self._loop, self._outbox = loop, outbox
        thread = threading.Thread(target=self._run, args=(loaded, on_death),
                                  name="tidewire-engine", daemon=True)
        thread.start()
        return thread

    def put(self, cmd: Command) -> None:
        self._inbox.put(cmd)

    # -- the thread ------------------------------------------------------------------------

    def _run(self, loaded: asyncio.Future[None], on_death: Callable[[str], None]) -> None:
        try:
            self.engine = self._build(self.config, self.progress)
            with self.progress.phase("warm-up"):  # the first request's once-only costs
                self.engine.warm_up()
        except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
            self._tell_loaded(loaded, e)
            return
        log.info("engine ready in %.1f s", self.progress.finish())
        self.stats = self.engine.stats()
        if not self._tell_loaded(loaded, None):
            return
        try:
            pending = self._serve()
        except BaseException as e:  # the engine is broken: fail every request, loudly
            log.exception("engine thread died")
            self.dead = e
            self._fail_all(repr(e), on_death)
            return
        eng = self.engine
        # what was drained before the stop, then every request still running, aborted
        self._publish(pending + eng.abort(eng.request_ids()))
        try:
            eng.close()  # flush cached prefix blocks to the host tier
        except Exception:  # noqa: BLE001 - shutting down regardless
            log.exception("closing the engine failed")

    def _serve(self) -> list[StepOutput]:
        """Take commands, then schedule and launch a step and finish the previous one
        (send its outputs) once this one is under way, until Stop; returns what is still
        to go out. `pending` carries that from one turn to the next."""
        eng = self.engine
        trimmer = HeapTrimmer()  # (off unless the entry point tuned the allocator)
        overlap = self.config.async_output and eng.runner.overlaps
        pending: list[StepOutput] = []
        while True:
            idle = not pending and not eng.has_unfinished()
            if not self._drain(block=idle, outs=pending):  # aborts' outputs join pending
                return pending
            pending = self._step(pending, overlap)
            self.stats = eng.stats(self.adds_taken)
            if trimmer.maybe():
                log.debug("heap trimmed (%d trims, %.3f s in all)", trimmer.trims,
                          trimmer.seconds)

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

    def _drain(self, block: bool, outs: list[StepOutput]) -> bool:
        """Apply queued commands, their outputs appended to `outs`; False once Stop
        arrives."""
        cmds = [self._inbox.get()] if block else []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for cmd in cmds:
            if isinstance(cmd, Stop):
                return False
            outs.extend(self._add(cmd.request) if isinstance(cmd, Add) else self._control(cmd))
        # (no stats here: requests just taken are not waiting until a schedule says so)
        return True

    def _add(self, r: Request) -> list[StepOutput]:
        self.adds_taken += 1
        try:
            return self.engine.add(r)
        except ValueError as e:  # an id still in flight: fail it, keep running
            return [StepOutput(request_id=r.request_id, new_token_ids=[], finished=True,
                               finish_reason="error", index=i, error=str(e))
                    for i in range(r.params.n)]

    def _control(self, cmd: Control) -> list[StepOutput]:
        try:
            if cmd.op == "abort":
                return self.engine.abort([cmd.request_id])
            if cmd.op == "park":
                self.engine.park([cmd.request_id])
            else:
                self.engine.unpark([cmd.request_id])
        except Exception as e:  # noqa: BLE001 - one request's fault: it fails alone
            return self.engine.fail(cmd.request_id, request_fault(cmd.op, e))
        return []

    def _hand_off(self, outs: list[StepOutput]) -> None:
        """Publish, then give the loop the time to send them (see `handoff`). The stats
        go first: whoever sees a step's outputs sees stats at least that new."""
        self._handed_off = True
        if not outs:
            return
        self.stats = self.engine.stats(self.adds_taken)
        self._publish(outs)
        if self.handoff > 0:
            assert self._outbox is not None
            self._outbox.wait_taken(self.handoff)

    def _publish(self, outs: list[StepOutput]) -> None:
        assert self._outbox is not None
        self._outbox.publish(outs)

    def _tell_loaded(self, loaded: asyncio.Future[None], error: BaseException | None) -> bool:
        """Resolve start()'s future from the engine thread; False if the loop is gone."""
        def resolve() -> None:
            if loaded.cancelled():  # start() was cancelled while loading: nobody will
                self._inbox.put(Stop())  # use this engine, so the thread ends
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

    def _fail_all(self, message: str, on_death: Callable[[str], None]) -> None:
        """(The thread, which then exits.) Finish every request the engine holds with an
        error, then have the loop fail every stream still unfinished (`on_death`): `dead`
        is set by then, so nothing newer is added, and the sweep running on the loop
        cannot miss a request added concurrently."""
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
            self._loop.call_soon_threadsafe(on_death, message)

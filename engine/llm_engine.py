"""The synchronous engine core: each step schedules, executes, advances and emits, over
the parts that own the rest (input and output processing, constraints, speculation,
the host tier), and it isolates faults: a request whose own work raises fails alone.

Exactly one thread may call into an LLMEngine (the engine thread of AsyncEngine, or
the caller of the offline LLM API)."""

from __future__ import annotations

import logging
import time
import weakref
from functools import partial
from collections.abc import Callable, Sequence
from typing import Any, cast

from engine import build
from engine.config import EngineConfig
from engine.constraints import CompileQueue, advance_matcher
from engine.input_processor import InputProcessor, ModelLimits, held_tokens
from engine.kv_offload import EvictionLog, KVOffload
from engine.output_processor import OutputProcessor
from engine.progress import LoadProgress
from engine.lifecycle import Outputs, Releases, RequestLifecycle
from engine.request import Request, RequestStatus
from engine.runner import Sampled, request_fault
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.structured import GrammarCompiler, ResponseFormat
from engine.stats import EngineStats, TierCounters

log = logging.getLogger("tidewire.engine")

# model steps that may raise in a row before the engine gives up (a broken model, not one
# bad batch): each failed step fails only the requests in its batch
MAX_STEP_FAULTS = 3


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: LoadProgress | None = None) -> None:
        """Load the model and allocate the KV cache; `progress` follows the phases.
        `config.quantization` "auto" is made definite here (build.resolve_quantization)."""
        self.config = config = build.resolve_quantization(config)
        progress = progress or LoadProgress()
        t0 = time.monotonic()
        m = build.load_model(config, progress)
        self.platform, self.model_dir, self.arch, self.tokenizer = (m.platform, m.model_dir,
                                                                    m.arch, m.tokenizer)
        self.dtype_name, self.dtype = self.platform.dtype_name, self.platform.dtype
        self.max_model_len, self.num_blocks, self.kv, self.runner = (m.max_model_len,
                                                                     m.num_blocks, m.kv, m.runner)
        self.eos_token_ids = build.eos_ids(self.arch, self.tokenizer)
        self.sampling_defaults = build.model_sampling_defaults(config, self.model_dir)
        self._start_parts(m.evicted, progress)
        log.info("loaded %s (%s, %s) in %.1fs: %d KV blocks of %d tokens; decodes through %s",
                 config.model, self.arch.model_type, self.dtype_name, time.monotonic() - t0,
                 self.num_blocks, config.cache.block_size,
                 {"none": "the eager forward"}.get(self.runner.plan.fast_path.value,
                                                   self.runner.plan.fast_path.value))

    def _start_parts(self, evicted: EvictionLog | None, progress: LoadProgress) -> None:
        """Everything around the model: the host tier, the scheduler, the speculator,
        the grammar compiler, the input and output processors."""
        self.kv_fingerprint: bytes | None = None
        self.offload: KVOffload | None = None
        if evicted is not None:  # a tier, and prefix caching
            self.kv_fingerprint = build.offload_fingerprint(
                self.config, self.arch, self.model_dir, self.dtype,
                self.runner.plan.int8_activations)
            self.offload = build.make_offload(self.config, self.kv_fingerprint, self.kv,
                                              self.runner, evicted)
            weakref.finalize(self, self.offload.stop)  # an engine dropped without close()
        self.scheduler = Scheduler(self.config.scheduler, self.kv, self.offload)
        self.speculator = build.make_engine_speculator(self, progress)
        # response_format constraints, compiled on worker threads (engine/structured.py)
        self.grammars = (GrammarCompiler(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
                         if self.tokenizer is not None else None)
        self.compiles = CompileQueue(self.grammars)  # added, waiting for their compile
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler)
        self.inputs = InputProcessor(
            self.tokenizer, ModelLimits(self.arch.vocab_size, self.max_model_len,
                                        self.config.cache.block_size, self.num_blocks,
                                        held_tokens(self.kv.window or self.kv.local_window,
                                                    self.config),
                                        self.kv.pool.num_full, bool(self.kv.local_window)),
            self.eos_token_ids, self.grammars, self.outputs.byte_table)
        holders: list[Releases] = [self.runner]  # (a sample's proposer state goes first)
        if self.speculator is not None:
            holders.insert(0, self.speculator)
        self.lifecycle = RequestLifecycle(self.scheduler, self.outputs, self.compiles,
                                          self.grammars, holders)
        self.num_steps = 0
        self.step_faults = 0  # model steps that raised in a row (see _failed_step)

    def warm_up(self) -> float:
        """Before serving: a few tokens of two requests at once (one greedy, one sampled
        with top-k/top-p) through the path a first request takes (scheduling, prefill,
        decode steps, the compiled decode step where there is one, both samplers), so
        that the first request after /ready does not pay for what runs only once (the
        thread pool's start, first calls into the kernels and their caches; measured
        ~100 ms). Leaves nothing behind: fewer tokens than a block (nothing enters the
        prefix cache or a host tier), and the counters the stats report as they were.
        Returns the seconds it took."""
        bs = self.config.cache.block_size
        if bs < 8 or self.has_unfinished():
            return 0.0
        t0 = time.monotonic()
        saved = (self.num_steps, self.kv.num_queries, self.kv.num_hits)
        compiled = self.runner.compiled_step
        compiled_steps = compiled.steps if compiled is not None else 0
        prompt = [min(100, self.arch.vocab_size - 1)] * (bs // 2 - 3)
        new = 3  # prompt + outputs stay under one block
        for params in (SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True),
                       SamplingParams(max_tokens=new, temperature=0.8, top_p=0.9, top_k=20,
                                      seed=0, ignore_eos=True)):
            self.add(self.make_request(prompt, params))
        while self.has_unfinished():
            self.step()
        self.num_steps, self.kv.num_queries, self.kv.num_hits = saved
        if compiled is not None:
            compiled.steps = compiled_steps
        return time.monotonic() - t0

    def close(self, flush: bool = True) -> None:
        """Write the cached prefix blocks to the host tier (graceful shutdown) and stop
        its I/O worker. The engine is not used afterwards."""
        if self.offload is not None:
            if flush:
                n = self.offload.flush()
                log.info("flushed %d cached blocks to the %s tier", n, self.config.tier.kind)
            self.offload.close()
            self.offload = None
            self.scheduler.tier = None
        if self.grammars is not None:
            self.grammars.close()

    # -- input (any thread) ----------------------------------------------------------------

    def tokenize(self, prompt: str | list[int], any_thread: bool = False) -> list[int]:
        """InputProcessor.tokenize."""
        return self.inputs.tokenize(prompt, any_thread)

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template takes a `tools` argument (and tool turns)."""
        return self.inputs.template_renders_tools

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            any_thread: bool = False) -> list[int]:
        """InputProcessor.apply_chat_template."""
        return self.inputs.apply_chat_template(messages, add_generation_prompt, tools,
                                               any_thread)

    @property
    def max_prompt_bytes(self) -> int | None:
        """InputProcessor.max_prompt_bytes (computed on first use)."""
        return self.inputs.max_prompt_bytes

    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, salt: bytes = b"",
                     output_token_ids: Sequence[int] = ()) -> Request:
        """Tokenize and validate (safe to call from any thread): InputProcessor."""
        return self.inputs.make_request(prompt, params, request_id, salt, output_token_ids)

    def continued_text(self, req: Request) -> str:
        """The text a stream had sent for `req.output_token_ids` (what its detokenizer
        emits for them; safe to call from any thread)."""
        return self.outputs.continued_text(req)

    def byte_table(self, skip_special_tokens: bool) -> list[bytes] | None:
        """OutputProcessor.byte_table."""
        return self.outputs.byte_table(skip_special_tokens)

    def compile_format(self, fmt: ResponseFormat) -> None:
        """Compile a response_format now (cached for the requests that use it); raises
        GrammarError (a ValueError) naming what is wrong with it, or when it takes over
        the compile timeout."""
        if self.grammars is None:
            raise ValueError("response_format needs a model with a tokenizer")
        self.grammars.compile(fmt)

    # -- requests (RequestLifecycle) -------------------------------------------------------

    def add(self, req: Request) -> Outputs:
        """Queue a request: a ParentRequest of its n samples, the first admitted now,
        its siblings once its prompt is computed. Returns the outputs of a request that
        ends at once (one that continues from tokens already ending it: max_tokens, EOS,
        a stop string)."""
        return self.lifecycle.add(req)

    def abort(self, request_ids: list[str],
              status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Outputs:
        """Finish requests (by the caller's ids) now: their blocks return to the pool
        before the next step. Returns one finished output per sample."""
        return self.lifecycle.abort(request_ids, status)

    def fail(self, request_id: str, error: str, also: Sequence[Request] = (),
             samples: int = 0) -> Outputs:
        """RequestLifecycle.fail: one request fails alone, with finish_reason "error"."""
        return self.lifecycle.fail(request_id, error, also, samples)

    def park(self, request_ids: list[str]) -> int:
        """Take requests (by the callers' ids) out of the batch and free their blocks,
        keeping their tokens, sampler state and detokenizer; unpark() resumes them
        exactly where they stopped. Returns how many samples were parked."""
        return len(self.scheduler.park(self.lifecycle.unfinished(request_ids)))

    def unpark(self, request_ids: list[str]) -> int:
        """Requeue parked requests; their prompt and outputs so far are recomputed,
        mostly as prefix-cache hits."""
        return len(self.scheduler.unpark(self.lifecycle.unfinished(request_ids)))

    def request_ids(self) -> list[str]:
        """The callers' ids of every unfinished request."""
        return self.lifecycle.request_ids()

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self.compiles)
                or bool(self.lifecycle.late))

    def stats(self, adds_taken: int = 0) -> EngineStats:
        """A snapshot of the scheduler, the block manager and the host tier, for other
        threads to read (call it on the thread that steps the engine)."""
        s, kv = self.scheduler, self.kv
        offload, tiers = None, cast(tuple[TierCounters, ...], ())
        if self.offload is not None:
            offload, tiers = self.offload.counters()
        return EngineStats(step=self.num_steps, running=len(s.running), waiting=len(s.waiting),
                           parked=len(s.parked), max_num_seqs=s.config.max_num_seqs,
                           kv_usage=kv.usage, prefix_queries=kv.num_queries,
                           prefix_hits=kv.num_hits, preemptions=s.num_preemptions,
                           adds_taken=adds_taken, offload=offload, tiers=tiers)

    # -- the step --------------------------------------------------------------------------

    def step(self, publish: Callable[[Outputs], None] | None = None,
             launched: Callable[[], None] | None = None) -> Outputs:
        """Run one iteration; returns its outputs. `publish`, if given, gets them as
        soon as they exist (sampled, detokenized), before the step's block bookkeeping
        (prefix-cache publishing, freeing finished requests, write-through), which runs
        after it returns. It is not called for a step that ran nothing. `launched`, if
        given, is called once the step's forward is under way (ModelRunner.execute);
        not for a step that ran nothing."""
        outs = self._before_schedule()
        sched = self.scheduler.schedule()
        for req, e in sched.failed:  # its own admission raised: it alone fails
            outs += self.fail(req.parent_id, request_fault("scheduling", e), also=[req])
        launched = self._capture_evictions(launched)
        if sched.empty:
            return self._idle(outs, publish)
        try:
            sampled = self.runner.execute(sched, launched)  # (calls launched: ships)
        except Exception as e:  # noqa: BLE001 - the shared forward: fails this batch only
            outs += self._failed_step(sched, e)
            if publish is not None:
                publish(outs)
            return outs
        self.step_faults = 0
        touched = self._advance(sched, sampled, outs)
        outs += self._emit_step(touched, sampled)
        if publish is not None:
            publish(outs)
        self._after_step(sched, touched)
        return outs

    def _before_schedule(self) -> Outputs:
        """What lands between steps: compiles that finished (their failures' outputs),
        ends that missed the last step's publication, the host tier's step, and the
        speculator's proposals for the running requests."""
        life = self.lifecycle
        outs = life.start_compiled() if self.compiles else []
        if life.late:  # requests that failed after the last step's outputs went out
            outs, life.late = life.late + outs, []
        if self.offload is not None:
            self.offload.new_step()
        if self.speculator is not None and self.scheduler.running:
            compiled = self.runner.compiled_step
            self.speculator.propose_step(self.scheduler.running, self.num_steps,
                                         compiled.max_rows if compiled is not None else None)
        return outs

    def _capture_evictions(self, launched: Callable[[], None] | None
                           ) -> Callable[[], None] | None:
        """The blocks this schedule evicted are captured before the model reuses them;
        their host copies start once the forward is under way (after `launched`)."""
        offload = self.offload
        if offload is None:
            return launched
        offload.capture()
        return partial(self._then_ship, offload, launched) if offload.captured else launched

    def _idle(self, outs: Outputs, publish: Callable[[Outputs], None] | None) -> Outputs:
        """A step that runs nothing: ship the host tier's copies, and wait a little when
        only loads or compiles are pending (nothing to run until one lands)."""
        if self.offload is not None:
            self.offload.ship()
            if self.scheduler.loading:
                self.offload.wait(0.005)
        if self.compiles:
            self.compiles.wait(0.005)
        if outs and publish is not None:
            publish(outs)
        return outs

    def _advance(self, sched: SchedulerOutput, sampled: Sampled, outs: Outputs) -> list[Request]:
        """Append the sampled tokens, record speculation, and fail (into `outs`) the
        samples whose sampling or constraint raised. Returns the samples touched."""
        touched = self.scheduler.advance(sched, sampled.tokens, sampled.verified)
        self.num_steps += 1
        if sampled.verified is not None:
            assert self.speculator is not None
            self.speculator.record_step(sched.scheduled, self.num_steps)
        if sampled.failed:
            outs += self._fail_sampled(sched, sampled.failed)
        for r in touched:
            if r.matcher is not None:
                try:
                    self._advance_matcher(r)
                except Exception as e:  # noqa: BLE001 - this request's constraint only
                    outs += self.fail(r.parent_id,
                                      request_fault("advancing the constraint of", e), also=[r])
        return touched

    def _advance_matcher(self, r: Request) -> None:
        end = advance_matcher(r)
        if end is None:
            return
        if r.status.finished:  # (its stop token ended it: the error is what happened)
            r.status = end
        else:
            self.scheduler.finish_requests([r.request_id], end)

    def _emit_step(self, touched: list[Request], sampled: Sampled) -> Outputs:
        """Each touched sample's output (one whose work failed above has its output
        already)."""
        now = time.monotonic()
        lps = sampled.logprobs or {}
        verified = sampled.verified or {}
        vlps = sampled.verified_logprobs or {}
        outs: Outputs = []
        for r in touched:
            if r.status is RequestStatus.FINISHED_ERROR and r.request_id not in self.outputs:
                continue  # failed above: its output is out
            rid, n = r.request_id, r.num_new_tokens_last  # n > 1: accepted proposals
            if rid in verified:
                lpl = vlps.get(rid)
                lpl = None if lpl is None else lpl[:n]
            else:
                lp = lps.get(rid)
                lpl = None if lp is None else [lp]
            try:
                outs.append(self.lifecycle.emit(r, r.output_token_ids[-n:], lpl, now))
            except Exception as e:  # noqa: BLE001 - detokenizing or stop-checking it
                outs += self.fail(r.parent_id, request_fault("detokenizing", e), also=[r])
        return outs

    def _after_step(self, sched: SchedulerOutput, touched: list[Request]) -> None:
        """The step's block bookkeeping, after its outputs went out: commit, write-through,
        and start the siblings whose first sample's prompt is computed."""
        self.scheduler.commit(sched)
        if self.kv.moves:  # (before anything can hand the blocks moved out to another)
            self.runner.move_blocks(self.kv.take_moves())
        if self.offload is not None and self.kv.new_prompt_blocks:
            self.offload.write_through()
        self.lifecycle.start_siblings(touched)
        if self.config.debug:
            self.kv.check_integrity()

    @staticmethod
    def _then_ship(offload: KVOffload, launched: Callable[[], None] | None) -> None:
        """The caller's `launched` first (it may publish the last step's outputs, which
        sockets wait for), then the host tier's copies (which nothing waits for)."""
        if launched is not None:
            launched()
        offload.ship()

    # -- faults ----------------------------------------------------------------------------

    def _failed_step(self, sched: SchedulerOutput, e: Exception) -> Outputs:
        """The shared forward raised: every request in this batch fails (the others and
        new ones go on). Past MAX_STEP_FAULTS in a row the model itself is broken, and
        the error goes up (the engine thread reports itself dead)."""
        self.step_faults += 1
        log.error("the model step failed (%d in a row): %r", self.step_faults, e, exc_info=e)
        if self.step_faults >= MAX_STEP_FAULTS:
            raise e
        why = (f"internal error in the model step ({type(e).__name__}); the request was in "
               "that batch")
        parents = dict.fromkeys(s.request.parent_id for s in sched.scheduled)
        return [o for rid in parents for o in self.fail(rid, why)]

    def _fail_sampled(self, sched: SchedulerOutput, failed: dict[str, str]) -> Outputs:
        """Samples whose sampling raised (runner: Sampled.failed) fail alone."""
        outs = []
        for s in sched.scheduled:
            r = s.request
            if r.request_id in failed and not r.status.finished:
                outs += self.fail(r.parent_id, failed[r.request_id], also=[r])
        return outs

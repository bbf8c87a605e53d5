"""The synchronous engine core: tokenizer + scheduler + block manager + runner.

Exactly one thread may call into an LLMEngine (the engine thread of AsyncEngine, or
the caller of the offline LLM API)."""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
import weakref
from concurrent import futures
from functools import partial
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from engine.block_manager import KVCacheManager
from engine.config import EngineConfig  # defined there; importing it from here still works
from engine.detokenizer import IncrementalDetokenizer, byte_level_table
from engine.kv_offload import EvictionLog, KVOffload, kv_fingerprint
from engine.loader import (cache_root, load_tokenizer, load_weights, resolve_model,
                           sampling_defaults, weights_checksum)
from engine.model import ModelArch
from engine.outputs import StepOutput
from engine.progress import LoadProgress
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner, request_fault, prefault_default
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec_decode import Speculator, make_speculator
from engine.structured import GrammarCompiler, ResponseFormat
from engine.stats import EngineStats, OffloadCounters, TierCounters
from kernels import cpu_ops

log = logging.getLogger("tidewire.engine")

# model steps that may raise in a row before the engine gives up (a broken model, not one
# bad batch): each failed step fails only the requests in its batch
MAX_STEP_FAULTS = 3

def fast_dtype(attention_backend: str) -> str:
    """What `dtype="auto"` means here: bfloat16 on a GPU, and on a CPU with native bf16
    math (AVX512-BF16 or AMX); elsewhere float32. On an AVX2-only CPU (seen: AMD EPYC)
    torch's bf16 GEMM ran at ~15 GFLOP/s against ~78 for fp32, a 5x slower model."""
    if attention_backend == "cuda":
        return "bfloat16"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def physical_cores() -> int:
    """Cores this process may run on, each counted once however many hardware threads it
    has (two threads of one core share its vector units: the matmuls gain nothing)."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


# EngineConfig.dtype's names (engine.config.DTYPE_NAMES) as torch dtypes
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}


class PromptTooLongError(ValueError):
    """The prompt (plus max_tokens) does not fit the context window."""


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: LoadProgress | None = None) -> None:
        """Load the model and allocate the KV cache; `progress` follows the phases."""
        self.config = config
        progress = progress or LoadProgress()
        t0 = time.monotonic()
        # on the thread that runs every op of this engine (OpenMP's setting is per thread);
        # 0 keeps an OMP_NUM_THREADS the user set, else one thread per physical core
        if config.threads or "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(config.threads or physical_cores())
        with progress.phase("model files (a GGUF is converted once)"):
            self.model_dir: Path = resolve_model(config.model)
            self.arch = ModelArch.from_dir(self.model_dir)
        with progress.phase("tokenizer"):
            self.tokenizer: Any = load_tokenizer(self.model_dir)
        self.dtype_name = (fast_dtype(config.attention_backend) if config.dtype == "auto"
                           else config.dtype)
        self.dtype = DTYPES[self.dtype_name]
        self.max_model_len = min(config.max_model_len or self.arch.max_context,
                                 self.arch.max_context)
        self.eos_token_ids = self._eos_ids()
        self.sampling_defaults = self._sampling_defaults()
        cc = config.cache
        self.num_blocks = cc.num_blocks or self._auto_num_blocks()
        # a host tier hears of every cached block the pool evicts (to copy it out)
        tiered = config.tier.kind != "none" and cc.enable_prefix_caching
        self._evicted = EvictionLog() if tiered else None
        self.kv = KVCacheManager(self.num_blocks, cc.block_size, cc.enable_prefix_caching,
                                 on_evict=self._evicted)
        if config.attention_backend == "cpu":
            with progress.phase("CPU kernels (compiled once per machine)"):
                cpu_ops.available()
        with progress.phase("weights"):
            weights = load_weights(self.model_dir)
        with progress.phase(f"model and KV cache ({self.num_blocks} blocks"
                            f"{', int8 quantization' if config.quantization != 'none' else ''}"
                            f"{', int8 KV cache' if cc.dtype == 'int8' else ''})"):
            self.runner = ModelRunner(
                self.arch, weights, dtype=self.dtype, backend=config.attention_backend,
                block_size=cc.block_size, num_blocks=self.num_blocks, seed=config.seed,
                max_num_seqs=config.scheduler.max_num_seqs, max_model_len=self.max_model_len,
                enforce_eager=config.enforce_eager, quantization=config.quantization,
                quant_cache=self._quant_cache(),
                prefault=cc.prefault if cc.prefault is not None else prefault_default(),
                kv_cache_dtype=cc.dtype)
            del weights
        self.offload = self._make_offload()
        if self.offload is not None:  # an engine dropped without close() still frees it all
            weakref.finalize(self, self.offload.stop)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.offload)
        self.speculator = self._make_speculator(progress)
        # response_format constraints, compiled on worker threads (engine/structured.py)
        self.grammars = (GrammarCompiler(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
                         if self.tokenizer is not None else None)
        self._compiling: list[Request] = []  # added, waiting for their constraint's compile
        self.num_steps = 0
        self.step_faults = 0  # model steps that raised in a row (see _failed_step)
        self._late: list[StepOutput] = []  # ends that missed their step's publication
        self._children: dict[str, list[str]] = {}  # caller's id -> unfinished sample ids
        self._siblings: dict[str, list[Request]] = {}  # first sample id -> samples to start
        self._detoks: dict[str, IncrementalDetokenizer | None] = {}
        self._byte_tables: dict[bool, list[bytes] | None] = {}  # by skip_special_tokens
        log.info("loaded %s (%s) in %.1fs: %d KV blocks of %d tokens", config.model,
                 self.dtype_name, time.monotonic() - t0, self.num_blocks, cc.block_size)

    def _make_speculator(self, progress: LoadProgress) -> Speculator | None:
        sc = self.config.speculative
        draft = None
        if sc.method == "draft":
            from engine.spec_draft import DraftProposer

            if not sc.draft_model:
                raise ValueError("speculative decoding with a draft model needs one: "
                                 "--draft-model (draft_model=)")

            with progress.phase(f"draft model {sc.draft_model}"):
                draft = DraftProposer(self, sc)
        return make_speculator(sc, draft)

    def _quant_cache(self) -> Path | None:
        if self.config.quantization == "none":
            return None
        key = weights_checksum(self.model_dir)[:16]
        return cache_root() / "quantized" / f"{key}-{self.config.quantization}.safetensors"

    def _make_offload(self) -> KVOffload | None:
        from cache_store import make_tier

        tc = self.config.tier
        if self._evicted is None:  # no tier, or no prefix caching
            return None
        tier = make_tier(tc.kind, tc.memory_bytes, tc.redis_url, tc.ttl, tc.io_timeout)
        assert tier is not None
        a = self.arch
        self.kv_fingerprint = kv_fingerprint(
            a.model_type, weights_checksum(self.model_dir),
            # int8 weights compute other K/V than the same model's bf16 ones; an int8 cache
            # holds other bytes (and layout) than a bf16 one
            str(self.dtype).removeprefix("torch.")
            + ("" if self.config.quantization == "none" else f"+w{self.config.quantization}")
            + ("" if self.config.cache.dtype == "auto" else f"+kv{self.config.cache.dtype}"),
            self.config.cache.block_size, a.num_layers, a.num_kv_heads, a.head_dim)
        return KVOffload(tier, tc, self.kv, self.runner, self.kv_fingerprint, self._evicted)

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

    def _auto_num_blocks(self) -> int:
        """As many blocks as the memory budget holds, but no more than every sequence
        slot at full context could use (tiny models would otherwise zero gigabytes)."""
        bs = self.config.cache.block_size
        per_block = self.arch.kv_bytes_per_block(bs, self.dtype, self.config.cache.dtype)
        budget = self.config.kv_cache_memory // per_block
        most = -(-self.max_model_len // bs) * self.config.scheduler.max_num_seqs
        return max(1, min(budget, most))

    def _sampling_defaults(self) -> dict[str, float]:
        """The model's defaults for unset sampling fields; invalid ones are ignored."""
        found = sampling_defaults(self.config.model, self.model_dir)
        try:
            SamplingParams(**found)  # type: ignore[arg-type]  # checked here, at run time
        except (TypeError, ValueError) as e:
            log.warning("ignoring the model's sampling defaults %s: %s", found, e)
            return {}
        return found

    @functools.cached_property
    def max_prompt_bytes(self) -> int | None:
        """The most UTF-8 bytes a prompt that fits the context window can have: the
        window times the longest token's bytes (a longer text needs more tokens than the
        window holds). Exact token bytes come from the byte-level table; otherwise a
        token's own string bounds them. None when the tokenizer normalizes its input (a
        normalizer can shorten text before it is split) or there is none. (Computed on
        first use: the byte table is built once, ~80 ms.)"""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return None
        table = self.byte_table(False)
        longest = (max(map(len, table), default=0) if table is not None else
                   max((len(t.encode("utf-8", "surrogatepass")) for t in tok.get_vocab()),
                       default=0))
        return self.max_model_len * longest if longest else None

    def _eos_ids(self) -> frozenset[int]:
        ids = set(self.arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # -- requests ----------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int], any_thread: bool = False) -> list[int]:
        """A prompt's ids (no special tokens added). `any_thread`: through the Rust
        tokenizer's own encode, which mutates nothing (transformers' wrapper may set
        truncation state on each call), so it may run beside the event loop's calls."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: send prompt_token_ids")
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if any_thread and backend is not None:  # (encode_batch releases the GIL)
                return backend.encode_batch([prompt], add_special_tokens=False)[0].ids
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = list(prompt)
        if not all(isinstance(t, int) and 0 <= t < self.arch.vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {self.arch.vocab_size})")
        return ids

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template takes a `tools` argument (and tool turns)."""
        return "tools" in (getattr(self.tokenizer, "chat_template", None) or "")

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            any_thread: bool = False) -> list[int]:
        """Token ids of a conversation; without the generation prompt it is the prefix
        that the next turn's prompt starts with (what `warm` caches). `tools` (OpenAI's
        shape) go to a template that renders them. `any_thread`: as for tokenize()."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        kw = {"tools": tools} if tools else {}
        if any_thread and getattr(self.tokenizer, "backend_tokenizer", None) is not None:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kw)
            return self.tokenize(text, any_thread=True)
        out = self.tokenizer.apply_chat_template(messages,
                                                 add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, return_dict=False, **kw)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, salt: bytes = b"",
                     output_token_ids: Sequence[int] = ()) -> Request:
        """Tokenize and validate (safe to call from any thread). `output_token_ids`: a
        request that continues a stream begun elsewhere (a resume on another replica):
        the tokens it already produced, recomputed with the prompt before it samples
        the next one; n must be 1."""
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if output_token_ids:
            if params.n != 1:
                raise ValueError("only a request with n = 1 can continue from its tokens")
            if len(output_token_ids) > params.max_tokens:
                raise ValueError(f"{len(output_token_ids)} tokens already produced, more than "
                                 f"max_tokens ({params.max_tokens})")
            vocab = self.arch.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in output_token_ids):
                raise ValueError(f"token ids must be integers in [0, {vocab})")
        self._check_token_ids(params)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context window of {self.max_model_len} tokens")
        bs = self.config.cache.block_size
        if -(-(len(ids) + params.max_tokens) // bs) > self.num_blocks:
            raise PromptTooLongError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs more KV "
                f"blocks than the pool has ({self.num_blocks} x {bs} tokens)")
        req = Request(request_id or uuid.uuid4().hex, ids, params, self.eos_token_ids, salt)
        req.output_token_ids = list(output_token_ids)
        if params.response_format is not None:
            if self.grammars is None:
                raise ValueError("response_format needs a model with a tokenizer")
            req.grammar = self.grammars.submit(params.response_format)  # compiles meanwhile
        return req

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids a request names (logit_bias keys, stop_token_ids) are this model's."""
        vocab = self.arch.vocab_size
        bad = [t for t in (*params.logit_bias, *params.stop_token_ids) if t >= vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} (in logit_bias or stop_token_ids) is not in "
                             f"this model's vocabulary of {vocab}")

    def compile_format(self, fmt: ResponseFormat) -> None:
        """Compile a response_format now (cached for the requests that use it); raises
        GrammarError (a ValueError) naming what is wrong with it, or when it takes over
        the compile timeout."""
        if self.grammars is None:
            raise ValueError("response_format needs a model with a tokenizer")
        self.grammars.compile(fmt)

    def add(self, req: Request) -> list[StepOutput]:
        """Queue a request. With n > 1 it becomes n samples (ids `<id>\x00<i>`): the first
        is admitted now, its siblings once its prompt is computed, so they find every
        full prompt block in the prefix cache and share it (ref counts) instead of
        recomputing it. Returns the outputs of a request that ends at once (one that
        continues from tokens already ending it: max_tokens, EOS, a stop string)."""
        rid = req.request_id
        if rid in self._children:
            raise ValueError(f"duplicate request id {rid!r}")
        try:
            return self._add(req)
        except Exception as e:  # noqa: BLE001 - this request only: undone, and failed
            why = str(e) if isinstance(e, ValueError) else request_fault("adding", e)
            return self.fail(rid, why, also=[req], samples=req.params.n)

    def _add(self, req: Request) -> list[StepOutput]:
        rid = req.request_id
        n = req.params.n
        kids = [req] if n == 1 else [self._child(req, i) for i in range(n)]
        self._children[rid] = [k.request_id for k in kids]
        for k in kids:
            self._detoks[k.request_id] = self._detokenizer(k)
        if req.output_token_ids:
            ended = self._continue(req)
            if ended:
                return ended
        if n > 1:
            self._siblings[kids[0].request_id] = kids[1:]
        if req.grammar is not None and not req.grammar.done():
            self._compiling.append(kids[0])  # the batch keeps going while it compiles
        else:
            return self._schedule(kids[0])
        return []

    def _continue(self, req: Request) -> list[StepOutput]:
        """A request continuing from tokens it produced elsewhere: its detokenizer takes
        them (their text was sent already); it ends now if they end it."""
        detok = self._detoks.get(req.request_id)
        if detok is not None:
            detok.push(list(req.output_token_ids))
            if detok.stop_hit is not None:
                req.stop_reason = detok.stop_hit
                req.status = RequestStatus.FINISHED_STOPPED
                return [self._emit(req, [], None)]
        status = req.check_stop()
        if status is not None:
            req.status = status
            return [self._emit(req, [], None)]
        return []

    def continued_text(self, req: Request) -> str:
        """The text a stream had sent for `req.output_token_ids` (what its detokenizer
        emits for them; safe to call from any thread)."""
        detok = self._detokenizer(req)
        return detok.push(list(req.output_token_ids)) if detok is not None else ""

    def _schedule(self, req: Request) -> list[StepOutput]:
        """Into the scheduler's queue, with a matcher for a constrained request; a
        continued request whose tokens break its constraint ends (its output returned)."""
        if req.grammar is not None:
            req.matcher = self.grammars.matcher(req.grammar.result())  # type: ignore[union-attr]
            for t in req.output_token_ids:  # a continued request: its tokens so far
                if not req.matcher.accept(t):
                    req.status = RequestStatus.FINISHED_ERROR
                    out = self._emit(req, [], None)
                    out.error = "the tokens given do not follow the response_format"
                    return [out]
        self.scheduler.add(req)
        return []

    def _compiled(self) -> list[StepOutput]:
        """Requests whose constraint has compiled join the queue; those whose compile
        failed end with an error (their outputs are returned)."""
        outs: list[StepOutput] = []
        still = []
        for req in self._compiling:
            if not req.grammar.done():
                still.append(req)
            elif not req.grammar.cancelled() and req.grammar.exception() is None:
                try:
                    outs += self._schedule(req)
                except Exception as e:  # noqa: BLE001 - this request's matcher only
                    outs += self.fail(req.parent_id, request_fault("starting", e), also=[req])
            else:
                why = ("its compile was cancelled" if req.grammar.cancelled()
                       else req.grammar.exception())
                log.warning("request %s: %s", req.parent_id, why)
                outs += self.abort([req.parent_id], RequestStatus.FINISHED_ERROR)
        self._compiling = still
        return outs

    @staticmethod
    def _child(req: Request, i: int) -> Request:
        return Request(f"{req.request_id}\x00{i}", req.prompt_token_ids, req.params,
                       req.eos_token_ids, req.salt, req.arrival_time, parent_id=req.request_id,
                       index=i, grammar=req.grammar)

    def byte_table(self, skip_special_tokens: bool) -> list[bytes] | None:
        """Each token id's raw bytes (None: no tokenizer, or not a byte-level one), built
        once (~80 ms for a 49k vocabulary). A token can hold part of a UTF-8 character,
        which its decoded text (U+FFFD) cannot give back."""
        if self.tokenizer is None:
            return None
        if skip_special_tokens not in self._byte_tables:
            self._byte_tables[skip_special_tokens] = byte_level_table(self.tokenizer,
                                                                      skip_special_tokens)
        return self._byte_tables[skip_special_tokens]

    def _detokenizer(self, r: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        skip = r.params.skip_special_tokens
        return IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids, skip, r.params.stop,
                                      self.byte_table(skip))

    def abort(self, request_ids: list[str],
              status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[StepOutput]:
        """Finish requests (by the caller's ids) now: their blocks return to the pool
        before the next step. Returns one finished output per sample."""
        outs = []
        for rid in request_ids:
            kids = self._children.get(rid, [])
            waiting = self._siblings.pop(kids[0], []) if kids else []
            compiling = [r for r in self._compiling if r.parent_id == rid]
            if compiling:
                self._compiling = [r for r in self._compiling if r.parent_id != rid]
                fmt = compiling[0].params.response_format
                if self.grammars is not None and fmt is not None:  # (make_request's waiter)
                    self.grammars.release(fmt)
            for r in self.scheduler.finish_requests(kids, status) + compiling + waiting:
                r.status = status
                try:
                    outs.append(self._emit(r, [], None))
                except Exception as e:  # noqa: BLE001 - its detokenizer's last flush raised
                    self._detoks[r.request_id] = None
                    out = self._emit(r, [], None)
                    out.finish_reason, out.error = "error", request_fault("ending", e)
                    outs.append(out)
        return outs

    def fail(self, request_id: str, error: str, also: Sequence[Request] = (),
             samples: int = 0) -> list[StepOutput]:
        """Fail one request (the caller's id, every sample of it) after a fault in its own
        work: it ends with finish_reason "error" and `error`, its blocks are freed before
        the next step, and nothing else changes. `also`: samples of it that may be held
        nowhere else (the one whose work raised); `samples`: the number of samples it has,
        when it may not have been registered yet. Returns one finished output per sample
        that had not finished."""
        kids = [*self._children.get(request_id, ()), *(r.request_id for r in also)]
        for k in kids:
            if k in self._detoks:  # its text ends here: nothing more to decode (nor to fail)
                self._detoks[k] = None
        outs = self.abort([request_id], RequestStatus.FINISHED_ERROR)
        ended = {o.index for o in outs}
        for r in also:
            if r.index in ended or (r.status.finished and r.request_id not in self._detoks):
                continue  # its end went out already
            self.scheduler.finish_requests([r.request_id], RequestStatus.FINISHED_ERROR)
            r.status = RequestStatus.FINISHED_ERROR
            self._finished(r)
            outs.append(self._ended(r.parent_id or request_id, r.index))
            ended.add(r.index)
        outs += [self._ended(request_id, i) for i in range(samples) if i not in ended]
        self._children.pop(request_id, None)
        for k in kids:
            self._detoks.pop(k, None)
        for o in outs:
            o.error = error
        return outs

    @staticmethod
    def _ended(request_id: str, index: int) -> StepOutput:
        return StepOutput(request_id=request_id, new_token_ids=[], finished=True,
                          finish_reason="error", index=index)

    def _failed_step(self, sched: SchedulerOutput, e: Exception) -> list[StepOutput]:
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

    def _fail_sampled(self, sched: SchedulerOutput, failed: dict[str, str]) -> list[StepOutput]:
        """Samples whose sampling raised (runner: Sampled.failed) fail alone."""
        outs = []
        for s in sched.scheduled:
            r = s.request
            if r.request_id in failed and not r.status.finished:
                outs += self.fail(r.parent_id, failed[r.request_id], also=[r])
        return outs

    def park(self, request_ids: list[str]) -> int:
        """Take requests (by the callers' ids) out of the batch and free their blocks,
        keeping their tokens, sampler state and detokenizer; unpark() resumes them
        exactly where they stopped. Returns how many samples were parked."""
        return len(self.scheduler.park(k for rid in request_ids for k in self._children.get(rid, ())))

    def unpark(self, request_ids: list[str]) -> int:
        """Requeue parked requests; their prompt and outputs so far are recomputed,
        mostly as prefix-cache hits."""
        return len(self.scheduler.unpark(
            k for rid in request_ids for k in self._children.get(rid, ())))

    def stats(self, adds_taken: int = 0) -> EngineStats:
        """A snapshot of the scheduler, the block manager and the host tier, for other
        threads to read (call it on the thread that steps the engine)."""
        s, kv = self.scheduler, self.kv
        offload, tiers = None, cast(tuple[TierCounters, ...], ())
        if self.offload is not None:
            o = self.offload.stats
            offload = OffloadCounters(o.loads, o.load_blocks, o.load_timeouts, o.corrupt,
                                      o.written_blocks, o.dropped_writes, o.load_seconds)
            tier = self.offload.tier
            tiers = tuple(_tier_counters(t) for t in getattr(tier, "tiers", [tier]))
        return EngineStats(step=self.num_steps, running=len(s.running), waiting=len(s.waiting),
                           parked=len(s.parked), max_num_seqs=s.config.max_num_seqs,
                           kv_usage=kv.usage, prefix_queries=kv.num_queries,
                           prefix_hits=kv.num_hits, preemptions=s.num_preemptions,
                           adds_taken=adds_taken, offload=offload, tiers=tiers)

    def request_ids(self) -> list[str]:
        """The callers' ids of every unfinished request."""
        return list(self._children)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling) or bool(self._late)

    # -- the step ----------------------------------------------------------------------

    def step(self, publish: Callable[[list[StepOutput]], None] | None = None,
             launched: Callable[[], None] | None = None) -> list[StepOutput]:
        """Run one iteration; returns its outputs. `publish`, if given, gets them as
        soon as they exist (sampled, detokenized), before the step's block bookkeeping
        (prefix-cache publishing, freeing finished requests, write-through), which runs
        after it returns. It is not called for a step that ran nothing. `launched`, if
        given, is called once the step's forward is under way (ModelRunner.execute);
        not for a step that ran nothing."""
        failed = self._compiled() if self._compiling else []  # outputs of failed compiles
        if self._late:  # requests that failed after the last step's outputs went out
            failed, self._late = self._late + failed, []
        offload = self.offload
        if offload is not None:
            offload.new_step()
        if self.speculator is not None and self.scheduler.running:
            cpu_step = self.runner.cpu_step
            try:
                self.speculator.propose(self.scheduler.running, self.num_steps,
                                        cpu_step.max_rows if cpu_step is not None else None)
            except Exception:  # noqa: BLE001 - proposals are optional: this step goes without
                log.exception("speculative proposals failed; the step runs without them")
                for r in self.scheduler.running:
                    r.spec_token_ids, r.spec_probs = [], None
        sched = self.scheduler.schedule()
        for req, e in sched.failed:  # its own admission raised: it alone fails
            failed += self.fail(req.parent_id, request_fault("scheduling", e), also=[req])
        if offload is not None:
            offload.capture()  # blocks evicted by this schedule, before the model reuses them
            if offload.captured:  # their host copies start once the forward is under way
                launched = partial(self._then_ship, offload, launched)
        if sched.empty:
            if offload is not None:
                offload.ship()
                if self.scheduler.loading:
                    offload.wait(0.005)  # only loads are pending: nothing to run until one lands
            if self._compiling:  # only compiles are pending: wait a little for one
                futures.wait([r.grammar for r in self._compiling], 0.005,
                             futures.FIRST_COMPLETED)
            if failed and publish is not None:
                publish(failed)
            return failed
        try:
            sampled = self.runner.execute(sched, launched)  # (calls launched: ships)
        except Exception as e:  # noqa: BLE001 - the shared forward: fails this batch only
            outs = failed + self._failed_step(sched, e)
            if publish is not None:
                publish(outs)
            return outs
        self.step_faults = 0
        now = time.monotonic()
        touched = self.scheduler.advance(sched, sampled.tokens, sampled.verified)
        self.num_steps += 1
        if sampled.verified is not None:
            self._record_spec(sched)
        if sampled.failed:
            failed += self._fail_sampled(sched, sampled.failed)
        for r in touched:
            if r.matcher is not None:
                try:
                    self._advance_matcher(r)
                except Exception as e:  # noqa: BLE001 - this request's constraint only
                    failed += self.fail(r.parent_id, request_fault("advancing the constraint of", e),
                                        also=[r])
        lps = sampled.logprobs or {}
        verified = sampled.verified or {}
        vlps = sampled.verified_logprobs or {}
        outs = failed
        for r in touched:
            if r.status is RequestStatus.FINISHED_ERROR and r.request_id not in self._detoks:
                continue  # failed above: its output is in `failed`
            rid, n = r.request_id, r.num_new_tokens_last  # n > 1: accepted proposals
            if rid in verified:
                lpl = vlps.get(rid)
                lpl = None if lpl is None else lpl[:n]
            else:
                lp = lps.get(rid)
                lpl = None if lp is None else [lp]
            try:
                outs.append(self._emit(r, r.output_token_ids[-n:], lpl, now))
            except Exception as e:  # noqa: BLE001 - detokenizing or stop-checking it
                outs += self.fail(r.parent_id, request_fault("detokenizing", e), also=[r])
        if publish is not None:
            publish(outs)
        self.scheduler.commit(sched)
        if offload is not None and self.kv.new_prompt_blocks:
            offload.write_through()
        if self._siblings:
            for r in touched:
                siblings = self._siblings.pop(r.request_id, None)
                if siblings:  # the prompt is computed and cached: the other samples may start
                    for i, sib in enumerate(siblings):
                        try:
                            self._schedule(sib)
                        except Exception as e:  # noqa: BLE001 - this request only
                            self._late += self.fail(sib.parent_id, request_fault("starting", e),
                                                    also=siblings[i:])
                            break
        if self.config.debug:
            self.kv.check_integrity()
        return outs

    def _record_spec(self, sched: SchedulerOutput) -> None:
        """Each verifying request's acceptance, for its off-switch."""
        assert self.speculator is not None
        for s in sched.scheduled:
            if s.num_spec:
                r = s.request
                self.speculator.record(r, s.num_spec, r.num_new_tokens_last - 1,
                                       self.num_steps)

    def _advance_matcher(self, r: Request) -> None:
        """Feed a constrained sample's new tokens to its matcher; one that reached the
        constraint's end (accepted a stop token) finishes the sample (tokens after
        that point, proposals accepted past it, are dropped)."""
        m = r.matcher
        new = r.output_token_ids[-r.num_new_tokens_last:]
        for j, t in enumerate(new):
            if not m.accept(t):  # only when the constraint allowed nothing
                log.error("request %s: token %d broke its constraint", r.parent_id, t)
                self._truncate(r, len(new) - j - 1)
                if r.status.finished:  # (its stop token ended it: the error is what happened)
                    r.status = RequestStatus.FINISHED_ERROR
                else:
                    self.scheduler.finish_requests([r.request_id], RequestStatus.FINISHED_ERROR)
                return
            if m.terminated:
                self._truncate(r, len(new) - j - 1)
                if not r.status.finished:  # ignore_eos: the constraint ends it
                    self.scheduler.finish_requests([r.request_id],
                                                   RequestStatus.FINISHED_STOPPED)
                return

    @staticmethod
    def _truncate(r: Request, drop: int) -> None:
        """Drop the last `drop` of this step's tokens (they came after the request's end:
        a stop string, a constraint's end). One that max_tokens ended at the last token
        dropped ended earlier, on its stop: as it would have one token a step."""
        if drop:
            del r.output_token_ids[-drop:]
            r.num_new_tokens_last -= drop
            if r.status is RequestStatus.FINISHED_LENGTH:
                r.status = RequestStatus.FINISHED_STOPPED

    @staticmethod
    def _then_ship(offload: KVOffload, launched: Callable[[], None] | None) -> None:
        """The caller's `launched` first (it may publish the last step's outputs, which
        sockets wait for), then the host tier's copies (which nothing waits for)."""
        if launched is not None:
            launched()
        offload.ship()

    def _emit(self, r: Request, new: list[int], logprobs: list | None,
              sampled_at: float = 0.0) -> StepOutput:
        """Detokenize the new tokens, apply stop strings, clean up a finished sample.
        (Runs for every request every step, in front of the step's outputs going out:
        keep it lean.)"""
        detok = self._detoks.get(r.request_id)
        delta = ""
        finished = r.status.finished
        if detok is not None:
            if len(new) > 1 and detok.stop:  # several tokens (accepted proposals)
                delta, new, logprobs = self._push_each(r, detok, new, logprobs)
            else:
                delta = detok.push(new, finished)
            if detok.stop_hit is not None:
                r.stop_reason = detok.stop_hit
                if not finished:
                    self.scheduler.finish_requests([r.request_id], RequestStatus.FINISHED_STOPPED)
                    finished = True
        reason = None
        if finished:
            self._finished(r)
            reason = r.finish_reason
        first = r.first_scheduled_time
        cached = r.num_cached_tokens
        if cached < 0:
            cached = 0
        host = r.num_host_cached_tokens
        return StepOutput(request_id=r.parent_id, new_token_ids=new, text_delta=delta,
                          finished=finished, finish_reason=reason, index=r.index,
                          num_prompt_tokens=len(r.prompt_token_ids), num_cached_tokens=cached,
                          logprobs=logprobs, stop_reason=r.stop_reason,
                          queue_time=first - r.arrival_time if first else 0.0,
                          sampled_at=sampled_at,
                          num_host_cached_tokens=host if host < cached else cached,
                          spec=(r.spec_steps, r.spec_proposed, r.spec_accepted)
                          if r.spec_steps else None)

    def _push_each(self, r: Request, detok: IncrementalDetokenizer, new: list[int],
                   logprobs: list | None) -> tuple[str, list[int], list | None]:
        """Several new tokens and stop strings: pushed one at a time, so a stop string
        ends the output at the token that completed it, as it would one token a step
        (the tokens after it are dropped)."""
        pieces = []
        finished = r.status.finished
        for j, t in enumerate(new):
            pieces.append(detok.push([t], finished and j == len(new) - 1))
            if detok.stop_hit is not None:
                self._truncate(r, len(new) - j - 1)
                new = new[: j + 1]
                logprobs = None if logprobs is None else logprobs[: j + 1]
                break
        return "".join(pieces), new, logprobs

    def _finished(self, r: Request) -> None:
        if self.speculator is not None:
            self.speculator.release(r.request_id)
        self.runner.release(r.request_id)
        self._detoks.pop(r.request_id, None)
        kids = self._children.get(r.parent_id)
        if kids is not None and r.request_id in kids:
            kids.remove(r.request_id)
            if not kids:
                del self._children[r.parent_id]


def _tier_counters(t: Any) -> TierCounters:  # a cache_store.base.KVTier
    c = t.stats.as_dict()
    return TierCounters(t.name, c["lookups"], c["hits"], c["misses"], c["puts"], c["errors"],
                        c["bytes_read"], c["bytes_written"], t.state() != "ok", t.breaker_trips())

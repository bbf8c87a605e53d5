"""Model runner: flattens a scheduled step into one ragged batch, runs the model once,
samples the rows that reached the end of their known tokens."""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.compiled_step import CompiledDecodeStep
from engine.cuda_graphs import DecodeGraphs
from engine.models.build import build_model
from engine.models.arch import ModelArch
from engine.outputs import TokenLogprob
from engine.platform import FastPath, Platform
from engine.request import Request
from engine.sampler import Sampler, SamplingBatch
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.spec_decode import SpecRows, verify
from engine.step_inputs import StepInputs, append_tokens, split_step, step_layout
from engine.structured import apply_masks

log = logging.getLogger("tidewire.engine")


def request_fault(phase: str, e: BaseException) -> str:
    """What a client is told of a fault in its own request (the traceback is logged)."""
    log.error("a request failed while %s it: %r", phase, e, exc_info=e)
    return f"internal error while {phase} this request ({type(e).__name__}); see the server log"


@dataclass(slots=True)
class Sampled:
    """A step's sampled tokens by request id, and the logprobs of the rows that asked
    (None when none did). Token ids come as a plain dict: the scheduler reads them as
    they are, with no per-step copy in front of the outputs' publication."""

    tokens: dict[str, int]
    logprobs: dict[str, TokenLogprob] | None = None
    # requests that verified proposals: the tokens each keeps, and their logprobs
    verified: dict[str, list[int]] | None = None
    verified_logprobs: dict[str, list[TokenLogprob]] | None = None
    # requests whose own sampling raised (a fault in one request's parameters or
    # constraint): they got no token, and the engine fails them alone
    failed: dict[str, str] | None = None


@dataclass(slots=True)
class BlockCopy:
    """Blocks on their way to the host (ModelRunner.read_blocks)."""

    data: torch.Tensor  # [n, layers, 2, block_size, kv_heads, head_dim], CPU
    done: torch.cuda.Event | None = None  # recorded after the device-to-host copy

    def wait(self) -> torch.Tensor:
        """The blocks, once the copy has landed (any thread)."""
        if self.done is not None:
            self.done.synchronize()
        return self.data


def prefault_default() -> bool:
    """CacheConfig.prefault=None: on, unless TIDEWIRE_KV_PREFAULT=0."""
    return os.environ.get("TIDEWIRE_KV_PREFAULT", "1").lower() not in ("0", "false", "no", "off")


def kv_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            prefault: bool = False) -> torch.Tensor:
    """A zeroed tensor for the KV cache. On the CPU it is an anonymous mapping. With
    `prefault` the kernel maps and zeroes all its pages at once (MAP_POPULATE: ~0.3 s a
    GB here); without, each page is zero-filled on first touch, inside whichever engine
    step first writes to it (~4 us a page under a hypervisor), and the process holds
    only the blocks it has used so far."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if prefault:
        flags |= getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere pages fault in lazily
    buf = mmap.mmap(-1, nbytes, flags=flags)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps `buf` alive


class ModelRunner:
    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], *,
                 platform: Platform, block_size: int, num_blocks: int, seed: int | None = None,
                 max_num_seqs: int = 64, max_model_len: int = 8192, quantization: str = "none",
                 quant_cache: Path | None = None, prefault: bool = False,
                 kv_cache_dtype: str = "auto", num_full_blocks: int | None = None) -> None:
        """Keyword-only past `weights`: most are ints, easily swapped by position.
        `platform` plans the model (Platform.plan): its dtype, backend, ops and fast
        decode path (CUDA graphs, engine/cuda_graphs.py; the compiled decode step,
        engine/compiled_step.py; or none). `quantization`: "none" or "int8"
        (engine/quant.py), cached in `quant_cache`. `prefault`: see kv_pool.
        `kv_cache_dtype`: "auto" (the activations' dtype) or "int8" (the cpu backend's
        q8 cache, engine/attention/cpu.py). `num_full_blocks` < num_blocks (a model with
        local and global layers, block_manager.HybridPool): the windowed layers' caches
        hold only the first num_full_blocks blocks."""
        self.plan = plan = platform.plan(arch, quantization, kv_cache_dtype)
        log.debug("%s on %s", plan, platform)
        attn = platform.attention(arch, plan, block_size)
        self.block_size = block_size
        self.attn = attn
        self.device = torch.device(plan.device)
        self.model = build_model(arch, weights, plan, attn, quant_cache)
        # One tensor holds every layer's K and V cache, so that moving whole blocks to
        # or from the host tier is one gather or scatter, not two per layer. With local
        # and global layers, two: the global layers' over every block id, the windowed
        # layers' over the full blocks only.
        self.kv_local: torch.Tensor | None = None
        self._layer_groups: tuple[torch.Tensor, torch.Tensor] | None = None
        nf = num_blocks if num_full_blocks is None else num_full_blocks
        if nf < num_blocks:
            local = [i for i in range(arch.num_layers) if arch.window(i)]
            glob = [i for i in range(arch.num_layers) if not arch.window(i)]
            if not local or not glob:
                raise ValueError("num_full_blocks < num_blocks needs windowed and global layers")
            self.kv = kv_pool((len(glob), 2, *attn.cache_shape(num_blocks)), attn.cache_dtype,
                              self.device, prefault)
            self.kv_local = kv_pool((len(local), 2, *attn.cache_shape(nf)), attn.cache_dtype,
                                    self.device, prefault)
            caches = dict(zip(glob, self.kv.unbind(0))) | dict(zip(local, self.kv_local.unbind(0)))
            self.kv_caches = [(caches[i][0], caches[i][1]) for i in range(arch.num_layers)]
            self._layer_groups = (torch.tensor(glob, device=self.device),
                                  torch.tensor(local, device=self.device))
        else:
            self.kv = kv_pool((arch.num_layers, 2, *attn.cache_shape(num_blocks)),
                              attn.cache_dtype, self.device, prefault)
            self.kv_caches = [(layer[0], layer[1]) for layer in self.kv.unbind(0)]
        self.sampler = Sampler(seed)
        self._generators: dict[str, torch.Generator] = {}
        self.graphs: DecodeGraphs | None = None
        self.compiled_step: CompiledDecodeStep | None = None
        if plan.fast_path is FastPath.COMPILED_STEP:
            if CompiledDecodeStep.reads(self.model):
                self.compiled_step = CompiledDecodeStep(self.model, self.kv_caches)
            else:
                log.info("decode steps run eagerly: a matmul's weight is in a type the "
                         "compiled step does not read")
        if plan.fast_path is FastPath.CUDA_GRAPHS:
            self.graphs = DecodeGraphs(self._forward, self.device, max_num_seqs,
                                       -(-max_model_len // block_size),
                                       capture=self.device.type == "cuda")
            self.graphs.capture_all()

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: object,
                 logits_rows: torch.Tensor) -> torch.Tensor:
        return self.model.forward(input_ids, positions, self.kv_caches, meta, logits_rows)

    @property
    def overlaps(self) -> bool:
        """Whether a decode step can be under way on the device while this thread does
        something else: a CUDA graph replay is one enqueue, after which the thread only
        waits for the GPU. (Under the Triton interpreter the same path runs, eagerly.)"""
        return self.graphs is not None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput,
                launched: Callable[[], None] | None = None) -> Sampled:
        """Run one step; the tokens of the rows that sample, by request id (and the
        logprobs of those that asked).

        `launched`, if given, is called once while the step is under way, at the point
        where the thread has nothing left to do but wait for it: right after a decode
        graph's replay (and greedy argmax) is enqueued on the GPU; for any other step
        (eager launches, CPU compute: the thread is busy for all of it) before it
        starts."""
        decodes, prefills = split_step(out)
        if self.graphs is not None and not prefills and self.graphs.fits(
                len(decodes), decodes[0].request.num_computed_tokens + 1 if decodes else 0):
            return self._execute_graph(decodes, launched)
        if launched is not None:
            launched()
        inputs = self.prepare(decodes, prefills)
        logits = self._logits(inputs)
        try:
            return self._sample_step(logits, inputs)
        except Exception:  # noqa: BLE001 - one request's sampling must not fail the batch
            log.exception("sampling the batch failed; sampling each request alone")
        # The batched sampler works on the logits in place, so the forward runs again
        # (its cache writes are the same values at the same slots) and each request
        # samples alone: the one whose sampling raises fails, the others go on.
        return self._sample_alone(self._logits(inputs), inputs)

    def _logits(self, inputs: StepInputs) -> torch.Tensor:
        """The forward: the logits of the rows that sample, then the verifying rows."""
        step = self.compiled_step
        if step is not None and step.fits(len(inputs.positions)):
            # decodes, and up to 8 query tokens in all (a decode verifying proposals)
            logits = step.run(inputs.input_ids, inputs.positions,
                              inputs.meta)  # type: ignore[arg-type]  # the cpu backend's
            if len(inputs.logits_rows) < len(inputs.positions):
                logits = logits[inputs.logits_rows]
            return logits
        return self._forward(inputs.input_ids, inputs.positions, inputs.meta,
                             inputs.logits_rows)

    def _sample_step(self, logits: torch.Tensor, inputs: StepInputs) -> Sampled:
        if not inputs.spec:
            return self._sample(logits, inputs.sample_ids, inputs.sampling)
        n = len(inputs.sample_ids)
        sampled = self._sample(logits[:n], inputs.sample_ids, inputs.sampling)
        v = verify(self.sampler, logits[n:], inputs.spec)
        sampled.verified, sampled.verified_logprobs = v.tokens, v.logprobs or None
        return sampled

    def _sample_alone(self, logits: torch.Tensor, inputs: StepInputs) -> Sampled:
        """Each sampling row on its own, then the verifying requests one by one; a
        request whose sampling raises is reported in `failed` (and gets no token)."""
        n = len(inputs.sample_ids)
        out = self._sample_rows(logits[:n], inputs.sample_ids, inputs.sampling)
        out.verified, out.verified_logprobs = {}, {}
        for g in inputs.spec:
            rows = logits[n + g.start : n + g.start + len(g.proposals) + 1]
            rid = g.request.request_id
            try:
                v = verify(self.sampler, rows, [dataclasses.replace(g, start=0)])
            except Exception as e:  # noqa: BLE001 - this request's fault only
                out.failed[rid] = request_fault("verifying proposals for", e)  # type: ignore[index]
                continue
            out.verified[rid] = v.tokens[rid]  # type: ignore[index]
            if v.logprobs and rid in v.logprobs:
                out.verified_logprobs[rid] = v.logprobs[rid]  # type: ignore[index]
        out.verified = out.verified or None
        out.verified_logprobs = out.verified_logprobs or None
        return out

    def _sample_rows(self, logits: torch.Tensor, sample_ids: list[str],
                     sampling: SamplingBatch) -> Sampled:
        """Each row sampled on its own; a request whose sampling raises is in `failed`."""
        out = Sampled({}, {}, failed={})
        for i, rid in enumerate(sample_ids):
            try:
                s = self._sample(logits[i : i + 1], [rid], sampling.row(i))
            except Exception as e:  # noqa: BLE001 - this request's fault only
                out.failed[rid] = request_fault("sampling", e)  # type: ignore[index]
                continue
            out.tokens.update(s.tokens)
            out.logprobs.update(s.logprobs or {})  # type: ignore[union-attr]
        out.logprobs = out.logprobs or None
        return out

    def _sample(self, logits: torch.Tensor, sample_ids: list[str], sampling: SamplingBatch,
                launched: Callable[[], None] | None = None) -> Sampled:
        """`launched` is called once the sampling's device work is enqueued, before
        waiting for it."""
        greedy = None
        if sample_ids and logits.device.type != "cpu" and sampling.argmax_only:
            greedy = logits.argmax(-1)  # move n token ids, not n x vocab logits
        if launched is not None:
            launched()
        if not sample_ids:
            return Sampled({})
        if greedy is not None:
            return Sampled(dict(zip(sample_ids, greedy.cpu().tolist())))  # waits, no GIL
        if sampling.argmax_only:  # the model's dtype as it is: no fp32 copy of every row
            return Sampled(dict(zip(sample_ids, logits.max(-1).indices.tolist())))
        if sampling.masked_argmax_only and logits.device.type == "cpu":  # greedy, constrained
            logits = logits.contiguous()
            apply_masks(logits, sampling.matchers)
            return Sampled(dict(zip(sample_ids, logits.max(-1).indices.tolist())))
        # the sampler (and its seeded generators) run on the CPU, in fp32
        res = self.sampler(logits.to("cpu", torch.float32), sampling)
        lps = {rid: lp for rid, lp in zip(sample_ids, res.logprobs) if lp is not None}
        return Sampled(dict(zip(sample_ids, res.tokens)), lps or None)

    def _execute_graph(self, decodes: list[ScheduledRequest],
                       launched: Callable[[], None] | None) -> Sampled:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in decodes:
            append_tokens(s, self.block_size, ids, pos, slots)
        bs = self.block_size
        tables = [s.block_ids[: p // bs + 1] for s, p in zip(decodes, pos)]
        rows = [i for i, s in enumerate(decodes) if s.samples]
        samplers = [decodes[i] for i in rows]
        sample_ids = [s.request.request_id for s in samplers]
        sampling = self._sampling_batch(samplers)

        def replay() -> torch.Tensor:
            logits = self.graphs.run(ids, pos, slots, tables)  # type: ignore[union-attr]
            return logits[rows] if len(rows) < len(decodes) else logits

        try:
            return self._sample(replay(), sample_ids, sampling, launched)
        except Exception:  # noqa: BLE001 - one request's sampling must not fail the batch
            log.exception("sampling the batch failed; sampling each request alone")
        # as in execute(): the graph runs again (same cache writes), each request alone
        return self._sample_rows(replay(), sample_ids, sampling)

    def block_shape(self) -> tuple[int, ...]:
        """One block of every layer's K and V: [layers, 2, block_size, kv_heads, head_dim]
        (an int8 cache: its own, AttentionBackend.block_shape)."""
        return self.attn.block_shape(len(self.kv_caches))

    @torch.inference_mode()
    def snapshot_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A private copy of whole blocks, taken now on the cache's device (one gather),
        in the canonical layout (maybe as a permuted view): what the blocks hold before
        anything later overwrites them. The cheap half of read_blocks, the one that must
        come before the next forward; to_host does the rest, off the critical path."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if self._layer_groups is None:
            return self.attn.gather_blocks(self.kv, idx)
        assert self.kv_local is not None  # (full blocks only: the local layers' too)
        glob, local = self._layer_groups
        g = self.attn.gather_blocks(self.kv, idx)
        out = g.new_empty((len(block_ids), len(self.kv_caches), *g.shape[2:]))
        out[:, glob] = g
        out[:, local] = self.attn.gather_blocks(self.kv_local, idx)
        return out

    @torch.inference_mode()
    def to_host(self, blocks: torch.Tensor) -> BlockCopy:
        """snapshot_blocks' copy on its way to the CPU, [n, *block_shape()], for the host
        tier's I/O thread. On a GPU the copy is
        queued on the stream, into pinned memory, and this thread does not wait for it:
        BlockCopy.wait() (on the I/O thread) does."""
        blocks = blocks.contiguous()
        if self.device.type != "cuda":
            return BlockCopy(blocks)
        host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
        host.copy_(blocks, non_blocking=True)
        done = torch.cuda.Event(blocking=True)  # its waiter sleeps instead of spinning a core
        done.record()
        return BlockCopy(host, done)

    def read_blocks(self, block_ids: list[int]) -> BlockCopy:
        """Copies of whole blocks on their way to the CPU (snapshot_blocks + to_host)."""
        return self.to_host(self.snapshot_blocks(block_ids))

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Store whole blocks given as read_blocks returns them."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(self.device, non_blocking=True)
        if self._layer_groups is None:
            self.attn.scatter_blocks(self.kv, idx, data)
            return
        assert self.kv_local is not None
        glob, local = self._layer_groups
        self.attn.scatter_blocks(self.kv, idx, data[:, glob])
        self.attn.scatter_blocks(self.kv_local, idx, data[:, local])

    @torch.inference_mode()
    def move_blocks(self, moves: list[tuple[int, int]]) -> None:
        """Copy the global layers' K/V of each (source, destination) block pair: blocks
        the block manager moved behind the local window (KVCacheManager.take_moves)."""
        if not moves:
            return
        src = torch.tensor([s for s, _ in moves], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in moves], dtype=torch.long, device=self.device)
        self.attn.scatter_blocks(self.kv, dst, self.attn.gather_blocks(self.kv, src))

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def prepare(self, decodes: list[ScheduledRequest],
                prefills: list[ScheduledRequest]) -> StepInputs:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        samplers: list[ScheduledRequest] = []
        spec_rows: list[int] = []
        spec: list[SpecRows] = []
        for s in decodes + prefills:
            append_tokens(s, self.block_size, ids, pos, slots)
            if s.num_spec:  # every position from the newest known token on is scored
                r = s.request
                spec.append(SpecRows(r, r.spec_token_ids[: s.num_spec], len(spec_rows),
                                     self._generator(s), None if r.spec_probs is None
                                     else r.spec_probs[: s.num_spec]))
                spec_rows.extend(range(len(ids) - s.num_spec - 1, len(ids)))
            elif s.samples:
                rows.append(len(ids) - 1)
                samplers.append(s)
        rows += spec_rows
        dev = self.device
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=torch.tensor(pos, dtype=torch.int64).to(dev, non_blocking=True),
            meta=self._metadata(decodes, prefills, slots),
            logits_rows=torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True),
            sample_ids=[s.request.request_id for s in samplers],
            sampling=self._sampling_batch(samplers),
            spec=spec,
        )

    def _metadata(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest],
                  slots: list[int]) -> object:
        return self.attn.build_metadata(step_layout(decodes, prefills, slots, self.block_size))

    def _sampling_batch(self, samplers: list[ScheduledRequest]) -> SamplingBatch:
        reqs = [s.request for s in samplers]
        matchers = [r.matcher for r in reqs]
        return SamplingBatch(
            params=[r.params for r in reqs],
            generators=[self._generator(s) for s in samplers],
            prompt_ids=[r.prompt_token_ids for r in reqs],
            output_ids=[r.output_token_ids for r in reqs],
            eos_ids=[r.eos_token_ids for r in reqs],
            matchers=matchers if any(m is not None for m in matchers) else [],
        )

    def _generator(self, s: ScheduledRequest) -> torch.Generator | None:
        return self.generator(s.request)

    def generator(self, req: Request) -> torch.Generator | None:
        """A seeded request's own generator (None: unseeded or greedy)."""
        seed = req.params.seed
        if seed is None or req.params.greedy:
            return None
        rid = req.request_id
        g = self._generators.get(rid)
        if g is None:  # sample i of an n > 1 request uses seed + i
            g = self._generators[rid] = torch.Generator().manual_seed(seed + req.index)
            done = len(req.output_token_ids)
            if done:  # a request continued from its tokens: one draw was spent on each
                torch.rand(done, generator=g)
        return g

    @torch.inference_mode()
    def last_logits(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """Run a step and return only the logits of each scheduled sequence's last row,
        in the order given (a draft model's proposal steps: no sampling here)."""
        decodes, prefills = split_step(SchedulerOutput(scheduled))
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: dict[int, int] = {}
        for s in decodes + prefills:
            append_tokens(s, self.block_size, ids, pos, slots)
            rows[id(s)] = len(ids) - 1
        order = torch.tensor([rows[id(s)] for s in scheduled], dtype=torch.int64)
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev)
        positions = torch.tensor(pos, dtype=torch.int64).to(dev)
        meta = self._metadata(decodes, prefills, slots)
        if self.compiled_step is not None and self.compiled_step.fits(len(ids)):
            logits = self.compiled_step.run(input_ids, positions, meta)  # type: ignore[arg-type]
            return logits[order]
        # the model computes the rows asked for, in the order asked
        return self._forward(input_ids, positions, meta, order.to(dev))

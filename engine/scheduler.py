"""Iteration-level scheduler with a token budget and chunked prefill (torch-free).

Each step every scheduled request gets some new tokens so that its
`num_computed_tokens` catches up with its `num_tokens`: a decode is one token, an
unfinished prefill a chunk of whatever budget is left. Running requests go first; when
one cannot get a block, the newest running request is preempted (blocks freed, requeued
at the front of the waiting queue, recomputed later). Waiting requests are admitted in
arrival order, reusing their longest cached prefix.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from engine.block_manager import KVCacheManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens to run this step, starting at num_computed_tokens
    block_ids: list[int]  # the request's whole block table after allocation
    # of num_new_tokens, proposals (request.spec_token_ids[:num_spec]) run after the
    # newest known token, to be verified: every one of those rows samples
    num_spec: int = 0

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so it needs logits."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - self.num_spec == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0
    # requests whose own admission raised (their prefix lookup, their tier load): taken
    # out of the scheduler, their blocks freed; the engine fails them alone
    failed: list[tuple[Request, Exception]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class TierLoader(Protocol):
    """Fetches prefix blocks from the host tier into the device prefix cache."""

    def start(self, req: Request, num_device_blocks: int) -> bool:
        """Begin loading the request's full blocks after its first `num_device_blocks`
        (found on the device); False when there is nothing worth fetching."""

    def poll(self) -> list[Request]:
        """Requests whose load has ended (loaded, failed or timed out); what arrived is
        now in the device prefix cache."""

    def cancel(self, req: Request) -> None:
        """Forget a load (its request was aborted)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 tier: TierLoader | None = None) -> None:
        self.config = config
        self.kv = kv
        self.tier = tier
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # LOADING: not schedulable until poll() says
        self.parked: dict[str, Request] = {}  # PARKED: out of the batch until unpark()
        self._finishing: list[Request] = []  # finished by advance(), freed by commit()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._watermark = int(config.watermark * kv.pool.num_full)  # (the blocks allocations take)

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.loading:
            self._end_loads()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.spec_token_ids and n == 1 and req.decoding:
                spec = min(len(req.spec_token_ids), budget - 1)
                # Proposals run only where they fit, never at the cost of a preemption:
                # a block stays free for each running request after this one (what a
                # decode crossing into a new block needs).
                reserve = len(self.running) - i - 1
                if spec > 0 and self.kv.allocate_slots(req, 1 + spec, reserve_blocks=reserve):
                    out.scheduled.append(ScheduledRequest(
                        req, 1 + spec, self.kv.block_ids(req.request_id), spec))
                    budget -= 1 + spec
                    i += 1
                    continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, self.kv.block_ids(req.request_id)))
                budget -= n
                i += 1
        return budget

    def _end_loads(self) -> None:
        """Loaded requests go back to the head of the queue, oldest first."""
        assert self.tier is not None
        back = [r for r in self.tier.poll() if self.loading.pop(r.request_id, None) is not None]
        for req in sorted(back, key=lambda r: r.arrival_time, reverse=True):
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req.request_id)  # victims are popped from the tail, past index i,
        self.waiting.appendleft(req)  # so none was scheduled earlier in this step

    def _release(self, req: Request) -> None:
        """Free a request's blocks; it recomputes (mostly from the prefix cache) later."""
        self.kv.free(req)
        req.tier_checked = False  # its blocks may reach the tier before it is readmitted
        req.num_computed_tokens = 0

    def park(self, request_ids: Iterable[str]) -> list[Request]:
        """Take requests out of the batch, keeping their tokens: their blocks are freed
        now (the full ones stay in the prefix cache, or reach the host tier when
        evicted) and unpark() later requeues them, to recompute like a preempted
        request. Used while a client reconnects to resume its streams."""
        parked = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished or req.status is RequestStatus.PARKED:
                continue
            self._unqueue(req)
            self._release(req)
            req.status = RequestStatus.PARKED
            self.parked[rid] = req
            parked.append(req)
        return parked

    def unpark(self, request_ids: Iterable[str]) -> list[Request]:
        """Requeue parked requests at the head of the queue, oldest first."""
        back = [r for r in (self.parked.pop(rid, None) for rid in request_ids) if r is not None]
        for req in sorted(back, key=lambda r: r.arrival_time, reverse=True):
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
        return back

    def _unqueue(self, req: Request) -> None:
        """Remove an unfinished request from whichever queue holds it."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.LOADING:
            del self.loading[req.request_id]
            assert self.tier is not None
            self.tier.cancel(req)
        elif req.status is RequestStatus.PARKED:
            del self.parked[req.request_id]
        else:
            self.waiting.remove(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            try:
                n = self._admit_waiting(req, out, budget)
            except Exception as e:  # noqa: BLE001 - this request's admission: it alone ends
                self._drop(req)
                out.failed.append((req, e))
                continue
            if n is None:  # no room for it
                break
            budget -= n

    def _admit_waiting(self, req: Request, out: SchedulerOutput, budget: int) -> int | None:
        """Admit the first waiting request: the tokens it runs this step (0: its prefix
        is loading from the host tier), or None when the pool has no room for it."""
        hits, num_cached = self.kv.get_computed_blocks(req)
        if self.tier is not None and not req.tier_checked:
            req.tier_checked = True
            if self.tier.start(req, self.kv.first_to_load(req, len(hits))):
                # (the rest of the batch keeps going)
                self.waiting.popleft()
                req.status = RequestStatus.LOADING
                self.loading[req.request_id] = req
                return 0
        n = min(req.num_tokens - num_cached, budget)
        # The watermark keeps room for running requests to grow; with none running
        # it would only stop a request that fits from ever starting.
        reserve = self._watermark if self.running else 0
        if not self.kv.allocate_slots(req, n, hits, reserve):
            # Local and global layers (HybridPool): hits behind the window may hold more
            # full blocks than the request ever needs at once (left there when no
            # global-only block was free), and nothing running would free them. Without
            # them it is a new request, which the input checks let fit.
            if not (hits and self.kv.local_window):
                return None
            hits, num_cached = [], 0
            n = min(req.num_tokens, budget)
            if not self.kv.allocate_slots(req, n, hits, reserve):
                return None
        self.waiting.popleft()
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
            req.first_scheduled_time = time.monotonic()
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled.append(ScheduledRequest(req, n, self.kv.block_ids(req.request_id)))
        return n

    def _drop(self, req: Request) -> None:
        """Take a request whose admission failed out of every queue, its blocks freed."""
        if req in self.waiting:
            self.waiting.remove(req)
        if self.loading.pop(req.request_id, None) is not None and self.tier is not None:
            self.tier.cancel(req)
        if req in self.running:
            self.running.remove(req)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED_ERROR

    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               verified: dict[str, list[int]] | None = None) -> list[Request]:
        """advance() then commit(): the whole post-step update at once."""
        touched = self.advance(out, sampled, verified)
        self.commit(out)
        return touched

    def advance(self, out: SchedulerOutput, sampled: dict[str, int],
                verified: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance computed tokens, append sampled tokens, set the finished status.
        commit() must follow before the next schedule(): the engine publishes the step's
        outputs in between, so the block bookkeeping is not in front of them.

        `sampled` maps request id -> token for the requests that sampled this step;
        `verified` maps the id of a request that ran proposals to the tokens it keeps
        (the accepted proposals, then the target's own next token).
        Returns the requests that produced a token or finished this step."""
        touched: list[Request] = []
        finishing = self._finishing
        running = RequestStatus.RUNNING
        for s in out.scheduled:
            req = s.request
            if req.status is not running:
                continue  # aborted while the step ran
            if s.num_spec:
                tokens = (verified or {}).get(req.request_id)
                if tokens is None:  # its verification failed: the engine fails it
                    continue
                self._advance_verified(s, tokens)
                touched.append(req)
                if req.status.finished:
                    finishing.append(req)
                continue
            req.num_computed_tokens += s.num_new_tokens
            token = sampled.get(req.request_id)
            if token is None:
                continue
            if req.thinking is not None:  # its budget may force the token
                token = req.thinking.take(req.output_token_ids, token)
            req.append_output(token)
            req.num_new_tokens_last = 1
            touched.append(req)
            status = req.check_stop()
            if status is not None:
                req.status = status
                finishing.append(req)
        return touched

    def _advance_verified(self, s: ScheduledRequest, tokens: list[int]) -> None:
        """A step that verified proposals: the fed token and the accepted proposals are
        computed; the rejected ones' KV slots are rolled back (the blocks that held only
        them go back to the pool, and no block is published past the computed tokens).
        A token the thinking budget forces ends the kept ones, as a rejection would."""
        req = s.request
        req.spec_steps += 1
        req.spec_proposed += s.num_spec
        req.spec_accepted += len(tokens) - 1
        computed = req.num_computed_tokens + len(tokens)
        think = req.thinking
        n = 0
        for t in tokens:
            if think is not None:
                t = think.take(req.output_token_ids, t)
            req.append_output(t)
            n += 1
            status = req.check_stop()
            if status is not None:  # the rest is dropped
                req.status = status
                break
            if think is not None and think.forced:  # the model reads it next step
                break
        req.num_new_tokens_last = n
        req.num_computed_tokens = min(computed, req.num_tokens - (not req.status.finished))
        if not req.status.finished:
            self.kv.trim(req)

    def commit(self, out: SchedulerOutput) -> None:
        """Publish the blocks the step filled to the prefix cache, then free the
        requests that finished (their full blocks stay cached)."""
        for s in out.scheduled:
            self.kv.cache_full_blocks(s.request)  # (a no-op for one aborted meanwhile)
        for req in self._finishing:
            if req.request_id in self.requests:  # not aborted between advance and commit
                self._finish(req, req.status)
        self._finishing.clear()

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort (or fail) requests wherever they are; their blocks are freed now."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            self._unqueue(req)
            self._finish(req, status, remove_running=False)
            done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus, remove_running: bool = True) -> None:
        req.status = status
        if remove_running:
            self.running.remove(req)
        self.kv.free(req)
        del self.requests[req.request_id]

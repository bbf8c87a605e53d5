"""The engine's requests from add to release: each caller's request as a
ParentRequest of its samples, queued (after its constraint compiles, siblings after the
first sample's prompt), and ended by the caller (abort) or by a fault in its own work
(fail). Engine thread only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.constraints import CompileQueue, attach_matcher
from engine.output_processor import OutputProcessor, ended
from engine.outputs import StepOutput, TokenLogprob
from engine.request import ParentRequest, Request, RequestStatus
from engine.runner import request_fault
from engine.scheduler import Scheduler
from engine.structured import GrammarCompiler

Outputs = list[StepOutput]


class Releases(Protocol):
    """What holds per-sample state beside the blocks (ModelRunner, Speculator)."""

    def release(self, request_id: str) -> None: ...


class RequestLifecycle:
    def __init__(self, scheduler: Scheduler, outputs: OutputProcessor, compiles: CompileQueue,
                 grammars: GrammarCompiler | None, holders: Sequence[Releases]) -> None:
        """`holders`: released with each finished sample (the runner, the speculator)."""
        self.scheduler = scheduler
        self.outputs = outputs
        self.compiles = compiles
        self.grammars = grammars
        self.holders = holders
        self.parents: dict[str, ParentRequest] = {}  # by the caller's id, until all finish
        self.late: Outputs = []  # ends that missed their step's publication

    def add(self, req: Request) -> Outputs:
        """Queue a request: a ParentRequest of its n samples, the first admitted now,
        its siblings once its prompt is computed. Returns the outputs of a request that
        ends at once (one that continues from tokens already ending it: max_tokens, EOS,
        a stop string)."""
        rid = req.request_id
        if rid in self.parents:
            raise ValueError(f"duplicate request id {rid!r}")
        try:
            return self._add(req)
        except Exception as e:  # noqa: BLE001 - this request only: undone, and failed
            why = str(e) if isinstance(e, ValueError) else request_fault("adding", e)
            return self.fail(rid, why, also=[req], samples=req.params.n)

    def _add(self, req: Request) -> Outputs:
        parent = self.parents[req.request_id] = ParentRequest(req)
        for s in parent.samples:
            self.outputs.add(s)
        if req.output_token_ids:
            ended_now = self._continue(req)
            if ended_now:
                return ended_now
        parent.waiting = parent.samples[1:]
        if req.grammar is not None and not req.grammar.done():
            self.compiles.add(parent.first)  # the batch keeps going while it compiles
            return []
        return self.queue(parent.first)

    def _continue(self, req: Request) -> Outputs:
        """A request continuing from tokens it produced elsewhere ends now if they end
        it (a stop string in their text, a stop token, max_tokens)."""
        if not self.outputs.continue_from(req):
            status = req.check_stop()
            if status is None:
                return []
            req.status = status
        return [self.emit(req, [], None)]

    def queue(self, r: Request) -> Outputs:
        """Into the scheduler's queue, with a matcher for a constrained sample; a
        continued request whose tokens break its constraint ends (its output returned)."""
        if r.grammar is not None:
            assert self.grammars is not None
            if not attach_matcher(r, self.grammars):
                r.status = RequestStatus.FINISHED_ERROR
                out = self.emit(r, [], None)
                out.error = "the tokens given do not follow the response_format"
                return [out]
        self.scheduler.add(r)
        return []

    def abort(self, request_ids: list[str],
              status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Outputs:
        """Finish requests (by the caller's ids) now: their blocks return to the pool
        before the next step. Returns one finished output per sample."""
        outs: Outputs = []
        for rid in request_ids:
            outs += self._end(rid, status, self.compiles.remove(rid))
        return outs

    def _end(self, rid: str, status: RequestStatus, compiling: list[Request]) -> Outputs:
        """Finish every sample of request `rid` (and `compiling`, its samples taken out
        of the compile queue) with `status`; one output per sample."""
        parent = self.parents.get(rid)
        unfinished = list(parent.unfinished) if parent is not None else []
        waiting = parent.take_waiting() if parent is not None else []
        outs = []
        for r in self.scheduler.finish_requests(unfinished, status) + compiling + waiting:
            r.status = status
            try:
                outs.append(self.emit(r, [], None))
            except Exception as e:  # noqa: BLE001 - its detokenizer's last flush raised
                self.outputs.mute(r.request_id)
                out = self.emit(r, [], None)
                out.finish_reason, out.error = "error", request_fault("ending", e)
                outs.append(out)
        return outs

    def fail(self, request_id: str, error: str, also: Sequence[Request] = (),
             samples: int = 0) -> Outputs:
        """Fail one request (the caller's id, every sample of it) after a fault in its own
        work: it ends with finish_reason "error" and `error`, its blocks are freed before
        the next step, and nothing else changes. `also`: samples of it that may be held
        nowhere else (the one whose work raised); `samples`: the number of samples it has,
        when it may not have been registered yet. Returns one finished output per sample
        that had not finished."""
        parent = self.parents.get(request_id)
        sample_ids = [*(parent.unfinished if parent is not None else ()),
                      *(r.request_id for r in also)]
        for k in sample_ids:  # its text ends here: nothing more to decode (nor to fail)
            self.outputs.mute(k)
        outs = self.abort([request_id], RequestStatus.FINISHED_ERROR)
        done = {o.index for o in outs}
        for r in also:
            if r.index in done or (r.status.finished and r.request_id not in self.outputs):
                continue  # its end went out already
            self.scheduler.finish_requests([r.request_id], RequestStatus.FINISHED_ERROR)
            r.status = RequestStatus.FINISHED_ERROR
            self._release(r)
            outs.append(ended(r.parent_id or request_id, r.index))
            done.add(r.index)
        outs += [ended(request_id, i) for i in range(samples) if i not in done]
        self.parents.pop(request_id, None)
        for k in sample_ids:
            self.outputs.release(k)
        for o in outs:
            o.error = error
        return outs

    def unfinished(self, request_ids: list[str]) -> list[str]:
        """The unfinished samples' ids of these requests (unknown ids: none)."""
        return [k for rid in request_ids if (p := self.parents.get(rid)) is not None
                for k in p.unfinished]

    def request_ids(self) -> list[str]:
        """The callers' ids of every unfinished request."""
        return list(self.parents)

    def start_siblings(self, touched: list[Request]) -> None:
        """Start the siblings of a first sample whose prompt is computed (they share its
        cached prompt blocks); one that fails to start fails its request, after the step's
        publication (`late`)."""
        for r in touched:
            parent = self.parents.get(r.parent_id) if r.params.n > 1 else None
            if parent is not None and parent.waiting and parent.first is r:
                self._start(parent.take_waiting())

    def _start(self, siblings: list[Request]) -> None:
        for i, sib in enumerate(siblings):
            try:
                self.queue(sib)
            except Exception as e:  # noqa: BLE001 - this request only
                self.late += self.fail(sib.parent_id, request_fault("starting", e),
                                        also=siblings[i:])
                break

    def start_compiled(self) -> Outputs:
        """Samples whose constraint has compiled join the queue; those whose compile
        failed end with an error (their outputs are returned)."""
        outs: Outputs = []
        for r, ok in self.compiles.take_done():
            if ok:
                try:
                    outs += self.queue(r)
                except Exception as e:  # noqa: BLE001 - this request's matcher only
                    outs += self.fail(r.parent_id, request_fault("starting", e), also=[r])
            else:
                outs += self._end(r.parent_id, RequestStatus.FINISHED_ERROR, [r])
        return outs

    def emit(self, r: Request, new: list[int], logprobs: list | None,
             sampled_at: float = 0.0) -> StepOutput:
        """The sample's output (OutputProcessor.emit); a finished one is released."""
        think = r.thinking
        if think is not None and think.forced and logprobs and new:
            logprobs = [*logprobs[:-1], forced_logprob(new[-1], r.params.logprobs or 0)]
        out = self.outputs.emit(r, new, logprobs, sampled_at)
        if out.finished:
            self._release(r)
        return out

    def _release(self, r: Request) -> None:
        """Free what a finished sample held beside its blocks: its proposer's and its
        sampler's state, its detokenizer, its place in its parent."""
        for h in self.holders:
            h.release(r.request_id)
        self.outputs.release(r.request_id)
        parent = self.parents.get(r.parent_id)
        if parent is not None and parent.finished(r.request_id):
            del self.parents[r.parent_id]


def forced_logprob(token: int, top: int) -> TokenLogprob:
    """The logprobs of a token the thinking budget forced (the step's newest): those of
    the forcing, as if a constraint allowed only it (SamplingParams)."""
    return TokenLogprob(token, 0.0, [(token, 0.0)] if top else [])

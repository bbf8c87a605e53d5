"""One request's stream of outputs on the event loop: RequestStream, which AsyncEngine
pushes each step's output into and a consumer (an HTTP handler, a socket's writer) takes
deltas from, consecutive steps of one sample merged."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from engine.outputs import CompletionOutput, RequestOutput, StepOutput
from engine.request import Request


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

"""A request's bookkeeping state inside the engine (torch-free)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # its prefix blocks are being fetched from the host tier
    RUNNING = "running"
    PREEMPTED = "preempted"
    PARKED = "parked"  # out of the batch, blocks freed, kept to be resumed (client reconnect)
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    def __init__(self, value: str) -> None:
        # a plain attribute: read several times per request per step
        self.finished = value.startswith("finished")


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False, slots=True)
class Request:
    """One sequence. There are no prefill and decode phases: each step the scheduler
    gives it new tokens until `num_computed_tokens` catches up with `num_tokens`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    salt: bytes = b""  # tenant salt, seeds the prefix-cache hash chain
    arrival_time: float = field(default_factory=time.monotonic)
    # n > 1: each sample is its own Request; parent_id is the caller's request id.
    parent_id: str = ""
    index: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at admission
    num_host_cached_tokens: int = 0  # of those, tokens loaded from the host tier
    tier_checked: bool = False  # the host tier was asked about this admission's prefix
    num_preemptions: int = 0
    stop_reason: str | int | None = None  # the stop token id or stop string that ended it
    first_scheduled_time: float | None = None  # when the scheduler first admitted it
    # Chained hashes of this request's full blocks (block i covers tokens
    # [i*bs, (i+1)*bs)); extended by the block manager as tokens become known.
    block_hashes: list[bytes] = field(default_factory=list)
    # response_format: the constraint's compile (a Future; None: unconstrained), and
    # this sample's matcher once it is compiled (engine/structured.py)
    grammar: Any = None
    matcher: Any = None
    # speculative decoding (engine/spec_decode.py): the tokens proposed for the coming
    # step, and the draft's probabilities for them ([k, vocab]; None: point masses, as
    # n-gram proposals are); the scheduler may run fewer of them
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: Any = None
    spec_steps: int = 0  # steps that verified proposals of this request
    spec_proposed: int = 0  # tokens proposed in those steps
    spec_accepted: int = 0  # of those, accepted
    spec_window: tuple[int, int, int] = (0, 0, 0)  # (steps, proposed, accepted) since probing
    spec_resume_step: int = 0  # the off-switch: no proposals before this engine step
    spec_trips: int = 0  # times the off-switch tripped
    num_new_tokens_last: int = 1  # tokens the last step appended (several when speculating)
    # SamplingParams.thinking_budget: this sample's thinking and the close it forces
    # (None without a budget: the scheduler's per-token cost is this one check)
    thinking: ThinkingBudget | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building all_token_ids."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return prompt[start:] + self.output_token_ids[: end - n]

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def drop_last(self, drop: int) -> None:
        """Drop the last `drop` of this step's tokens (they came after the request's end:
        a stop string, a constraint's end). One that max_tokens ended at the last token
        dropped ended earlier, on its stop: as it would have one token a step."""
        if drop:
            del self.output_token_ids[-drop:]
            self.num_new_tokens_last -= drop
            if self.status is RequestStatus.FINISHED_LENGTH:
                self.status = RequestStatus.FINISHED_STOPPED

    @property
    def decoding(self) -> bool:
        """All known tokens but the newest are computed: the next step feeds one token
        (plus any proposals)."""
        return self.num_computed_tokens == self.num_tokens - 1

    def __post_init__(self) -> None:
        self.parent_id = self.parent_id or self.request_id
        if self.params.thinking_budget is not None:
            self.thinking = ThinkingBudget(self.params, self.prompt_token_ids)

    def check_stop(self) -> RequestStatus | None:
        """The finished status after the newest token, or None to keep going.
        (EOS and stop tokens cannot be sampled before min_tokens: the sampler masks them.)"""
        last = self.output_token_ids[-1]
        if last in self.params.stop_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if not self.params.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None


_BEFORE, _OPEN, _DONE = 0, 1, 2  # ThinkingBudget.state


class ThinkingBudget:
    """One sample's thinking against SamplingParams.thinking_budget. It counts the tokens
    generated while the thinking is open; once they reach the budget, the next tokens
    appended are the close (`think_end_ids`; only its rest where the output already ends
    with a beginning of it) in place of the sampled ones, one a step, so the model reads
    each as its next input and then answers. The thinking is open from the start where
    the prompt left it open, or opens where the output begins with `think_start_ids`;
    once closed it stays closed. A function of the prompt and the output alone: a
    request recomputed from its tokens keeps it, and one continued from tokens made
    elsewhere rebuilds it from them before its next token."""

    __slots__ = ("budget", "start", "end", "state", "spent", "closing", "seen", "forced")

    def __init__(self, params: SamplingParams, prompt: list[int]) -> None:
        self.budget: int = params.thinking_budget or 0
        self.start, self.end = params.think_start_ids, params.think_end_ids
        opened = params.thinking_open or bool(
            self.start and _ends_with(prompt, len(prompt), self.start))
        self.state = _OPEN if opened else _BEFORE if self.start else _DONE
        self.spent = 0  # tokens generated while open (the forced ones not counted)
        self.closing = 0 if opened and self.budget == 0 else -1  # next forced: end[closing]
        self.seen = 0  # output tokens taken so far
        self.forced = False  # the newest token was forced

    def take(self, output: list[int], sampled: int) -> int:
        """The token to append to `output` in place of `sampled` (itself, or the next
        id of the close), with the state moved past it."""
        if self.seen < len(output):  # tokens it never took: a stream continued here
            self._replay(output)
        self.seen += 1
        self.forced = self.closing >= 0
        if self.forced:
            return self._force()
        self._step(output, len(output), sampled)
        return sampled

    def _force(self) -> int:
        token = self.end[self.closing]
        self.closing += 1
        if self.closing == len(self.end):
            self.closing, self.state = -1, _DONE
        return token

    def _step(self, output: list[int], n: int, t: int) -> None:
        """`t` generated after output[:n]."""
        if self.state == _BEFORE:  # output[:n] is the start of `start` so far
            if t != self.start[n]:
                self.state = _DONE
            elif n + 1 == len(self.start):
                self.state = _OPEN
                if self.budget == 0:
                    self.closing = 0
        elif self.state == _OPEN:
            self.spent += 1
            if _ends_with(output, n, self.end, t):
                self.state = _DONE
            elif self.spent >= self.budget:
                self.closing = _partial(output, n, self.end, t)

    def _replay(self, output: list[int]) -> None:
        """Take output[seen:] as if appended one by one (the forced places as forced)."""
        for i in range(self.seen, len(output)):
            if self.closing >= 0:
                self._force()
            else:
                self._step(output, i, output[i])
        self.seen = len(output)


def _ends_with(seq: list[int], n: int, ids: tuple[int, ...], t: int | None = None) -> bool:
    """seq[:n] (then `t`, when given) ends with `ids`."""
    if t is not None:
        if t != ids[-1]:
            return False
        ids = ids[:-1]
    m = len(ids)
    return m <= n and all(seq[n - m + j] == ids[j] for j in range(m))


def _partial(seq: list[int], n: int, ids: tuple[int, ...], t: int) -> int:
    """The longest proper beginning of `ids` that seq[:n] + [t] ends with (its length)."""
    for k in range(min(len(ids) - 1, n + 1), 0, -1):
        if _ends_with(seq, n, ids[:k], t):
            return k
    return 0


class ParentRequest:
    """A caller's request and its samples. With n > 1 each sample is its own Request (id
    `<id>\x00<i>`): the first is admitted at once, the others (`waiting`) once its prompt
    is computed, so they find every full prompt block in the prefix cache and share it
    instead of recomputing it. With n == 1 the only sample is the request itself."""

    __slots__ = ("request_id", "samples", "unfinished", "waiting")

    def __init__(self, req: Request) -> None:
        self.request_id = req.request_id
        n = req.params.n
        self.samples = [req] if n == 1 else [_sample(req, i) for i in range(n)]
        self.unfinished = [s.request_id for s in self.samples]  # sample ids, in index order
        self.waiting: list[Request] = []  # set once the first sample is queued

    @property
    def first(self) -> Request:
        return self.samples[0]

    def take_waiting(self) -> list[Request]:
        """The samples still waiting to start (none after the first call)."""
        waiting, self.waiting = self.waiting, []
        return waiting

    def finished(self, sample_id: str) -> bool:
        """Count a sample finished; True when it was the last unfinished one."""
        if sample_id not in self.unfinished:
            return False
        self.unfinished.remove(sample_id)
        return not self.unfinished


def _sample(req: Request, i: int) -> Request:
    return Request(f"{req.request_id}\x00{i}", req.prompt_token_ids, req.params,
                   req.eos_token_ids, req.salt, req.arrival_time, parent_id=req.request_id,
                   index=i, grammar=req.grammar)

"""The output side of the engine: each sample's detokenizer, its stop strings, the
tokenizer's byte tables, and the StepOutput a step publishes for it (torch-free).

Lives on the engine thread, except `continued_text` and `byte_table`, which any thread
may call (they build what they use)."""

from __future__ import annotations

from typing import Any

from engine.detokenizer import IncrementalDetokenizer, byte_level_table
from engine.outputs import StepOutput
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler


class OutputProcessor:
    def __init__(self, tokenizer: Any, scheduler: Scheduler) -> None:
        """`scheduler`: where a running sample that a stop string ends is finished."""
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        # by sample id; None: no text (no tokenizer, or its text ended with a fault)
        self._detoks: dict[str, IncrementalDetokenizer | None] = {}
        self._byte_tables: dict[bool, list[bytes] | None] = {}  # by skip_special_tokens

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

    def detokenizer(self, r: Request) -> IncrementalDetokenizer | None:
        """A new detokenizer for a sample (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        skip = r.params.skip_special_tokens
        return IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids, skip, r.params.stop,
                                      self.byte_table(skip))

    def continued_text(self, req: Request) -> str:
        """The text a stream had sent for `req.output_token_ids` (what its detokenizer
        emits for them; safe to call from any thread)."""
        detok = self.detokenizer(req)
        return detok.push(list(req.output_token_ids)) if detok is not None else ""

    # -- each sample's detokenizer, on the engine thread -----------------------------------

    def add(self, r: Request) -> None:
        self._detoks[r.request_id] = self.detokenizer(r)

    def __contains__(self, sample_id: str) -> bool:
        """Whether the sample's end has not gone out yet (its detokenizer is held)."""
        return sample_id in self._detoks

    def __len__(self) -> int:
        return len(self._detoks)

    def mute(self, sample_id: str) -> None:
        """The sample's text ends here (a fault): nothing more to decode, nor to flush."""
        if sample_id in self._detoks:
            self._detoks[sample_id] = None

    def release(self, sample_id: str) -> None:
        self._detoks.pop(sample_id, None)

    def continue_from(self, req: Request) -> bool:
        """A request continuing from tokens it produced elsewhere: its detokenizer takes
        them (their text was sent already). True when a stop string in them ends it."""
        detok = self._detoks.get(req.request_id)
        if detok is None:
            return False
        detok.push(list(req.output_token_ids))
        if detok.stop_hit is None:
            return False
        req.stop_reason = detok.stop_hit
        req.status = RequestStatus.FINISHED_STOPPED
        return True

    # -- step outputs ----------------------------------------------------------------------

    def emit(self, r: Request, new: list[int], logprobs: list | None,
             sampled_at: float = 0.0) -> StepOutput:
        """Detokenize the new tokens and apply stop strings; a finished sample's
        detokenizer is released. (Runs for every request every step, in front of the
        step's outputs going out: keep it lean.)"""
        detok = self._detoks.get(r.request_id)
        delta = ""
        finished = r.status.finished
        if detok is not None:
            if len(new) > 1 and detok.stop:  # several tokens (accepted proposals)
                delta, new, logprobs = _push_each(r, detok, new, logprobs)
            else:
                delta = detok.push(new, finished)
            if detok.stop_hit is not None:
                r.stop_reason = detok.stop_hit
                if not finished:
                    self.scheduler.finish_requests([r.request_id], RequestStatus.FINISHED_STOPPED)
                    finished = True
        if finished:
            self._detoks.pop(r.request_id, None)
        return step_output(r, new, delta, finished, logprobs, sampled_at)


def step_output(r: Request, new: list[int], delta: str, finished: bool,
                logprobs: list | None, sampled_at: float) -> StepOutput:
    """What this step produced for sample `r` (by the caller's id)."""
    first = r.first_scheduled_time
    cached = r.num_cached_tokens
    if cached < 0:
        cached = 0
    host = r.num_host_cached_tokens
    return StepOutput(request_id=r.parent_id, new_token_ids=new, text_delta=delta,
                      finished=finished, finish_reason=r.finish_reason if finished else None,
                      index=r.index, num_prompt_tokens=len(r.prompt_token_ids),
                      num_cached_tokens=cached, logprobs=logprobs, stop_reason=r.stop_reason,
                      queue_time=first - r.arrival_time if first else 0.0,
                      sampled_at=sampled_at,
                      num_host_cached_tokens=host if host < cached else cached,
                      spec=(r.spec_steps, r.spec_proposed, r.spec_accepted)
                      if r.spec_steps else None)


def ended(request_id: str, index: int) -> StepOutput:
    """A sample that failed before it was held anywhere (nothing of it to report)."""
    return StepOutput(request_id=request_id, new_token_ids=[], finished=True,
                      finish_reason="error", index=index)


def _push_each(r: Request, detok: IncrementalDetokenizer, new: list[int],
               logprobs: list | None) -> tuple[str, list[int], list | None]:
    """Several new tokens and stop strings: pushed one at a time, so a stop string ends
    the output at the token that completed it, as it would one token a step (the tokens
    after it are dropped)."""
    pieces = []
    finished = r.status.finished
    for j, t in enumerate(new):
        pieces.append(detok.push([t], finished and j == len(new) - 1))
        if detok.stop_hit is not None:
            r.drop_last(len(new) - j - 1)
            new = new[: j + 1]
            logprobs = None if logprobs is None else logprobs[: j + 1]
            break
    return "".join(pieces), new, logprobs

"""Output types the engine publishes (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A generated token's logprob and the top alternatives (after the processing
    documented on SamplingParams, before temperature and truncation)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


def join_chunks(chunks: list[str]) -> str:
    """The text a list of pieces holds, collapsing the list to that one string, so a
    later read pays only for what came after it."""
    if len(chunks) > 1:
        chunks[:] = ["".join(chunks)]
    return chunks[0] if chunks else ""


@dataclass(slots=True, kw_only=True)
class StepOutput:
    """What one engine step produced for one sample (`index`) of one request. Built by
    name only: fourteen fields, several of them ints that a position would swap."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str = ""
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    index: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    error: str | None = None
    queue_time: float = 0.0  # seconds from arrival to first admission
    sampled_at: float = 0.0  # time.monotonic() when this step's tokens were sampled
    num_host_cached_tokens: int = 0  # of num_cached_tokens, loaded from the host tier
    # speculative decoding so far: (verifying steps, tokens proposed, tokens accepted);
    # None when the sample never verified a proposal
    spec: tuple[int, int, int] | None = None


@dataclass(slots=True, eq=False)
class CompletionOutput:
    """One sample of a request, cumulative.

    Its text is kept as the list of deltas (`text_chunks`) and joined when read:
    appending to one string copies all of it, once per token, on the event loop's
    per-delta path (quadratic in the output's length). `text_len` is its length in
    characters. Two outputs are equal when their fields and texts are, however the
    text is chunked."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    text_chunks: list[str] = field(default_factory=list, repr=False)
    text_len: int = 0

    @property
    def text(self) -> str:
        return join_chunks(self.text_chunks)

    def add_text(self, delta: str) -> None:
        if delta:
            self.text_chunks.append(delta)
            self.text_len += len(delta)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return (self.index, self.token_ids, self.text, self.finish_reason, self.stop_reason,
                self.logprobs) == (other.index, other.token_ids, other.text,
                                   other.finish_reason, other.stop_reason, other.logprobs)


@dataclass(slots=True)
class RequestOutput:
    """A request as seen by a caller: every sample's cumulative tokens and text, plus
    the latest delta (for sample `index`) when streaming. With n == 1 the top-level
    token_ids / text / finish_reason are those of the only sample."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    index: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    error: str | None = None
    num_host_cached_tokens: int = 0  # of num_cached_tokens, loaded from the host tier
    # speculative decoding by sample index: (verifying steps, tokens proposed, tokens
    # accepted), for the samples that verified proposals
    spec_by_sample: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def spec(self) -> tuple[int, int, int] | None:
        """Speculative decoding summed over the samples; None when none speculated."""
        if not self.spec_by_sample:
            return None
        steps, proposed, accepted = zip(*self.spec_by_sample.values())
        return sum(steps), sum(proposed), sum(accepted)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    def apply(self, step: StepOutput) -> None:
        """Fold one step's delta into the cumulative state."""
        out = self.outputs[step.index]
        out.token_ids.extend(step.new_token_ids)
        out.add_text(step.text_delta)
        if step.logprobs is not None:  # extended in place, as token_ids (not copied per step)
            if out.logprobs is None:
                out.logprobs = []
            out.logprobs.extend(step.logprobs)
        if step.finished:
            out.finish_reason, out.stop_reason = step.finish_reason, step.stop_reason
        self.index, self.new_token_ids, self.delta_text = (step.index, step.new_token_ids,
                                                           step.text_delta)
        self.num_cached_tokens = max(self.num_cached_tokens, step.num_cached_tokens)
        self.num_host_cached_tokens = max(self.num_host_cached_tokens,
                                          step.num_host_cached_tokens)
        if step.error:
            self.error = step.error
        if step.spec is not None:
            self.spec_by_sample[step.index] = step.spec
        outs = self.outputs
        self.finished = out.finished if len(outs) == 1 else all(o.finished for o in outs)

"""Sampling parameters, validated once at the edge; the engine trusts them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from engine.structured import ResponseFormat

_GREEDY_EPS = 1e-5
# Bounds on what one request may ask for, so that no value can make the engine allocate
# without limit or overflow a tensor (the model's own limits, the context window and
# the vocabulary, are checked where the model is known: LLMEngine.make_request).
MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string
MAX_TOKENS = 1 << 20  # max_tokens (the context window refuses most values below it)
MAX_TOP_K = 1 << 20  # a top_k past the vocabulary means all of it
MAX_TOKEN_ID = (1 << 31) - 1  # logit_bias keys, stop_token_ids
MAX_LOGIT_BIAS = 1024  # entries
MAX_STOP_TOKEN_IDS = 1024
MAX_THINK_IDS = 64  # think_start_ids, think_end_ids
# n x max_tokens x (1 + logprobs): the tokens and alternatives one request may produce
MAX_REQUEST_WORK = 1 << 21


def _number(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value > lo if lo_open else value >= lo) and value <= hi:
        return
    left = "(" if lo_open else "["
    raise ValueError(f"{name} must be a number in {left}{lo}, {hi}], got {value!r}")


def _integer(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= lo and (
            hi is None or value <= hi):
        return
    bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def _token_ids(name: str, ids: Any, most: int) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"{name} must be a list of integers")
    if len(ids) > most:
        raise ValueError(f"{name} takes at most {most} ids, got {len(ids)}")
    for t in ids:
        _integer(name, t, 0, MAX_TOKEN_ID)
    return tuple(ids)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples its output tokens.

    Processing order for each sampled position (vectorized over the batch):
      1. logit_bias is added; 2. EOS and stop_token_ids are masked until min_tokens;
      3. repetition_penalty (HF: over prompt and output tokens) and presence /
         frequency penalties (OpenAI: over output tokens);
      -> `logprobs` are log_softmax of the logits at this point;
      4. temperature (0 = greedy: argmax here), top_k, top_p, min_p; 5. sample.
    `seed` makes a sampled request reproducible whatever batch it runs in. `stop`
    strings end the output before the stop string, which never appears in the text.
    `response_format` constrains the output (engine/structured.py): the tokens it does
    not allow next are masked before step 1, so logprobs are those of the constrained
    distribution; min_tokens does not hold a constrained output open past the
    constraint's end.
    `thinking_budget` bounds a thinking model's thinking (engine/request.py
    ThinkingBudget): once a sample has generated that many tokens while thinking, the
    engine appends `think_end_ids` (the close, as the chat template writes it) in place
    of what it samples, one a step, and the model goes on to answer. The thinking is
    open from the start when `thinking_open` or the prompt ends with `think_start_ids`,
    else it opens when the output begins with them. A forced token counts toward
    max_tokens and stop conditions like any other; its logprobs are those of the
    forcing (logprob 0, itself its only alternative), as if a constraint allowed only
    it. Not with response_format (the close would break the constraint).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per token (0: the chosen one only)
    n: int = 1
    skip_special_tokens: bool = True
    # a JSON schema, JSON object, regex, choice or grammar (ResponseFormat.parse's shapes)
    response_format: ResponseFormat | None = None
    # False: this request never runs speculative proposals (an engine started with
    # speculative decoding otherwise proposes for every decoding request)
    speculative: bool = True
    # a thinking model's budget (None: none), and how its thinking opens and closes
    thinking_budget: int | None = None
    think_end_ids: tuple[int, ...] = ()
    think_start_ids: tuple[int, ...] = ()
    thinking_open: bool = False

    def __post_init__(self) -> None:
        _integer("max_tokens", self.max_tokens, 1, MAX_TOKENS)
        _integer("min_tokens", self.min_tokens, 0, self.max_tokens)
        _number("temperature", self.temperature, 0.0, 100.0)
        _integer("top_k", self.top_k, 0, MAX_TOP_K)
        _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _integer("seed", self.seed, -(2**63), 2**63 - 1)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _integer("n", self.n, 1, MAX_N)
        for name in ("ignore_eos", "skip_special_tokens", "speculative", "thinking_open"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean")
        object.__setattr__(self, "logit_bias", self._bias(self.logit_bias))
        object.__setattr__(self, "stop", self._stops(self.stop))
        object.__setattr__(self, "stop_token_ids",
                           _token_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS))
        work = self.n * self.max_tokens * (1 + (self.logprobs or 0))
        if work > MAX_REQUEST_WORK:
            raise ValueError(f"n x max_tokens x (1 + logprobs) = {work} is over this "
                             f"server's per-request bound of {MAX_REQUEST_WORK}")
        object.__setattr__(self, "response_format", ResponseFormat.parse(self.response_format))
        self._check_thinking()

    def _check_thinking(self) -> None:
        for name in ("think_end_ids", "think_start_ids"):
            object.__setattr__(self, name, _token_ids(name, getattr(self, name), MAX_THINK_IDS))
        if self.thinking_budget is None:
            return
        _integer("thinking_budget", self.thinking_budget, 0, MAX_TOKENS)
        if not self.think_end_ids:
            raise ValueError("thinking_budget needs think_end_ids (the ids that close the "
                             "thinking)")
        if self.response_format is not None:
            raise ValueError("thinking_budget cannot be combined with response_format (the "
                             "forced close would break the constraint)")

    @staticmethod
    def _bias(bias: Any) -> dict[int, float]:
        if not isinstance(bias, Mapping):
            raise ValueError("logit_bias must map token ids to numbers")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, "
                             f"got {len(bias)}")
        out = {}
        for k, v in bias.items():
            if isinstance(k, str) and not (0 < len(k) <= 10):  # (int() of a long string is slow)
                raise ValueError(f"logit_bias key {k[:16]!r} is not a token id")
            try:
                tid = int(k)  # JSON object keys arrive as strings
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias key {k!r} is not a token id") from None
            if not 0 <= tid <= MAX_TOKEN_ID or isinstance(k, (bool, float)):
                raise ValueError(f"logit_bias key {k!r} is not a token id "
                                 f"(an integer in [0, {MAX_TOKEN_ID}])")
            _number(f"logit_bias[{k}]", v, -100.0, 100.0)
            out[tid] = float(v)
        return out

    @staticmethod
    def _stops(stop: Any) -> tuple[str, ...]:
        stops = (stop,) if isinstance(stop, str) else stop
        if stops is None:
            return ()
        if not isinstance(stops, Sequence) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of them")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings")
        for s in stops:
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string is at most {MAX_STOP_CHARS} characters, "
                                 f"got {len(s)}")
        return tuple(stops)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a client's dict, rejecting unknown keys by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**data)

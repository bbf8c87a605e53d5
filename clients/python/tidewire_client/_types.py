"""Typed events of a stream and the result of `create()`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union


@dataclass(frozen=True)
class CachedTokens:
    """Prompt tokens whose KV was reused: on the device, or loaded from the host tier."""

    device: int = 0
    host: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host

    @classmethod
    def parse(cls, value: Any) -> CachedTokens:
        if isinstance(value, dict):
            return cls(int(value.get("device", 0)), int(value.get("host", 0)))
        return cls(int(value or 0))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: CachedTokens

    @classmethod
    def parse(cls, d: Dict[str, Any]) -> Usage:
        return cls(int(d.get("prompt_tokens", 0)), int(d.get("completion_tokens", 0)),
                   CachedTokens.parse(d.get("cached_tokens")))


@dataclass(frozen=True)
class Timings:
    queue_ms: float
    ttft_ms: float
    tokens_per_s: float
    total_ms: float

    @classmethod
    def parse(cls, d: Dict[str, Any]) -> Timings:
        return cls(float(d.get("queue_ms", 0)), float(d.get("ttft_ms", 0)),
                   float(d.get("tokens_per_s", 0)), float(d.get("total_ms", 0)))


@dataclass(frozen=True)
class QueuedEvent:
    """The request waits for a slot; `position` requests are ahead of it."""

    id: str
    position: int
    type: str = "queued"


@dataclass(frozen=True)
class StartEvent:
    """The request was admitted (its first tokens are on the way)."""

    id: str
    prompt_tokens: int
    cached_tokens: CachedTokens
    queue_ms: float
    type: str = "start"


@dataclass(frozen=True)
class DeltaEvent:
    """New text and token ids; `seq` grows by one per delta, `index` is the sample.
    From a thinking model (the server splits its output), `text` is the answer only and
    `reasoning` the thinking this delta adds ("" when none)."""

    id: str
    seq: int
    text: str
    token_ids: List[int]
    index: int = 0
    logprobs: Optional[List[Dict[str, Any]]] = None
    # with tools: tool-call deltas (OpenAI's shape: index, then id/type/name once and
    # argument fragments) that this delta's text completed
    tool_calls: Optional[List[Dict[str, Any]]] = None
    reasoning: str = ""
    type: str = "delta"


@dataclass(frozen=True)
class DoneEvent:
    """Always the last event: status completed | cancelled | failed."""

    id: str
    status: str
    finish_reason: str
    usage: Usage
    timings: Timings
    finish_reasons: Optional[List[str]] = None
    # with tools: every call, whole ({id, type, function: {name, arguments}}), and the
    # text outside them (None when there is none)
    tool_calls: Optional[List[Dict[str, Any]]] = None
    content: Any = None
    type: str = "done"


Event = Union[QueuedEvent, StartEvent, DeltaEvent, DoneEvent]


def parse_event(frame: Dict[str, Any]) -> Event:
    kind = frame["type"]
    if kind == "delta":
        return DeltaEvent(frame["id"], int(frame["seq"]), frame.get("text", ""),
                          list(frame.get("token_ids", [])), int(frame.get("index", 0)),
                          frame.get("logprobs"), frame.get("tool_calls"),
                          frame.get("reasoning", ""))
    if kind == "start":
        return StartEvent(frame["id"], int(frame.get("prompt_tokens", 0)),
                          CachedTokens.parse(frame.get("cached_tokens")),
                          float(frame.get("queue_ms", 0)))
    if kind == "done":
        return DoneEvent(frame["id"], frame["status"], frame["finish_reason"],
                         Usage.parse(frame.get("usage", {})),
                         Timings.parse(frame.get("timings", {})), frame.get("finish_reasons"),
                         frame.get("tool_calls"), frame.get("content"))
    if kind == "queued":
        return QueuedEvent(frame["id"], int(frame.get("position", 0)))
    raise ValueError(f"not a stream event: {kind!r}")


@dataclass
class Completion:
    """A whole result, as `create()` returns it (texts and token ids per sample)."""

    id: str
    texts: List[str]
    token_ids: List[List[int]]
    status: str
    finish_reason: str
    usage: Usage
    timings: Timings
    cached_tokens: CachedTokens = field(default_factory=CachedTokens)
    tool_calls: Optional[List[Dict[str, Any]]] = None  # with tools: the calls, whole
    content: Any = None  # with tools: the text outside the calls
    parsed: Any = None  # chat.parse(): the output as the response_format's type
    # a thinking model's reasoning per sample ("" when it thought nothing); `texts` then
    # hold the answers alone
    reasonings: List[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The first (usually the only) sample's text."""
        return self.texts[0] if self.texts else ""

    @property
    def reasoning(self) -> str:
        """The first sample's reasoning ("" when the model did not think)."""
        return self.reasonings[0] if self.reasonings else ""


def wire_params(params: Dict[str, Any]) -> Dict[str, Any]:
    """Sampling parameters as the protocol takes them: a Pydantic model class given as
    response_format becomes its JSON schema (no Pydantic import here: any class with
    `model_json_schema` will do)."""
    fmt = params.get("response_format")
    if isinstance(fmt, type) and hasattr(fmt, "model_json_schema"):
        schema = fmt.model_json_schema()  # type: ignore[attr-defined]
        return {**params, "response_format": {
            "type": "json_schema", "json_schema": {"name": fmt.__name__, "schema": schema}}}
    return params


def parse_output(response_format: Any, completion: Completion) -> Any:
    """The first sample's text read as the response_format asks: a Pydantic model's
    instance (validated), or the JSON value of a json_schema / json_object format."""
    from tidewire_client._errors import IncompleteOutputError

    if completion.finish_reason != "stop":
        raise IncompleteOutputError(
            f"the output ended with finish_reason {completion.finish_reason!r} before it was "
            "complete (raise max_tokens?)", completion)
    if isinstance(response_format, type) and hasattr(response_format, "model_validate_json"):
        return response_format.model_validate_json(completion.text)  # type: ignore[attr-defined]
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind in ("json_schema", "json_object"):
        return json.loads(completion.text)
    return completion.text


@dataclass(frozen=True)
class WarmResult:
    """What `warm()` cached: the prefix's tokens now in the cache, and what was reused."""

    prompt_tokens: int
    cached_tokens: int
    reused_tokens: CachedTokens

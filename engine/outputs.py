"""Output types the engine publishes (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass
class RequestOutput:
    """A request's state as seen by a caller: cumulative tokens and text, plus the
    delta since the previous output of the same request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None

"""Sampling parameters, validated once at the edge; the engine trusts them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples its output tokens.

    temperature 0 means greedy. `seed` makes a sampled request reproducible whatever
    the batch it runs in (each seeded request owns its random generator).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a client's dict, rejecting unknown keys by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**data)

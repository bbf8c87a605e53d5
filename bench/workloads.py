"""Seeded synthetic workloads shared by the benchmarks."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def chat64(vocab_size: int, num_requests: int = 64, seed: int = 0,
           prompt_range: tuple[int, int] = (20, 300),
           output_range: tuple[int, int] = (16, 256)) -> list[BenchRequest]:
    """The chat-64 workload: prompts of 20-300 tokens, outputs of 16-256 (EOS ignored).
    Token ids avoid the low ids where small vocabularies keep their special tokens."""
    rng = random.Random(seed)
    return [
        BenchRequest([rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_range))],
                     rng.randint(*output_range))
        for _ in range(num_requests)
    ]

"""Vectorized token sampling over a whole step's logits.

Greedy rows take the argmax. Sampled rows apply temperature, top-k and top-p on one
descending sort, then draw with the exponential-race trick (argmax of p / E, E ~ Exp(1)),
which needs one noise vector per row: seeded requests draw theirs from their own
generator, so a seeded request gets the same tokens whatever batch it runs in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """The sampling inputs of the rows that need a token this step."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # per row; None = the shared generator

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits: fp32 [rows, vocab] -> token ids [rows] int64."""
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_tokens
        rows = [i for i, p in enumerate(batch.params) if not p.greedy]
        idx = torch.tensor(rows, dtype=torch.int64)
        params = [batch.params[i] for i in rows]
        probs = self._probs(logits[idx], params)
        noise = self._noise(probs.shape, [batch.generators[i] for i in rows])
        sampled = (probs / noise).argmax(dim=-1)
        return greedy_tokens.index_copy(0, idx, sampled)

    def _probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, then top-k and top-p masks, then softmax. [rows, vocab]."""
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        logits = logits / temps[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = self._top_k_top_p(logits, params)
        return torch.softmax(logits, dim=-1)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        vocab = logits.shape[-1]
        ordered, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab)[None, :]
        ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
        remove = rank >= ks[:, None]
        ordered = ordered.masked_fill(remove, float("-inf"))
        ps = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token once the more likely ones already reach top_p (keeps >= 1).
        before = probs.cumsum(dim=-1) - probs
        ordered = ordered.masked_fill(before >= ps[:, None], float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, ordered)

    def _noise(self, shape: torch.Size, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty(shape).exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        return noise

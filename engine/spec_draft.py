"""The draft-model proposer: a smaller model with the target's tokenizer, run by the same
engine thread on its own paged KV pool, proposes k tokens per request autoregressively,
batched across requests (one catch-up step, then k - 1 one-token steps).

Each request's draft state is how many of its positions the draft's cache holds
(`computed`). After a round the cache holds the target's tokens up to the newest one
(`trusted`) and then the first k - 1 proposals; when the next round begins, the
proposals the target kept (its tokens at those positions equal them) stay valid and
the rest are recomputed, so the draft never attends to a rejected token.

For a sampled request the draft draws from its own distribution q (its logits through
the request's temperature, top-k, top-p and min-p) with the request's generator, and
q goes with the proposals to the exact acceptance rule (engine/spec_decode.py). For a
greedy request it proposes its argmax.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.block_manager import KVCacheManager
from engine.config import SpeculativeConfig
from engine.loader import load_tokenizer, load_weights, resolve_model
from engine.models.arch import ModelArch
from engine.request import Request
from engine.runner import ModelRunner
from engine.sampler import argmax_rows, sample_from
from engine.scheduler import ScheduledRequest

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger("tidewire.engine")


@dataclass(eq=False)
class DraftSeq:
    """A request as the draft model sees it: the target's tokens, then this round's
    proposals. Has what the block manager and ModelRunner read of a Request."""

    target: Request
    request_id: str
    num_computed_tokens: int = 0
    trusted: int = 0  # positions before this hold the target's tokens (as of the last round)
    drafted: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # (ModelRunner reads it)

    @property
    def num_tokens(self) -> int:
        return self.target.num_tokens + len(self.drafted)

    def token_at(self, i: int) -> int:
        n = self.target.num_tokens
        return self.target.token_at(i) if i < n else self.drafted[i - n]


class DraftProposer:
    def __init__(self, engine: LLMEngine, config: SpeculativeConfig) -> None:
        assert config.draft_model
        self.config = config
        self.target_runner = engine.runner
        model_dir = resolve_model(config.draft_model)
        arch = ModelArch.from_dir(model_dir)
        if arch.vocab_size != engine.arch.vocab_size:
            raise ValueError(f"draft model {config.draft_model} has a vocabulary of "
                             f"{arch.vocab_size} tokens, the target {engine.arch.vocab_size}: "
                             "a draft must share the target's tokenizer")
        tok = load_tokenizer(model_dir)
        if tok is not None and engine.tokenizer is not None and \
                tok.get_vocab() != engine.tokenizer.get_vocab():
            raise ValueError(f"draft model {config.draft_model} has another tokenizer than "
                             "the target: a draft must share the target's tokenizer")
        cc = engine.config.cache
        self.block_size = cc.block_size
        # as many blocks as the target's pool: the draft holds the same sequences
        self.num_blocks = engine.num_blocks
        self.kv = KVCacheManager(self.num_blocks, cc.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(
            arch, load_weights(model_dir), platform=engine.platform, block_size=cc.block_size,
            num_blocks=self.num_blocks, seed=engine.config.seed,
            max_num_seqs=engine.config.scheduler.max_num_seqs,
            max_model_len=engine.max_model_len)
        self.seqs: dict[str, DraftSeq] = {}
        # tokens one round may feed to catch requests up (a new request's whole prompt):
        # the step's token budget, as for the target
        self.max_catch_up = engine.config.scheduler.max_num_batched_tokens
        log.info("draft model %s: %d layers, %d KV blocks", config.draft_model,
                 arch.num_layers, self.num_blocks)

    def release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)  # type: ignore[arg-type]  # a DraftSeq stands for a Request

    def _sync(self, req: Request) -> DraftSeq:
        """The request's draft state, its cache trimmed to what is still valid: the
        target's tokens up to `trusted`, then the proposals the target kept."""
        seq = self.seqs.get(req.request_id)
        if seq is None:
            seq = self.seqs[req.request_id] = DraftSeq(req, req.request_id)
            return seq
        valid = seq.trusted
        # (the newest token is always fed again: its logits give the first proposal)
        most = min(seq.num_computed_tokens, req.num_tokens - 1)
        for d in seq.drafted:
            if valid >= most or req.token_at(valid) != d:
                break
            valid += 1
        seq.num_computed_tokens = min(most, valid)
        seq.drafted = []
        return seq

    def _allocate(self, seq: DraftSeq, n: int, keep: set[str]) -> bool:
        if self.kv.allocate_slots(seq, n):  # type: ignore[arg-type]
            return True
        # the pool is short: drop the draft state of requests not proposing now
        for rid in [r for r in self.seqs if r not in keep]:
            self.release(rid)
        return self.kv.allocate_slots(seq, n)  # type: ignore[arg-type]

    @torch.inference_mode()
    def propose(self, reqs: list[Request], ks: list[int]) -> None:
        keep = {r.request_id for r in reqs}
        live: list[tuple[Request, DraftSeq, int]] = []
        behind: list[ScheduledRequest] = []  # catching up over several rounds first
        budget = self.max_catch_up
        for req, k in zip(reqs, ks):
            seq = self._sync(req)
            need = req.num_tokens - seq.num_computed_tokens
            if need > budget:  # a long prompt: a chunk now, proposals once caught up
                if budget > 1 and self._allocate(seq, budget - 1, keep):
                    behind.append(ScheduledRequest(seq, budget - 1,  # type: ignore[arg-type]
                                                   self.kv.block_ids(seq.request_id)))
                    budget = 0
                continue
            # this round feeds the tokens the draft lacks, then k - 1 proposals
            if self._allocate(seq, need + k - 1, keep):
                seq.trusted = req.num_tokens
                live.append((req, seq, k))
                budget -= need
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, _, _ in live}
        while live or behind:
            sched = [ScheduledRequest(seq, seq.num_tokens - seq.num_computed_tokens,  # type: ignore[arg-type]
                                      self.kv.block_ids(seq.request_id)) for _, seq, _ in live]
            logits = self.runner.last_logits(sched + behind)
            for s in behind:  # (their logits are not used)
                s.request.num_computed_tokens += s.num_new_tokens
                s.request.trusted = s.request.num_computed_tokens  # type: ignore[attr-defined]
            behind = []
            if not live:
                break
            drawn = self._draw(logits[: len(sched)], [req for req, _, _ in live], probs)
            nxt = []
            for (req, seq, k), s, t in zip(live, sched, drawn):
                seq.num_computed_tokens += s.num_new_tokens
                seq.drafted.append(t)
                if len(seq.drafted) < k:
                    nxt.append((req, seq, k))
                else:
                    req.spec_token_ids = list(seq.drafted)
                    q = probs[req.request_id]
                    req.spec_probs = torch.stack(q) if q else None
            live = nxt

    def _draw(self, logits: torch.Tensor, reqs: list[Request],
              probs: dict[str, list[torch.Tensor]]) -> list[int]:
        """Each request's next proposal: its argmax (greedy), or a draw from q (kept in
        `probs` for the acceptance rule)."""
        out = argmax_rows(logits).tolist()
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if not rows:
            return out
        sampler = self.target_runner.sampler
        x = logits[rows].to("cpu", torch.float32)
        q = sampler.probs(x, [reqs[i].params for i in rows])
        for j, i in enumerate(rows):
            r = reqs[i]
            u = torch.tensor([sampler.uniform(self.target_runner.generator(r))])
            out[i] = int(sample_from(q[j: j + 1], u)[0])
            probs[r.request_id].append(q[j])
        return out

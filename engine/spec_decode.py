"""Speculative decoding: proposers, and the exact verification of their proposals.

A proposer guesses the next k tokens of a request that is decoding; the scheduler runs
them after the request's newest token, so one forward pass scores all k + 1 positions
(to the attention backends this is a k + 1-token chunk with cached context, as a
prefill chunk is), and `verify` keeps the longest run the target model agrees with:

- greedy: a proposal is kept while it equals the argmax of the target's processed
  logits at its position; the first disagreement is replaced by that argmax, and when
  all k are kept the k + 1-th row gives one more token;
- sampled: the standard rejection rule. Proposal x drawn from q is kept with
  probability min(1, p(x) / q(x)), p being the target's distribution after every
  logits processor of the request (constraint mask, bias, min_tokens, penalties,
  temperature, top-k, top-p, min-p); on a rejection the token is drawn from
  normalize(max(0, p - q)), and no later proposal is looked at. An n-gram proposal is
  a point mass (q(x) = 1). The output then has exactly the distribution of sampling
  from p one token at a time.

Each row's processors see the proposals before it as already generated (penalties,
min_tokens, a constraint's automaton), so row i's p is the distribution the request
would have at that position. A seeded request draws from its own generator, so it is
reproducible (its draws differ from a run without speculation: same distribution,
other tokens).

Proposers run on the engine thread before each schedule and set
`Request.spec_token_ids` for the running requests that are decoding:
`NgramProposer` (prompt lookup, no model) and `DraftProposer` (a smaller model with the
same tokenizer on its own KV pool, engine/spec_draft.py). `Speculator` decides who
proposes: the request did not opt out, the batch is small enough, and its off-switch
has not tripped (acceptance below a floor after a few probing steps pauses it).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.config import SpeculativeConfig
from engine.outputs import TokenLogprob
from engine.request import Request
from engine.sampler import Sampler, SamplingBatch, argmax_rows, sample_from, _finite

if TYPE_CHECKING:
    from engine.scheduler import ScheduledRequest

log = logging.getLogger("tidewire.engine")


class Proposer(Protocol):
    def propose(self, reqs: list[Request], k: list[int]) -> None:
        """Set reqs[i].spec_token_ids to at most k[i] proposed tokens (and, for a
        draft model, spec_probs to their distributions)."""

    def release(self, request_id: str) -> None:
        """Forget a finished or preempted request's state."""


# -- n-gram (prompt lookup) ------------------------------------------------------------


class NgramProposer:
    """Find the newest earlier occurrence of the request's last n tokens (n from
    `max_n` down to `min_n`) in its prompt and output, and propose the tokens that
    followed it.

    The tokens are kept per request as 4-byte little-endian ids in a bytearray that
    grows with the output, and searched with bytes.rfind (C speed; a hit at an offset
    not divisible by 4 straddles two ids and is skipped)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._buf: dict[str, bytearray] = {}

    def _tokens(self, req: Request) -> bytearray:
        buf = self._buf.get(req.request_id)
        if buf is None:
            buf = self._buf[req.request_id] = bytearray()
        have = len(buf) // 4
        if have < req.num_tokens:
            buf += array("i", req.token_slice(have, req.num_tokens)).tobytes()
        return buf

    def propose(self, reqs: list[Request], k: list[int]) -> None:
        for req, want in zip(reqs, k):
            req.spec_token_ids = self.lookup(self._tokens(req), want)

    def lookup(self, buf: bytes | bytearray, k: int) -> list[int]:
        n_tok = len(buf) // 4
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            pattern = bytes(buf[(n_tok - n) * 4 :])
            end = (n_tok - 1) * 4  # a match must end before the last token
            while True:
                i = buf.rfind(pattern, 0, end)
                if i < 0:
                    break
                if i % 4 == 0:
                    start = i // 4 + n
                    stop = min(start + k, n_tok)
                    return array("i", buf[start * 4 : stop * 4]).tolist()
                end = i + len(pattern) - 1  # straddles two ids: look further back
        return []

    def release(self, request_id: str) -> None:
        self._buf.pop(request_id, None)


# -- who proposes ----------------------------------------------------------------------


class Speculator:
    """Runs the proposer for the requests that should speculate this step, and keeps
    each request's acceptance (the off-switch)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer

    def propose(self, running: list[Request], step: int, max_tokens: int | None = None) -> None:
        """Proposals for the running requests that are decoding. `max_tokens`: at most
        this many query tokens in the whole step (decodes and proposals; None: no cap).
        The CPU's compiled step takes 8: a step past it runs the eager path, which costs
        more than the proposals save."""
        c = self.config
        for r in running:
            r.spec_token_ids = []
            r.spec_probs = None
        if c.max_batch and len(running) > c.max_batch:
            return
        spare = None if max_tokens is None else max_tokens - len(running)
        reqs, ks = [], []
        for r in running:
            p = r.params
            # the newest token plus k proposals may not pass max_tokens
            k = min(c.num_tokens, p.max_tokens - r.num_output_tokens - 1)
            # (a seeded sampled request draws one number per token: so it continues
            # exactly on a replica that recomputes it from its tokens; docs/protocol.md)
            if not (k > 0 and p.speculative and r.decoding and step >= r.spec_resume_step
                    and r.num_output_tokens > 0 and (p.greedy or p.seed is None)):
                continue
            if spare is not None:
                k = min(k, spare)
                if k <= 0:
                    break
                spare -= k
            reqs.append(r)
            ks.append(k)
        if reqs:
            self.proposer.propose(reqs, ks)

    def propose_step(self, running: list[Request], step: int, max_tokens: int | None) -> None:
        """propose(), for the engine's step: proposals are optional, so when the proposer
        raises the step goes without them."""
        try:
            self.propose(running, step, max_tokens)
        except Exception:  # noqa: BLE001 - this step goes without proposals
            log.exception("speculative proposals failed; the step runs without them")
            for r in running:
                r.spec_token_ids, r.spec_probs = [], None

    def record_step(self, scheduled: Sequence[ScheduledRequest], step: int) -> None:
        """After a verifying step: each verifying request's acceptance (record())."""
        for s in scheduled:
            if s.num_spec:
                r = s.request
                self.record(r, s.num_spec, r.num_new_tokens_last - 1, step)

    def record(self, req: Request, proposed: int, accepted: int, step: int) -> None:
        """After a verifying step: trip the off-switch of a request whose proposals are
        mostly rejected (paused for `cooldown` steps, doubled each trip)."""
        c = self.config
        steps, prop, acc = req.spec_window
        steps, prop, acc = steps + 1, prop + proposed, acc + accepted
        if steps >= c.probe_steps:
            if acc < c.min_acceptance * prop:
                req.spec_resume_step = step + (c.cooldown << min(req.spec_trips, 10))
                req.spec_trips += 1
            steps = prop = acc = 0
        req.spec_window = (steps, prop, acc)

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)


def make_speculator(config: SpeculativeConfig, draft: Any = None) -> Speculator | None:
    """The engine's Speculator for its config (`draft`: a DraftProposer, for "draft")."""
    if config.method == "none":
        return None
    if config.method == "ngram":
        return Speculator(config, NgramProposer(config.ngram_min, config.ngram_max))
    assert draft is not None
    return Speculator(config, draft)


# -- verification ----------------------------------------------------------------------


@dataclass(slots=True)
class SpecRows:
    """One verifying request's rows in the step's logits: `len(proposals) + 1`
    consecutive rows from `start` (row i scores the token after proposals[:i])."""

    request: Request
    proposals: list[int]
    start: int
    generator: torch.Generator | None
    probs: torch.Tensor | None  # the draft's [len(proposals), vocab]; None: point masses


@dataclass(slots=True)
class Verified:
    tokens: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprob]]


def _row_batch(groups: list[SpecRows]) -> SamplingBatch:
    """A SamplingBatch with a row per scored position: row i of a request sees its
    proposals before i as generated."""
    params, gens, prompts, outs, eos = [], [], [], [], []
    for g in groups:
        r = g.request
        for i in range(len(g.proposals) + 1):
            params.append(r.params)
            gens.append(g.generator)
            prompts.append(r.prompt_token_ids)
            outs.append(r.output_token_ids + g.proposals[:i] if i else r.output_token_ids)
            eos.append(r.eos_token_ids)
    return SamplingBatch(params, gens, prompts, outs, eos)


def _constraint_masks(logits: torch.Tensor, groups: list[SpecRows]) -> None:
    """A constrained request's rows get the masks of its automaton walked along its
    proposals (rolled back afterwards); a proposal the constraint refuses leaves the
    rows after it unmasked, and it is rejected there anyway (its p is 0)."""
    from engine.structured import apply_bitmask, new_bitmask

    rows: list[int] = []
    stops: dict[int, int] = {}
    bitmask = None
    for g in groups:
        m = g.request.matcher
        if m is None:
            continue
        if bitmask is None:
            bitmask = new_bitmask(logits.shape[0], logits.shape[-1])
        walked = 0
        for i in range(len(g.proposals) + 1):
            m.fill(bitmask, g.start + i)
            rows.append(g.start + i)
            stops[g.start + i] = m.stop_token
            if i == len(g.proposals) or not m.accept(g.proposals[i]):
                break
            walked += 1
        if walked:
            m.rollback(walked)
    if bitmask is not None:
        apply_bitmask(logits, bitmask, rows, stops)


def verify(sampler: Sampler, logits: torch.Tensor, groups: list[SpecRows]) -> Verified:
    """The tokens each verifying request keeps this step (and their logprobs where the
    request asked). `logits`: the target's [rows, vocab] for the groups' rows."""
    params = [g.request.params for g in groups]
    greedy_raw = all(p.greedy and p.logprobs is None and not p.logit_bias and not p.penalized
                     and p.min_tokens == 0 and g.request.matcher is None
                     for p, g in zip(params, groups))
    if greedy_raw:  # argmax of the raw logits, in the model's dtype
        best = argmax_rows(logits).tolist()
        return Verified({g.request.request_id: _accept_greedy(g, best) for g in groups}, {})
    x = logits.to("cpu", torch.float32).contiguous()
    if any(g.request.matcher is not None for g in groups):
        _constraint_masks(x, groups)
    batch = _row_batch(groups)
    x = _finite(sampler.process(x, batch))
    want_lp = any(p.logprobs is not None for p in params)
    lp = torch.log_softmax(x, dim=-1) if want_lp else None
    best = argmax_rows(x).tolist()
    sampled_rows = [i for i, p in enumerate(batch.params) if not p.greedy]
    probs = sampler.probs(x[sampled_rows], [batch.params[i] for i in sampled_rows]) \
        if sampled_rows else None
    where = {row: j for j, row in enumerate(sampled_rows)}
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprob]] = {}
    for g in groups:
        r = g.request
        if r.params.greedy:
            kept = _accept_greedy(g, best)
        else:
            assert probs is not None
            kept = _accept_sampled(sampler, g, probs[where[g.start]: where[g.start] +
                                                     len(g.proposals) + 1])
        tokens[r.request_id] = kept
        if lp is not None and r.params.logprobs is not None:
            logprobs[r.request_id] = _logprobs(lp, g.start, kept, r.params.logprobs)
    return Verified(tokens, logprobs)


def _accept_greedy(g: SpecRows, best: list[int]) -> list[int]:
    kept = []
    for i, x in enumerate(g.proposals):
        t = best[g.start + i]
        kept.append(t)
        if t != x:
            return kept
    kept.append(best[g.start + len(g.proposals)])
    return kept


def _accept_sampled(sampler: Sampler, g: SpecRows, p: torch.Tensor) -> list[int]:
    """The rejection rule over the group's rows of target probabilities p [k + 1, V]."""
    kept: list[int] = []
    gen = g.generator
    for i, x in enumerate(g.proposals):
        px = float(p[i, x])
        qx = 1.0 if g.probs is None else float(g.probs[i, x])
        u = sampler.uniform(gen)
        if u * qx < px:  # accept with probability min(1, p(x) / q(x))
            kept.append(x)
            continue
        if g.probs is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = (p[i] - g.probs[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # (p == q up to rounding: any draw from p)
            residual = p[i]
        kept.append(int(sample_from(residual[None], torch.tensor([sampler.uniform(gen)]))[0]))
        return kept
    last = len(g.proposals)
    kept.append(int(sample_from(p[last: last + 1], torch.tensor([sampler.uniform(gen)]))[0]))
    return kept


def _logprobs(lp: torch.Tensor, start: int, kept: list[int], n: int) -> list[TokenLogprob]:
    rows = lp[start: start + len(kept)]
    chosen = rows.gather(1, torch.tensor(kept)[:, None])[:, 0].tolist()
    top_v, top_i = rows.topk(n, dim=-1) if n else (rows[:, :0], rows[:, :0].long())
    return [TokenLogprob(t, c, list(zip(ti, tv)))
            for t, c, ti, tv in zip(kept, chosen, top_i.tolist(), top_v.tolist())]

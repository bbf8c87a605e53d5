"""A scheduled step flattened on the host into one ragged batch: the decodes first (one
new token each, longest context first), then the prefill chunks; each token's id,
position and cache slot, and the backend-neutral StepLayout of the step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.base import PrefillSpec, StepLayout
from engine.sampler import SamplingBatch
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.spec_decode import SpecRows


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: object  # the attention backend's metadata for this step
    logits_rows: torch.Tensor  # [num_samples] int64: rows whose logits are sampled
    sample_ids: list[str]  # request id of each sampled row
    sampling: SamplingBatch
    # requests verifying proposals: their rows follow the sampled ones in logits_rows
    spec: list[SpecRows] = field(default_factory=list)


def split_step(out: SchedulerOutput) -> tuple[list[ScheduledRequest], list[ScheduledRequest]]:
    """Decodes (one new token, longest context first), then prefill chunks."""
    decodes = sorted((s for s in out.scheduled if s.num_new_tokens == 1),
                     key=lambda s: -s.request.num_computed_tokens)
    return decodes, [s for s in out.scheduled if s.num_new_tokens > 1]


def append_tokens(s: ScheduledRequest, block_size: int, ids: list[int], pos: list[int],
                  slots: list[int]) -> None:
    """Append the token ids, positions and cache slots of `s`'s new tokens (its known
    tokens, then the proposals it verifies)."""
    req, bs = s.request, block_size
    start = req.num_computed_tokens
    known = start + s.num_new_tokens - s.num_spec
    for p in range(start, start + s.num_new_tokens):
        ids.append(req.token_at(p) if p < known else req.spec_token_ids[p - known])
        pos.append(p)
        slots.append(s.block_ids[p // bs] * bs + p % bs)


def step_layout(decodes: list[ScheduledRequest], prefills: list[ScheduledRequest],
                slots: list[int], block_size: int) -> StepLayout:
    """The step as every attention backend reads it (AttentionBackend.build_metadata)."""
    specs, q_start = [], len(decodes)
    for s in prefills:
        ctx = s.request.num_computed_tokens + s.num_new_tokens
        specs.append(PrefillSpec(q_start, s.num_new_tokens, ctx,
                                 s.block_ids[: -(-ctx // block_size)]))
        q_start += s.num_new_tokens
    return StepLayout(
        slot_mapping=slots,
        decode_seq_lens=[s.request.num_computed_tokens + 1 for s in decodes],
        decode_block_ids=[s.block_ids for s in decodes],
        prefills=specs,
    )

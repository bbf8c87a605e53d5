"""Cascade (shared-prefix) attention: a batch whose requests all start with the same
cached prefix attends to that prefix once for every query of the batch, then each
request to the rest of its own context, and the two are merged exactly by LSE.

    prefix  a CascadePrefix, built once per step from the shared prefix's blocks (each
            request's context before this step's queries covers them)
    everything else as in kernels.paged_attention.

The prefix pass is the paged kernel run on synthetic sequences that each hold every
query of the batch and one partition of the prefix's blocks, keys clipped to the
partition: all of them lie before every query, so they are visible to all, and each K/V
tile of the prefix is read once per block of queries instead of once per request. One
partition alone would be a grid of (KV heads x query blocks) programs, a dozen for 64
decodes of a 9/3-head model, too few for a GPU's SMs; the partitions are split-K over
the prefix, merged with the suffix in the same log-sum-exp merge. Partitions are equal
(the kernel clips keys at one bound for all of them); the few blocks an even split
leaves over are read with each request's suffix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.merge_attn_states import merge_attn_states
from kernels.paged_attention import paged_attention

# a partition holds at least this many blocks (a few key tiles), and there are at most
# MAX_PARTS; PROGRAMS_PER_SM sizes the grid the partitions aim for
MIN_PART_BLOCKS = 8
MAX_PARTS = 32
PROGRAMS_PER_SM = 2


def prefix_parts_for(num_prefix_blocks: int, num_tokens: int, num_heads: int,
                     num_kv_heads: int, device: torch.device) -> int:
    """How many key partitions the prefix pass takes: enough programs for every SM
    (1 on a CPU, where the interpreter gains nothing from more)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    q_blocks = triton.cdiv(num_tokens, max(1, 64 // group_pad))
    want = triton.cdiv(PROGRAMS_PER_SM * sms, q_blocks * num_kv_heads)
    return max(1, min(want, num_prefix_blocks // MIN_PART_BLOCKS, MAX_PARTS))


def split_prefix(blocks: int, want: int) -> tuple[int, int]:
    """(partitions, blocks each) for a prefix of `blocks` blocks and about `want`
    partitions: equal partitions (the kernel clips every synthetic sequence's keys at one
    bound), between want/2 and want of them, leaving the fewest blocks over; those few
    are read with each request's suffix."""
    want = max(1, min(want, blocks))
    best = min(range(max(1, want // 2), want + 1), key=lambda n: (blocks % n, -n))
    return best, blocks // best


@dataclass(frozen=True)
class CascadePrefix:
    """The prefix pass of one step, built once per step (not per layer): the partitions'
    block table [parts, per] and their synthetic sequences' lengths and query starts."""

    table: torch.Tensor  # [parts, per] int32
    lens: torch.Tensor  # [parts] int32: per * block_size + num_tokens
    starts: torch.Tensor  # [parts + 1] int32: i * num_tokens
    keys: int  # prefix keys the pass covers (parts * per * block_size); the rest of the
    # shared prefix is read with each request's suffix

    @property
    def parts(self) -> int:
        return self.table.shape[0]

    @staticmethod
    def build(prefix_block_ids: list[int] | torch.Tensor, prefix_len: int, block_size: int,
              num_tokens: int, num_heads: int, num_kv_heads: int, device: torch.device | str,
              parts: int | None = None) -> CascadePrefix:
        """prefix_len: tokens of the shared prefix (whole blocks, all in prefix_block_ids);
        parts: key partitions (None: enough to fill the GPU, prefix_parts_for)."""
        ids = torch.as_tensor(prefix_block_ids, dtype=torch.int32).flatten()
        if prefix_len <= 0 or prefix_len % block_size or ids.shape[0] * block_size < prefix_len:
            raise ValueError("prefix_len must be whole blocks (at least one), all in "
                             "prefix_block_ids")
        device = torch.device(device)
        blocks = prefix_len // block_size
        n, per = split_prefix(blocks, parts or prefix_parts_for(blocks, num_tokens, num_heads,
                                                                 num_kv_heads, device))
        host = torch.empty(2 * n + 1 + n * per, dtype=torch.int32)
        host[:n] = per * block_size + num_tokens
        host[n: 2 * n + 1] = torch.arange(n + 1, dtype=torch.int32) * num_tokens
        host[2 * n + 1:] = ids[: n * per].cpu()
        dev = host.to(device, non_blocking=True)  # one copy up
        return CascadePrefix(dev[2 * n + 1:].view(n, per), dev[:n], dev[n: 2 * n + 1],
                             n * per * block_size)


def cascade_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      prefix: CascadePrefix, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                      out: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """validate=False skips the check that every context covers the prefix (a device
    sync per call; the engine's backend builds the prefix from the block tables)."""
    num_tokens, num_heads, head_dim = q.shape
    if validate and bool((seq_lens - query_start_loc.diff() < prefix.keys).any()):
        raise ValueError("every request's cached context must cover the shared prefix")
    parts, keys = prefix.parts, prefix.keys
    # every partition's output and the suffix's, side by side for the merge
    states = torch.empty((parts + 1, num_tokens, num_heads, head_dim), dtype=q.dtype,
                         device=q.device)
    lses = torch.empty((parts + 1, num_tokens, num_heads), dtype=torch.float32,
                       device=q.device)
    pre_q = q.repeat(parts, 1, 1) if parts > 1 else q
    paged_attention(pre_q, k_cache, v_cache, prefix.table, prefix.lens, prefix.starts, scale,
                    num_tokens, out=states[:parts].view(-1, num_heads, head_dim),
                    return_lse=True, lse_out=lses[:parts].view(-1, num_heads),
                    kv_end=keys // parts)
    paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                    max_query_len, out=states[parts], return_lse=True, lse_out=lses[parts],
                    kv_start=keys)
    return merge_attn_states(states, lses, out=out)  # type: ignore[return-value]

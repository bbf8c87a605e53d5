"""Cascade (shared-prefix) attention: a batch whose requests all start with the same
cached prefix attends to that prefix once for every query of the batch, then each
request to the rest of its own context, and the two are merged exactly by LSE.

    prefix_block_ids [num_prefix_blocks] int32   the shared prefix's blocks
    prefix_len       tokens of the shared prefix (a multiple of block_size; each
                     request's context before this step's queries covers it)
    everything else as in kernels.paged_attention.

The prefix pass is the paged kernel run on one synthetic sequence holding every query
of the batch, whose keys are clipped to [0, prefix_len): all of them lie before every
query, so they are visible to all and each K/V tile of the prefix is read once per
block of queries instead of once per request.
"""

from __future__ import annotations

import torch

from kernels.merge_attn_states import merge_attn_states
from kernels.paged_attention import paged_attention


def cascade_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      prefix_block_ids: torch.Tensor, prefix_len: int,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    num_tokens = q.shape[0]
    block_size = k_cache.shape[1]
    if prefix_len % block_size or prefix_block_ids.shape[0] * block_size < prefix_len:
        raise ValueError("prefix_len must be whole blocks, all in prefix_block_ids")
    ctx = seq_lens - (query_start_loc[1:] - query_start_loc[:-1])
    if bool((ctx < prefix_len).any()):
        raise ValueError("every request's cached context must cover the shared prefix")
    dev = q.device
    one_table = prefix_block_ids.to(torch.int32).view(1, -1).contiguous()
    one_len = torch.tensor([prefix_len + num_tokens], dtype=torch.int32, device=dev)
    one_start = torch.tensor([0, num_tokens], dtype=torch.int32, device=dev)
    pre_out, pre_lse = paged_attention(q, k_cache, v_cache, one_table, one_len, one_start,
                                       scale, num_tokens, return_lse=True, kv_end=prefix_len)
    suf_out, suf_lse = paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                       query_start_loc, scale, max_query_len,
                                       return_lse=True, kv_start=prefix_len)
    merged = merge_attn_states(torch.stack([pre_out, suf_out]), torch.stack([pre_lse, suf_lse]))
    out = torch.empty_like(q) if out is None else out
    out.copy_(merged)
    return out

"""Torch references for Tidewire's kernels.

They are the oracle that the Triton kernels and the compiled CPU kernels
(kernels/cpu_ops.py) are tested against, and what the engine runs where neither can:
the torch layer ops (engine/layer_ops.py TorchOps: no C++ compiler, or shapes the
compiled kernels do not take), the int8 KV cache write of a model on those ops, the
token bitmask without the compiled kernels. The arithmetic follows HF transformers'
Llama exactly (fp32 statistics in RMSNorm, cos/sin built in fp32 then cast to the
activation dtype), so fp32 runs match it bit for bit where the op order allows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of (x + residual). Returns (normed, new_residual).

    x, residual: [num_tokens, hidden] in the activation dtype; weight: [hidden], in the
    activation dtype (it multiplies after the cast to it, as HF's Llama norm) or in fp32
    (it multiplies before: Gemma's (1 + w) norms, as HF's Gemma computes them)."""
    if residual is not None:
        x = x + residual
    # F.rms_norm in fp32 is bit-identical to HF's x * rsqrt(mean(x^2) + eps) and one op
    # instead of five.
    h = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if weight.dtype == torch.float32:
        return (h * weight).to(x.dtype), x
    return weight * h.to(x.dtype), x


def rope_cos_sin(head_dim: int, max_positions: int,
                 theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain rotary cos and sin tables, fp32, [max_positions, head_dim // 2] (neox
    layout: the first half of a head rotates with the second), for the kernels' tests;
    the models build theirs, every scaling variant included, in engine/models/rotary.py."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def rope_gather(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width rows for a step's positions, [num_tokens, 1, head_dim], in the
    activation dtype: cos repeated over both halves, sin with the first half negated
    (so rotate_half's sign lives in the table). Gathered once per step, shared by
    every layer."""
    c, s = cos[positions], sin[positions]
    full_cos = torch.cat((c, c), dim=-1).to(dtype)[:, None, :]
    signed_sin = torch.cat((-s, s), dim=-1).to(dtype)[:, None, :]
    return full_cos, signed_sin


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x [num_tokens, num_heads, head_dim] by rope_gather's rows:
    x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] written as a roll of
    the halves times the signed sin (the same IEEE products as HF transformers)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] = [gate | up] -> silu(gate) * up, [num_tokens, d]."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, kv_start: int = 0,
                    kv_end: int = 2**31 - 1, window: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of kernels.paged_attention, same layouts ([num_blocks, block_size,
    kv_heads, head_dim] caches), in fp32, one sequence at a time. Returns (out [tokens,
    heads, dim] in q's dtype, lse [tokens, heads] fp32; -inf where nothing is seen).
    window > 0: sliding-window attention, the query at position p sees keys k with
    p - window < k <= p (window keys, its own included: HF transformers' rule); 0: all
    keys up to its own."""
    num_heads = q.shape[1]
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), device=q.device)
    for s in range(seq_lens.shape[0]):
        a, b = int(query_start_loc[s]), int(query_start_loc[s + 1])
        n, q_len = int(seq_lens[s]), b - a
        blocks = block_tables[s, : -(-n // bs)].long()
        k = k_cache[blocks].reshape(-1, kvh, k_cache.shape[-1])[:n].float()
        v = v_cache[blocks].reshape(-1, kvh, v_cache.shape[-1])[:n].float()
        k = k.repeat_interleave(num_heads // kvh, dim=1)  # [n, heads, d]
        v = v.repeat_interleave(num_heads // kvh, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * scale
        qpos = torch.arange(n - q_len, n, device=q.device)[:, None]
        kpos = torch.arange(n, device=q.device)[None, :]
        visible = (kpos <= qpos) & (kpos >= kv_start) & (kpos < kv_end)
        if window > 0:
            visible &= kpos > qpos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        m = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - m.nan_to_num(neginf=0.0))
        denom = p.sum(-1, keepdim=True)
        o = torch.einsum("hqk,khd->qhd", p / denom.clamp_min(1e-30), v)
        out[a:b] = o.to(q.dtype)
        lse[a:b] = torch.where(denom > 0, m + denom.log(), float("-inf")).squeeze(-1).T
    return out, lse


def merge_attn_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention over disjoint key sets: outs [P, tokens, heads, d], lses
    [P, tokens, heads] -> (out [tokens, heads, d], lse [tokens, heads])."""
    m = lses.amax(0)
    m_safe = m.nan_to_num(neginf=0.0)
    w = torch.exp(lses - m_safe)  # [P, T, H]; 0 for parts that saw nothing
    total = w.sum(0)
    out = (w[..., None] * outs.float()).sum(0) / total.clamp_min(1e-30)[..., None]
    lse = torch.where(total > 0, m_safe + total.log(), float("-inf"))
    return out.to(outs.dtype), lse


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [tokens, kv_heads, d] into [num_blocks, block_size, kv_heads, d] caches at
    slot = block * block_size + offset; slot -1 is skipped (padding)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    bs = k_cache.shape[1]
    k_cache[slots // bs, slots % bs] = k[keep]
    v_cache[slots // bs, slots % bs] = v[keep]


# -- the int8 KV cache ("q8"; kernels/cpu/kv_q8.h) -------------------------------------
# One layer's K (or V) cache is uint8 [kv_heads, num_blocks, block_size * (head_dim + 4)]:
# per (KV head, block), block_size rows of head_dim codes, then the rows' fp32 scales.
# K codes are stored biased (+128, as uint8), V codes as int8.
Q8_K_BIAS = 128


def quantize_kv_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of each row x[..., :]: (codes int8 [..., d], scale fp32 [...]) with
    scale = max|x| / 127 and codes = round(x / scale) (half to even; 0 for a zero row)."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127.0
    div = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(xf / div[..., None]).clamp_(-127, 127)
    return codes.to(torch.int8), scale


def q8_block_size(cache: torch.Tensor, head_dim: int) -> int:
    return cache.shape[-1] // (head_dim + 4)


def q8_views(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a q8 cache: (codes uint8 [kv_heads, num_blocks, block_size, head_dim],
    scales fp32 [kv_heads, num_blocks, block_size])."""
    bs = q8_block_size(cache, head_dim)
    codes = cache[..., : bs * head_dim].unflatten(-1, (bs, head_dim))
    return codes, cache[..., bs * head_dim :].view(torch.float32)


def q8_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [tokens, kv_heads, head_dim] quantized into q8 caches at slot = block *
    block_size + offset; slot -1 is skipped (padding)."""
    d = k.shape[-1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    bs = q8_block_size(k_cache, d)
    for cache, x, biased in ((k_cache, k[keep], True), (v_cache, v[keep], False)):
        codes, scales = q8_views(cache, d)
        c, s = quantize_kv_rows(x)  # [n, kv_heads, d], [n, kv_heads]
        stored = (c.to(torch.int16) + Q8_K_BIAS).to(torch.uint8) if biased else c.view(torch.uint8)
        codes[:, slots // bs, slots % bs] = stored.transpose(0, 1)
        scales[:, slots // bs, slots % bs] = s.transpose(0, 1)


def q8_dequantize(cache: torch.Tensor, head_dim: int, biased: bool) -> torch.Tensor:
    """A q8 cache as fp32 [kv_heads, num_blocks, block_size, head_dim] (codes x scales)."""
    codes, scales = q8_views(cache, head_dim)
    c = codes.to(torch.int16) - Q8_K_BIAS if biased else codes.view(torch.int8)
    return c.float() * scales[..., None]


def quantize_queries(q: torch.Tensor) -> torch.Tensor:
    """What the q8 decode kernel multiplies: each query row [..., head_dim] through int8
    codes (quantize_kv_rows) and back, fp32."""
    codes, scale = quantize_kv_rows(q)
    return codes.float() * scale[..., None]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[r, t] = -inf (in place) for each row r in `rows` and each token t whose bit
    is clear in bitmask[r]: bit t % 32 of the int32 word t // 32 (xgrammar's layout).
    logits [n, vocab] (any float dtype); bitmask int32 [>= n, words]."""
    vocab = logits.shape[-1]
    idx = torch.tensor(rows, dtype=torch.int64)
    words = bitmask[idx]
    bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(len(rows), -1)[:, :vocab].bool()
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))

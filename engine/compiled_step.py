"""Decode steps of 1-8 query tokens as one compiled call (the cpu backend).

The CPU counterpart of engine/cuda_graphs.py. An eager decode step of a small model is
~300 torch calls from Python, each forking and joining the OpenMP team: at batch 1 that
overhead rivalled the time spent reading the weights. `torch.ops.tidewire.decode_step`
(kernels/cpu/decode_step.h) runs the whole stack, final norm and LM head included, in
one parallel region with barriers between phases, on the model's own weights and KV
cache (nothing is copied or captured: the "buckets" are every batch size from 1 to
`max_rows`). A sequence may bring several query tokens (a decode verifying speculative
proposals, a short chunk): up to 8 in all. Larger steps run eagerly: past a
few rows the oneDNN matmuls of the eager path are the faster ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import PagedMetadata
from engine.models.decoder import DecoderModel
from engine.models.layers import Int8Linear, Linear


def _weight(lin: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plain (or int8) weight and scale (None: none) the compiled step reads."""
    if isinstance(lin, Int8Linear):
        return lin.q, lin.scale
    # Platform.plan chooses this step only for weights it can read (no GGUF blocks)
    assert isinstance(lin, Linear), f"the compiled step cannot read a {type(lin).__name__}"
    plain = lin.plain_weight
    # Platform.plan chooses this step only for weights it can read
    assert plain is not None, "a packed weight with no plain copy"
    return plain, None


class CompiledDecodeStep:
    """A model's decode steps through torch.ops.tidewire.decode_step (chosen by
    Platform.plan: FastPath.COMPILED_STEP)."""

    max_rows = 8  # the compiled kernels' matmuls take 1-8 rows

    def __init__(self, model: DecoderModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.model = model
        self.norms = [n for layer in model.layers for n in (layer.input_norm, layer.post_norm)]
        self.norms.append(model.norm)
        matmuls = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.mlp.gate_up,
                                                         layer.mlp.down)] + [model.lm_head]
        pairs = [_weight(m) for m in matmuls]
        self.weights = [w for w, _ in pairs]
        self.scales = [s for _, s in pairs]
        self.biases = [m.bias for m in matmuls]
        # each layer's sliding window (0: full); empty where no layer has one
        self.windows = [layer.window for layer in model.layers] if model.arch.layer_windows \
            else []
        # each layer's q and k norms (Qwen3); empty where the family has none
        self.qk_norms = [n for layer in model.layers for n in (layer.q_norm, layer.k_norm)
                         if n is not None]
        # which layers rotate (SmolLM3's NoPE layers do not); empty: all
        self.rope_layers = [int(r) for r in model.arch.rope_layers]
        self.k_caches = [k for k, _ in kv_caches]
        self.v_caches = [v for _, v in kv_caches]
        self.steps = 0  # decode steps run here (tests check which path ran)

    def fits(self, num_tokens: int) -> bool:
        """Whether a step of this many query tokens runs here (its sequences may have
        several each: a decode verifying speculative proposals, a short chunk)."""
        return 0 < num_tokens <= self.max_rows

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: PagedMetadata) -> torch.Tensor:
        """Logits [n, vocab] (the model's dtype) of n query tokens: decodes (one token
        each) and short chunks (meta.query_start gives each sequence its rows)."""
        m, a = self.model, self.model.arch
        assert isinstance(m.embed, torch.Tensor)  # (no GGUF blocks: Platform.plan)
        x = F.embedding(input_ids, m.embed)  # becomes the residual stream (overwritten)
        logits = torch.empty((x.shape[0], m.lm_head.out_features), dtype=x.dtype)
        torch.ops.tidewire.decode_step(
            logits, x, positions, meta.slot_mapping, meta.block_table, meta.seq_lens,
            meta.query_start, m.cos, m.sin, self.k_caches, self.v_caches, self.norms,
            self.weights, self.scales, self.biases, a.rms_norm_eps, m.attn.scale, a.num_heads,
            self.windows, self.qk_norms, a.rotary_dim, self.rope_layers)
        self.steps += 1
        return logits

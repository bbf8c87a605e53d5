"""Decode steps of 1-8 query tokens as one compiled call (the cpu backend).

The CPU counterpart of engine/cuda_graphs.py. An eager decode step of a small model is
~300 torch calls from Python, each forking and joining the OpenMP team: at batch 1 that
overhead rivalled the time spent reading the weights. `torch.ops.tidewire.decode_step`
(kernels/cpu/decode_step.h) runs the whole stack, final norm and LM head included, in
one parallel region with barriers between phases, on the model's own weights (bf16,
int8, or GGUF blocks as the file stores them) and KV cache (nothing is copied or
captured: the "buckets" are every batch size from 1 to `max_rows`). A sequence may
bring several query tokens (a decode verifying speculative proposals, a short chunk): up
to 8 in all. Larger steps run eagerly: past a
few rows the oneDNN matmuls of the eager path are the faster ones.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.base import PagedMetadata
from engine.gguf_weights import PackedWeight, QuantWeight
from engine.models.decoder import DecoderModel
from engine.models.layers import GGUFLinear, Int8Linear, Linear


def _weight(lin: object) -> tuple[list[torch.Tensor], list[int], torch.Tensor | None]:
    """The parts of a matmul's weight the compiled step reads, their GGUF types (0: a
    plain or int8 weight) and the int8 scale (None: none)."""
    if isinstance(lin, Int8Linear):
        return [lin.q], [0], lin.scale
    if isinstance(lin, GGUFLinear):  # blocks as stored, a part per block type
        assert all(isinstance(p, QuantWeight | PackedWeight) for p in lin.parts)
        return [p.data for p in lin.parts], [p.qtype for p in lin.parts], None
    # Platform.plan chooses this step only for weights it can read
    assert isinstance(lin, Linear), f"the compiled step cannot read a {type(lin).__name__}"
    plain = lin.plain_weight
    assert plain is not None, "a packed weight with no plain copy"
    return [plain], [0], None


def _matmuls(model: DecoderModel) -> list[Any]:
    """The matmuls the step runs, in its order: each layer's q/k/v, o, gate/up and down,
    then the LM head."""
    return [m for layer in model.layers
            for m in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)] + [model.lm_head]


def _readable(lin: object) -> bool:
    if isinstance(lin, GGUFLinear):  # (reads blocks and packed tiles: only those)
        return all(isinstance(p, QuantWeight | PackedWeight) for p in lin.parts)
    return isinstance(lin, Int8Linear) or (isinstance(lin, Linear)
                                           and lin.plain_weight is not None)


class CompiledDecodeStep:
    """A model's decode steps through torch.ops.tidewire.decode_step (chosen by
    Platform.plan: FastPath.COMPILED_STEP)."""

    max_rows = 8  # the compiled kernels' matmuls take 1-8 rows

    @staticmethod
    def reads(model: DecoderModel) -> bool:
        """Whether every matmul's weight is one the step reads: Platform.plan decides by
        the quantization, but a GGUF file may keep a matrix in a type of its own (F16,
        Q5_0, ...), loaded as a plain part; such a model decodes eagerly."""
        return all(_readable(m) for m in _matmuls(model))

    def __init__(self, model: DecoderModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.model = model
        self.norms = [n for layer in model.layers for n in (layer.input_norm, layer.post_norm)]
        self.norms.append(model.norm)
        matmuls = _matmuls(model)
        read = [_weight(m) for m in matmuls]
        self.weights = [w for parts, _, _ in read for w in parts]
        self.scales = [s for _, _, s in read]
        # GGUF: each matmul's parts and their block types (empty: one plain part each)
        gguf = any(t for _, types, _ in read for t in types)
        self.part_counts = [len(parts) for parts, _, _ in read] if gguf else []
        self.qtypes = [t for _, types, _ in read for t in types] if gguf else []
        # GGUF parts take x in int8 as the eager path's would (GGUFLinear.int8_x)
        self.int8_x = any(isinstance(m, GGUFLinear) and m.int8_x for m in matmuls)
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
        # GGUF: past the rows where a type's small-batch kernel leads (GGUFLinear.small_limit),
        # the eager path's integer GEMM or tiled kernel is the faster one (decided here, with
        # the AMX state of the build; a speculative verification past it runs eagerly too)
        if gguf:
            self.max_rows = min([self.max_rows] + [m.small_limit(p) for m in matmuls
                                                   if isinstance(m, GGUFLinear)
                                                   for p in m.parts])

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
        # becomes the residual stream (overwritten); a GGUF table dequantizes its rows
        x = (F.embedding(input_ids, m.embed) if isinstance(m.embed, torch.Tensor)
             else m.embed(input_ids).contiguous())
        logits = torch.empty((x.shape[0], m.lm_head.out_features), dtype=x.dtype)
        torch.ops.tidewire.decode_step(
            logits, x, positions, meta.slot_mapping, meta.block_table, meta.seq_lens,
            meta.query_start, m.cos, m.sin, self.k_caches, self.v_caches, self.norms,
            self.weights, self.scales, self.biases, a.rms_norm_eps, m.attn.scale, a.num_heads,
            self.windows, self.qk_norms, a.rotary_dim, self.rope_layers, self.part_counts,
            self.qtypes, self.int8_x)
        self.steps += 1
        return logits

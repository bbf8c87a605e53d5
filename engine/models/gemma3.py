"""Gemma 3 text models (gemma-3-270m, gemma-3-1b; `gemma3_text`).

What departs from Llama: embeddings scaled by sqrt(hidden); RMSNorm weights applied as
(1 + w); four norms a layer (before and after attention, before and after the MLP);
per-head q/k norms; GeGLU (tanh-approximated GELU) in the MLP; the softmax scale
`query_pre_attn_scalar ** -0.5`; local layers with a sliding window and their own rotary
base (`rope_parameters["sliding_attention"]`) interleaved with global ones (the
`full_attention` rotary, with its scaling); tied embeddings; an optional final logit
soft-cap."""

from __future__ import annotations

from typing import Any

import torch

from engine.models.arch import ModelArch
from engine.models.decoder import DecoderModel


class Gemma3Model(DecoderModel):
    norm_offset = 1.0
    qk_norm = True
    sandwich_norms = True
    embed_scaled = True
    always_features = frozenset({"gemma"})

    @classmethod
    def read_arch(cls, hf: Any, fields: dict[str, Any]) -> ModelArch:
        fields["attn_scale"] = float(hf.query_pre_attn_scalar) ** -0.5
        return super().read_arch(hf, fields)

    def rope_tables(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        n = self.arch.max_position_embeddings
        return {"global": self.rope_spec("full_attention").tables(n),
                "local": self.rope_spec("sliding_attention").tables(n)}

    def layer_rope(self, i: int) -> str | None:
        return "local" if self.hf.layer_types[i] == "sliding_attention" else "global"

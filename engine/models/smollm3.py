"""SmolLM3: Llama where every `no_rope_layer_interval`-th layer (config `no_rope_layers`
holds 0 there) has no rotary at all (NoPE): its keys carry no position, the causal
mask alone orders them."""

from __future__ import annotations

from typing import Any

from engine.models.arch import ModelArch
from engine.models.decoder import DecoderModel


class SmolLM3Model(DecoderModel):
    @classmethod
    def read_arch(cls, hf: Any, fields: dict[str, Any]) -> ModelArch:
        layers = getattr(hf, "no_rope_layers", None)
        if layers is not None:
            fields["rope_layers"] = tuple(bool(x) for x in layers)
        return super().read_arch(hf, fields)

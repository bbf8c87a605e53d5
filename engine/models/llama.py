"""Llama and the families that are Llama with other defaults: Llama 2/3.x (llama3 and
the other rope scalings), SmolLM2, Mistral (a sliding window on every layer, where its
config sets one) and Qwen2/2.5 (q/k/v biases, windows on the layers past
`max_window_layers` where `use_sliding_window` is on)."""

from __future__ import annotations

from typing import Any

from engine.models.arch import ModelArch
from engine.models.decoder import DecoderModel


class LlamaModel(DecoderModel):
    """The plain decoder stack (model types llama, mistral, qwen2)."""

    @classmethod
    def read_arch(cls, hf: Any, fields: dict[str, Any]) -> ModelArch:
        if fields["model_type"] == "qwen2":
            fields["qkv_bias"] = True  # Qwen2's q/k/v always carry biases
        return super().read_arch(hf, fields)

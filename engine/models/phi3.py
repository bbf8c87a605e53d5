"""Phi-3, Phi-3.5-mini and Phi-4-mini: Llama with q/k/v and gate/up stored fused in the
checkpoint (kept fused: one matmul each, as Tidewire runs every family), partial rotary
(Phi-4-mini rotates 3/4 of each head) and longrope scaling."""

from __future__ import annotations

from typing import Any

from engine.models.decoder import DecoderModel


class Phi3Model(DecoderModel):
    fused_qkv = "qkv_proj.weight"
    fused_gate_up = "gate_up_proj.weight"

    @classmethod
    def check(cls, hf: Any) -> None:
        super().check(hf)
        if getattr(hf, "attention_bias", False):
            raise ValueError("Phi-3 with attention biases is not supported")

"""Qwen3 (dense): Llama with an RMSNorm over each head of q and of k before rotary."""

from __future__ import annotations

from engine.models.decoder import DecoderModel


class Qwen3Model(DecoderModel):
    qk_norm = True

"""ModelArch: what the engine needs to know of a model, read once from its HF config.

The engine's shared parts (the KV pool, the platform's plan, the attention backend,
the scheduler's context limit) read these fields and nothing family-specific; a family's
own switches (q/k norms, Gemma's norms, experts) are read by its model class from
`hf_config`, the transformers config object the fields came from. Configs are parsed by
transformers' own config classes, so their defaults and legacy spellings (`rope_scaling`
vs `rope_parameters`, a Mistral config without `sliding_window`, Gemma 3's pattern of
local layers) mean here what they mean to transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# A layer's attention: full causal, or a window of the last W keys (W > 0).
FULL = 0


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per layer: FULL (0) or the sliding window W (keys p - W < k <= p). Empty: all full.
    layer_windows: tuple[int, ...] = ()
    # Per layer: whether rotary applies (SmolLM3 leaves it out of every fourth layer).
    # Empty: every layer.
    rope_layers: tuple[bool, ...] = ()
    rotary_dim: int = 0  # the dims of a head that rotate (Phi-3's partial rotary); 0: all
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    # What departs from a plain Llama decoder (qk_norm, gemma, moe, ...): the platform
    # keeps the fused whole-model decode step to models with none (engine/platform.py).
    features: frozenset[str] = frozenset()
    # Mixture of experts: experts per layer (0: a dense model)
    num_experts: int = 0
    architecture: str = ""  # HF `architectures[0]`
    hf_config: Any = field(default=None, compare=False, repr=False, hash=False)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        """The arch of a config.json's contents (engine/models: the family's parser)."""
        from engine.models.build import arch_from_config

        return arch_from_config(cfg)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelArch:
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))

    @property
    def max_context(self) -> int:
        """The longest context this implementation serves exactly."""
        return self.max_position_embeddings

    @property
    def head_rotary_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else FULL

    def has_rope(self, layer: int) -> bool:
        return self.rope_layers[layer] if self.rope_layers else True

    @property
    def sliding_window(self) -> int | None:
        """The widest window of the windowed layers, or None when every layer is full."""
        return max(self.layer_windows, default=0) or None

    @property
    def windowed_everywhere(self) -> bool:
        """Whether every layer is windowed: then blocks behind every window are dead."""
        return bool(self.layer_windows) and all(self.layer_windows)

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype,
                           kv_cache_dtype: str = "auto") -> int:
        """`kv_cache_dtype` "int8": one byte a value plus an fp32 scale a row."""
        if kv_cache_dtype == "int8":
            return 2 * self.num_layers * block_size * self.num_kv_heads * (self.head_dim + 4)
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem

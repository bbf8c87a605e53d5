"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) on top of the paged KV cache.

Weights are plain tensors (no nn.Module per layer: fewer Python hops per step), with
q/k/v fused into one GEMM and gate/up into another. One `forward` runs a whole
flattened step: every request's new tokens back to back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend, AttentionMetadata
from kernels import reference as ref

SUPPORTED_ARCHS = {"llama", "mistral", "qwen2"}


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

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        mt = cfg.get("model_type", "llama")
        if mt not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported model_type {mt!r}; supported: {sorted(SUPPORTED_ARCHS)}")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=mt,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=mt == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelArch:
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class LlamaModel:
    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 attn: AttentionBackend) -> None:
        self.arch, self.dtype, self.attn = arch, dtype, attn
        w = {k: v.to(dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        lm_head = w.get("lm_head.weight")
        self.lm_head = self.embed if arch.tie_word_embeddings or lm_head is None else lm_head
        self.layers = [self._layer(w, i) for i in range(arch.num_layers)]
        self.cos, self.sin = ref.rope_cos_sin(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        bias = None
        if self.arch.qkv_bias:
            bias = torch.cat([w[a + f"{x}_proj.bias"] for x in "qkv"])
        return LayerWeights(
            input_norm=w[p + "input_layernorm.weight"],
            qkv=torch.cat([w[a + f"{x}_proj.weight"] for x in "qkv"]).contiguous(),
            qkv_bias=bias,
            o=w[a + "o_proj.weight"],
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate_up=torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]).contiguous(),
            down=w[m + "down_proj.weight"],
        )

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; returns fp32 logits [len(logits_rows), vocab]."""
        eps = self.arch.rms_norm_eps
        x = F.embedding(input_ids, self.embed)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h, residual = ref.rms_norm(x, layer.input_norm, eps, residual)
            h = self._attention(h, positions, layer, k_cache, v_cache, meta)
            h, residual = ref.rms_norm(h, layer.post_norm, eps, residual)
            x = F.linear(ref.silu_and_mul(F.linear(h, layer.gate_up)), layer.down)
        x, _ = ref.rms_norm(x[logits_rows], self.norm, eps, residual[logits_rows])
        return F.linear(x, self.lm_head).float()

    def _attention(self, h: torch.Tensor, positions: torch.Tensor, layer: LayerWeights,
                   k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        a = self.arch
        n = h.shape[0]
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = ref.rope(q.view(n, a.num_heads, a.head_dim), positions, self.cos, self.sin)
        k = ref.rope(k.view(n, a.num_kv_heads, a.head_dim), positions, self.cos, self.sin)
        self.attn.write_cache(k, v.view(n, a.num_kv_heads, a.head_dim), k_cache, v_cache, meta)
        o = self.attn.forward(q, k_cache, v_cache, meta)
        return F.linear(o.reshape(n, self.q_size), layer.o)

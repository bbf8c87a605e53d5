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

from engine.attention.base import AttentionBackend
from engine.layer_ops import make_ops
from engine.platform import ModelPlan
from engine.quant import dequantize_int8, linear_weight_names, quantized
from kernels import cpu_ops
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
    # Mistral's sliding window: attention is full-context here, which is exact only
    # while the context stays within the window, so the engine caps max_model_len to it.
    sliding_window: int | None = None

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
            sliding_window=(cfg.get("sliding_window")
                            if cfg.get("use_sliding_window", True) else None),
        )

    @property
    def max_context(self) -> int:
        """The longest context this implementation serves exactly."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelArch:
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype,
                           kv_cache_dtype: str = "auto") -> int:
        """`kv_cache_dtype` "int8": one byte a value plus an fp32 scale a row."""
        if kv_cache_dtype == "int8":
            return 2 * self.num_layers * block_size * self.num_kv_heads * (self.head_dim + 4)
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem


class Linear:
    """y = x W^T (+ b) with W [out, in].

    For bf16 on CPU the weight is pre-packed once into oneDNN's blocked layout: the
    same results bit for bit as F.linear, 1.1-2.7x faster at batch sizes past a few rows.
    At 1-4 rows the plain weight (kept too: 2 bytes a parameter more) goes through the
    compiled matrix-vector kernel instead. Other dtypes use F.linear, so fp32 runs stay
    op-for-op with HF transformers."""

    # Up to this many rows, bf16 weights stream through cpu_ops.linear_small (one pass
    # over W at memory speed; oneDNN reached ~70% of it at 1-4 rows here).
    small_rows = 4

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 keep_plain: bool = False) -> None:
        """`keep_plain`: keep the plain weight beside a packed one, for batches of up to
        `small_rows` rows (ModelPlan.keeps_plain; False where the caller never sends so
        few)."""
        self.weight, self.bias = weight.contiguous(), bias
        self.out_features, self.in_features = weight.shape
        self.plain: torch.Tensor | None = None  # kept for linear_small
        packed = _mkldnn_pack(self.weight) if weight.dtype == torch.bfloat16 else None
        if packed is not None:
            if keep_plain:
                self.plain = self.weight
            self.weight = packed  # the packed copy replaces the plain one
            self._op = _PACKED_LINEAR  # resolved once: torch.ops lookups cost µs per call
        else:
            self._op = None

    @property
    def plain_weight(self) -> torch.Tensor | None:
        """The weight as [out, in] rows (the compiled decode step reads it), if kept:
        the plain copy of a packed weight, or the weight itself where none was packed."""
        if self.plain is not None:
            return self.plain
        return self.weight if self._op is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None and _few_rows(x, self.small_rows):
            return cpu_ops.linear_small(x, self.plain, None, self.bias)
        if self._op is not None:
            return self._op(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _few_rows(x: torch.Tensor, limit: int) -> bool:
    """Whether x goes to the small-batch kernel (0 rows, e.g. the LM head of a prefill
    chunk that samples none, goes to the dense path, which takes them)."""
    return 0 < x.shape[0] <= limit


class Int8Linear:
    """Weight-only int8 (engine/quant.py). Up to `small_rows` rows stream the int8
    weights through cpu_ops.linear_small (half the bytes of bf16: decode is bound by
    reading them); bigger batches, where that kernel loses to a dense GEMM, use the
    dequantized weights in the activation dtype (the same values)."""

    small_rows = 4

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        self.q, self.scale, self.bias = q.contiguous(), scale.float().contiguous(), bias
        self.out_features, self.in_features = q.shape
        # (no plain copy: batches of up to small_rows rows never reach it)
        self.dense = Linear(dequantize_int8(q, scale).to(dtype), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if _few_rows(x, self.small_rows):
            return cpu_ops.linear_small(x, self.q, self.scale, self.bias)
        return self.dense(x)


_PACKED_LINEAR = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def _mkldnn_pack(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-packed weight, or None where this torch build cannot (then F.linear)."""
    if (w.device.type != "cpu" or _PACKED_LINEAR is None
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        probe = torch.ones(2, w.shape[1], dtype=w.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return None
    return packed if torch.equal(got, F.linear(probe, w)) else None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear | Int8Linear  # [(heads + 2 * kv_heads) * head_dim, hidden] (+ bias: Qwen2)
    o: Linear | Int8Linear  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear | Int8Linear  # [2 * intermediate, hidden]
    down: Linear | Int8Linear  # [hidden, intermediate]


class LlamaModel:
    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], plan: ModelPlan,
                 attn: AttentionBackend, quant_cache: Path | None = None) -> None:
        """`plan`: how this model runs here (engine/platform.py), its dtype, ops and
        quantization ("int8": weight-only, per output channel) among them; `quant_cache`:
        where the int8 weights are cached."""
        self.arch, self.plan, self.attn = arch, plan, attn
        self.dtype = dtype = plan.dtype
        tied = arch.tie_word_embeddings or "lm_head.weight" not in weights
        self._int8: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if plan.quantization == "int8":
            src = dict(weights)
            if tied:  # the LM head is a quantized copy of the (kept) embedding table
                src["lm_head.weight"] = weights["model.embed_tokens.weight"]
            self._int8 = quantized(src, linear_weight_names(src), quant_cache)
        w = {k: v.to(plan.device, dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        if tied:
            w["lm_head.weight"] = self.embed
        self.lm_head = self._linear(w, ["lm_head.weight"])
        self.layers = [self._layer(w, i) for i in range(arch.num_layers)]
        self._int8 = {}  # the Int8Linears hold what they need
        cos, sin = ref.rope_cos_sin(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)
        self.cos, self.sin = cos.to(plan.device), sin.to(plan.device)
        self.q_size = arch.num_heads * arch.head_dim
        self.ops = make_ops(plan.ops)

    def _linear(self, w: dict[str, torch.Tensor], names: list[str],
                bias: torch.Tensor | None = None) -> Linear | Int8Linear:
        """One matmul over the named weights stacked by rows (q/k/v, gate/up)."""
        if self._int8:
            parts = [self._int8[n] for n in names]
            if len(parts) == 1:
                return Int8Linear(*parts[0], bias, self.dtype)
            return Int8Linear(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]),
                              bias, self.dtype)
        weight = torch.cat([w[n] for n in names]) if len(names) > 1 else w[names[0]]
        return Linear(weight, bias, self.plan.keeps_plain(weight.shape[1]))

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        bias = None
        if self.arch.qkv_bias:
            bias = torch.cat([w[a + f"{x}_proj.bias"] for x in "qkv"])
        return LayerWeights(
            input_norm=w[p + "input_layernorm.weight"],
            qkv=self._linear(w, [a + f"{x}_proj.weight" for x in "qkv"], bias),
            o=self._linear(w, [a + "o_proj.weight"]),
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate_up=self._linear(w, [m + "gate_proj.weight", m + "up_proj.weight"]),
            down=self._linear(w, [m + "down_proj.weight"]),
        )

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: object,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; returns logits [len(logits_rows), vocab] in
        the model's dtype (the caller takes an argmax as they are, or upcasts to sample)."""
        eps = self.arch.rms_norm_eps
        x = F.embedding(input_ids, self.embed)
        ops = self.ops
        rot = ops.rope_setup(self.cos, self.sin, positions, self.dtype)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h, residual = ops.rms_norm(x, layer.input_norm, eps, residual)
            h = self._attention(h, rot, layer, k_cache, v_cache, meta)
            h, residual = ops.rms_norm(h, layer.post_norm, eps, residual)
            x = layer.down(ops.silu_and_mul(layer.gate_up(h)))
        assert residual is not None  # set by the first layer
        x, _ = ops.rms_norm(x[logits_rows], self.norm, eps, residual[logits_rows])
        return self.lm_head(x)

    def _attention(self, h: torch.Tensor, rot: tuple[torch.Tensor, ...],
                   layer: LayerWeights,
                   k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: object) -> torch.Tensor:
        q, k, v = self.ops.rope_store(layer.qkv(h), rot, self.arch, self.attn, k_cache,
                                      v_cache, meta)
        o = self.attn.forward(q, k, v, k_cache, v_cache, meta)
        return layer.o(o.reshape(h.shape[0], self.q_size))

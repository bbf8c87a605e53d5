"""DecoderModel: the decoder-only transformer every family is an instance of.

One `forward` runs a whole flattened step (every request's new tokens back to back) over
the paged KV cache. A family is a subclass that says how its checkpoint names its
weights and which of the switches below it turns on; the loop itself is written once:

    x = embed(ids) [* sqrt(hidden): Gemma]
    per layer:  h = attention(norm(x))      q/k norms (Qwen3, Gemma 3, OLMoE), rotary
                                            full, partial (Phi-3) or none (SmolLM3 NoPE),
                                            a sliding window per layer (Mistral, Gemma 3)
                [h = norm(h): Gemma's post-attention norm]
                x = mlp(norm(x + h))        gated SiLU or GeGLU, or experts (MoE)
                [x = norm(x): Gemma's post-MLP norm]
    logits = lm_head(norm(x)) [softcapped: Gemma]

Residual adds are fused into the norms (ops.rms_norm returns the sum as the new
residual). The platform's plan (engine/platform.py) says which ops, attention kernel and
fast decode path run it; the compiled whole-model decode step takes only families with
no `features` (a plain Llama stack), the rest decode on this eager path (CUDA graphs
capture it on a GPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.layer_ops import Rot, make_ops
from engine.models.arch import ModelArch
from engine.gguf_weights import QuantWeight
from engine.models.layers import (DenseMLP, GGUFEmbedding, GGUFLinear, Int8Linear, LayerWeights,
                                  Linear, activation_of)
from engine.models.rotary import RopeSpec
from engine.platform import ModelPlan
from engine.quant import linear_weight_names, quantized, quantized_int4
from kernels import reference as ref

EMBED = "model.embed_tokens.weight"


class DecoderModel:
    """The Llama stack and the switches other families turn on (class attributes)."""

    # (1 + w) RMSNorm weights (Gemma): stored with the 1 added, in fp32 before the cast
    norm_offset: ClassVar[float] = 0.0
    qk_norm: ClassVar[bool] = False  # per-head RMSNorm of q and k before rotary
    qk_norm_whole: ClassVar[bool] = False  # over all heads at once (OLMoE)
    sandwich_norms: ClassVar[bool] = False  # Gemma: norms on attention's and MLP's outputs
    embed_scaled: ClassVar[bool] = False  # Gemma: embeddings times sqrt(hidden)
    fused_qkv: ClassVar[str | None] = None  # a checkpoint name for q/k/v in one (Phi-3)
    fused_gate_up: ClassVar[str | None] = None  # likewise for gate/up
    # what departs from a plain Llama stack, whatever the config (ModelArch.features)
    always_features: ClassVar[frozenset[str]] = frozenset()

    # ---- reading the config -------------------------------------------------------

    @classmethod
    def read_arch(cls, hf: Any, fields: dict[str, Any]) -> ModelArch:
        """ModelArch of the transformers config `hf` (`fields`: what every family reads
        alike); subclasses adjust `fields` and call this. Refuses (ValueError) a config
        whose options this family does not run exactly."""
        cls.check(hf)
        features = set(cls.always_features)
        if fields.get("layer_windows"):
            features.add("sliding_window")
        if fields.get("rotary_dim"):
            features.add("partial_rotary")
        if fields.get("rope_layers") and not all(fields["rope_layers"]):
            features.add("nope")
        if cls.qk_norm:
            features.add("qk_norm")  # per head
        if cls.qk_norm_whole:
            features.add("qk_norm_whole")
        if activation_of(cls.activation_name(hf)) != "silu":
            features.add("gelu")
        return ModelArch(**fields, features=frozenset(features))

    @classmethod
    def check(cls, hf: Any) -> None:
        """ValueError for config options this family does not implement."""
        if getattr(hf, "attn_logit_softcapping", None):
            raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not "
                             "supported")
        if getattr(hf, "mlp_bias", False):
            raise ValueError("MLP biases (mlp_bias) are not supported")

    # ---- building -----------------------------------------------------------------

    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], plan: ModelPlan,
                 attn: AttentionBackend, quant_cache: Path | None = None) -> None:
        """`plan`: how this model runs here (engine/platform.py), its dtype, ops and
        quantization ("int8": weight-only, per output channel) among them; `quant_cache`:
        where the int8 weights are cached."""
        self.arch, self.plan, self.attn = arch, plan, attn
        self.dtype = dtype = plan.dtype
        self.hf = arch.hf_config
        tied = arch.tie_word_embeddings or "lm_head.weight" not in weights
        self._int8: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if plan.quantization == "int8":
            src = dict(weights)
            if tied:  # the LM head is a quantized copy of the (kept) embedding table
                src["lm_head.weight"] = weights[EMBED]
            self._int8 = quantized(src, linear_weight_names(src), quant_cache)
        self.ops = make_ops(plan.ops)
        self._source = weights  # the checkpoint's own dtype, for norm offsets
        # (a GGUF's block-quantized matrices stay as they are: QuantWeight)
        w: dict[str, Any] = {k: v if isinstance(v, QuantWeight) else v.to(plan.device, dtype)
                             for k, v in weights.items()}
        if plan.quantization == "int4":  # the linears as Q4_K/Q4_1 blocks (GGUFLinear)
            src = dict(weights)
            if tied:  # the LM head is a quantized copy of the (kept) embedding table
                src["lm_head.weight"] = weights[EMBED]
            for n, (qtype, blocks) in quantized_int4(src, linear_weight_names(src),
                                                     quant_cache).items():
                w[n] = QuantWeight(qtype, blocks, src[n].shape[1])
        self.embed: torch.Tensor | GGUFEmbedding = \
            GGUFEmbedding(w[EMBED], dtype) if isinstance(w[EMBED], QuantWeight) else w[EMBED]
        self.norm = self.norm_weight(w, "model.norm.weight")
        if tied and plan.quantization != "int4":  # (int4: its quantized copy, above)
            w["lm_head.weight"] = w[EMBED]
        self.lm_head = self.linear(w, ["lm_head.weight"])
        self.layers = [self.layer(w, i) for i in range(arch.num_layers)]
        self._int8 = {}  # the Int8Linears hold what they need
        self._source = {}
        self.ropes = {key: tuple(t.to(plan.device) for t in tables)
                      for key, tables in self.rope_tables().items()}
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.embed_multiplier = (torch.tensor(arch.hidden_size**0.5, dtype=dtype)
                                 if self.embed_scaled else None)
        self.final_softcap = getattr(self.hf, "final_logit_softcapping", None)
        # rotary tables of a model whose heads rotate in part are gathered in torch
        self.partial_rotary = bool(arch.rotary_dim)

    # global rotary tables of `self.ropes` (what the compiled decode step reads)
    @property
    def cos(self) -> torch.Tensor:
        return self.ropes["global"][0]

    @property
    def sin(self) -> torch.Tensor:
        return self.ropes["global"][1]

    def rope_tables(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin tables by the key layers name them by (LayerWeights.rope)."""
        return {"global": self.rope_spec().tables(self.arch.max_position_embeddings)}

    def rope_spec(self, layer_type: str | None = None) -> RopeSpec:
        """The rotary of `layer_type`'s layers, read from the HF config as transformers
        reads it (an arch built by hand, without one: from its own fields)."""
        a = self.arch
        if self.hf is None:
            return RopeSpec(a.head_rotary_dim, a.rope_theta, a.rope_scaling,
                            a.max_position_embeddings)
        return RopeSpec.from_hf_config(self.hf, layer_type)

    def norm_weight(self, w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """A norm's weight; with an offset (Gemma's 1 + w) kept in fp32, which the norms
        then multiply by before rounding to the activations' dtype, as HF does."""
        if not self.norm_offset:
            return w[name]
        return (self.norm_offset + self._source[name].float()).to(self.plan.device)

    def linear(self, w: dict[str, Any], names: list[str],
               bias: torch.Tensor | None = None) -> Linear | Int8Linear | GGUFLinear:
        """One matmul over the named weights stacked by rows (q/k/v, gate/up)."""
        if any(isinstance(w[n], QuantWeight) for n in names):
            # (a matrix the embedding also reads stays in its blocks where it is a copy:
            # packing would hold it twice; a view of the mapped file may go)
            shared = any(w[n] is w.get(EMBED) and not getattr(w[n], "mapped", False)
                         for n in names)
            return GGUFLinear([w[n] for n in names], bias, self.dtype,
                              self.plan.int8_activations, pack=not shared)
        if self._int8:
            parts = [self._int8[n] for n in names]
            if len(parts) == 1:
                return Int8Linear(*parts[0], bias, self.dtype)
            return Int8Linear(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]),
                              bias, self.dtype)
        weight = torch.cat([w[n] for n in names]) if len(names) > 1 else w[names[0]]
        return Linear(weight, bias, self.plan.keeps_plain(weight.shape[1]))

    @staticmethod
    def activation_name(hf: Any) -> str:
        """The HF name of the MLP's activation: `hidden_activation` first (Gemma's field,
        which transformers' Gemma reads alone), else `hidden_act`."""
        if hf is None:
            return "silu"
        return (getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
                or "silu")

    def activation(self) -> str:
        return activation_of(self.activation_name(self.hf))

    def mlp(self, w: dict[str, torch.Tensor], i: int) -> Any:
        """Layer i's MLP (a family with experts overrides this)."""
        m = f"model.layers.{i}.mlp."
        names = ([m + self.fused_gate_up] if self.fused_gate_up
                 else [m + "gate_proj.weight", m + "up_proj.weight"])
        return DenseMLP(self.linear(w, names), self.linear(w, [m + "down_proj.weight"]),
                        self.activation())

    def layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = None
        if self.arch.qkv_bias:
            bias = (w[a + self.fused_qkv.replace(".weight", ".bias")] if self.fused_qkv
                    else torch.cat([w[a + f"{x}_proj.bias"] for x in "qkv"]))
        qkv_names = ([a + self.fused_qkv] if self.fused_qkv
                     else [a + f"{x}_proj.weight" for x in "qkv"])
        qk = self.qk_norm or self.qk_norm_whole
        sandwich = self.sandwich_norms
        return LayerWeights(
            input_norm=self.norm_weight(w, p + "input_layernorm.weight"),
            qkv=self.linear(w, qkv_names, bias),
            o=self.linear(w, [a + "o_proj.weight"], w.get(a + "o_proj.bias")),
            post_norm=self.norm_weight(
                w, p + ("pre_feedforward_layernorm.weight" if sandwich
                        else "post_attention_layernorm.weight")),
            mlp=self.mlp(w, i),
            q_norm=self.norm_weight(w, a + "q_norm.weight") if qk else None,
            k_norm=self.norm_weight(w, a + "k_norm.weight") if qk else None,
            attn_out_norm=(self.norm_weight(w, p + "post_attention_layernorm.weight")
                           if sandwich else None),
            mlp_out_norm=(self.norm_weight(w, p + "post_feedforward_layernorm.weight")
                          if sandwich else None),
            window=self.arch.window(i),
            rope=self.layer_rope(i),
        )

    def layer_rope(self, i: int) -> str | None:
        """The rotary tables layer i uses (a key of rope_tables), None for none."""
        return "global" if self.arch.has_rope(i) else None

    # ---- running ------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: object,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; returns logits [len(logits_rows), vocab] in
        the model's dtype (the caller takes an argmax as they are, or upcasts to sample)."""
        eps = self.arch.rms_norm_eps
        ops = self.ops
        x = (F.embedding(input_ids, self.embed) if isinstance(self.embed, torch.Tensor)
             else self.embed(input_ids))
        if self.embed_multiplier is not None:
            x = x * self.embed_multiplier
        rots: dict[str, Rot]
        if self.partial_rotary:  # rotated in torch, on a slice of each head
            rots = {k: ref.rope_gather(c, s, positions, self.dtype)
                    for k, (c, s) in self.ropes.items()}
        else:
            rots = {k: ops.rope_setup(c, s, positions, self.dtype)
                    for k, (c, s) in self.ropes.items()}
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h, residual = ops.rms_norm(x, layer.input_norm, eps, residual)
            h = self._attention(h, rots, layer, k_cache, v_cache, meta)
            if layer.attn_out_norm is not None:
                h, _ = ops.rms_norm(h, layer.attn_out_norm, eps)
            h, residual = ops.rms_norm(h, layer.post_norm, eps, residual)
            x = layer.mlp(h, ops.silu_and_mul)
            if layer.mlp_out_norm is not None:
                x, _ = ops.rms_norm(x, layer.mlp_out_norm, eps)
        assert residual is not None  # set by the first layer
        x, _ = ops.rms_norm(x[logits_rows], self.norm, eps, residual[logits_rows])
        logits = self.lm_head(x)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _attention(self, h: torch.Tensor, rots: dict[str, Rot],
                   layer: LayerWeights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: object) -> torch.Tensor:
        qkv = layer.qkv(h)
        if layer.q_norm is not None:
            self._norm_qk(qkv, layer)
        ops, arch, attn = self.ops, self.arch, self.attn
        if layer.rope is None:
            q, k, v = ops.store(qkv, arch, attn, k_cache, v_cache, meta)
        elif self.partial_rotary:
            q, k, v = ops.rope_store_partial(qkv, rots[layer.rope], arch, attn, k_cache,
                                             v_cache, meta)
        else:
            q, k, v = ops.rope_store(qkv, rots[layer.rope], arch, attn, k_cache, v_cache, meta)
        kw = {"window": layer.window} if layer.window else {}
        o = attn.forward(q, k, v, k_cache, v_cache, meta, **kw)
        return layer.o(o.reshape(h.shape[0], self.q_size))

    def _norm_qk(self, qkv: torch.Tensor, layer: LayerWeights) -> None:
        """q and k of `qkv` RMS-normed in place, per head or (OLMoE) over all heads."""
        assert layer.q_norm is not None and layer.k_norm is not None
        n, d, eps = qkv.shape[0], self.arch.head_dim, self.arch.rms_norm_eps
        qs, ks = self.q_size, self.kv_size
        width = (qs, ks) if self.qk_norm_whole else (d, d)
        for lo, size, w, rows in ((0, qs, layer.q_norm, width[0]),
                                  (qs, ks, layer.k_norm, width[1])):
            part = qkv[:, lo : lo + size].contiguous().view(-1, rows)
            qkv[:, lo : lo + size] = self.ops.rms_norm(part, w, eps)[0].view(n, size)

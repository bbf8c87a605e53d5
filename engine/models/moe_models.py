"""The mixture-of-experts families: Qwen3-MoE (q/k norms per head; experts on the layers
`decoder_sparse_step` and `mlp_only_layers` pick, dense MLPs elsewhere), Mixtral
(Mistral's attention, experts named w1/w3/w2 under `block_sparse_moe`) and OLMoE (q/k
norms over all heads at once). The expert block itself is engine/models/moe.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.gguf_weights import QuantWeight
from engine.models.arch import ModelArch
from engine.models.decoder import DecoderModel
from engine.models.layers import GGUFLinear
from engine.models.moe import MoE, MoEConfig


@dataclass
class ExpertMLP:
    """A layer's MoE block in the shape DecoderModel calls an MLP (LayerWeights.mlp)."""

    moe: MoE

    def __call__(self, h: torch.Tensor, silu_and_mul: Any) -> torch.Tensor:
        return self.moe(h)


class _MoEModel(DecoderModel):
    always_features = frozenset({"moe"})
    block: ClassVar[str] = "mlp"  # the checkpoint's name of a layer's expert block
    expert_weights: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")

    @classmethod
    def read_arch(cls, hf: Any, fields: dict[str, Any]) -> ModelArch:
        fields["num_experts"] = MoEConfig.from_hf_config(hf.to_dict()).num_experts
        return super().read_arch(hf, fields)

    def sparse(self, i: int) -> bool:
        """Whether layer i runs experts (else a dense MLP)."""
        return True

    def mlp(self, w: dict[str, torch.Tensor], i: int) -> Any:
        if not self.sparse(i):
            return super().mlp(w, i)
        cfg = MoEConfig.from_hf_config(self.hf.to_dict())
        p = f"model.layers.{i}.{self.block}."
        g, u, d = self.expert_weights
        experts = [(w[f"{p}experts.{e}.{g}.weight"], w[f"{p}experts.{e}.{u}.weight"],
                    w[f"{p}experts.{e}.{d}.weight"]) for e in range(cfg.num_experts)]
        for e in range(cfg.num_experts):  # stacked by from_experts: free the per-expert copies
            for name in (g, u, d):
                w.pop(f"{p}experts.{e}.{name}.weight")
        if isinstance(experts[0][0], QuantWeight):  # a GGUF's blocks as they are
            return ExpertMLP(MoE.from_linears(
                cfg, w[p + "gate.weight"],
                [GGUFLinear([gt, up], None, self.dtype, self.plan.int8_activations)
                 for gt, up, _ in experts],
                [GGUFLinear([dn], None, self.dtype, self.plan.int8_activations)
                 for _, _, dn in experts], silu_and_mul=self.ops.silu_and_mul))
        return ExpertMLP(MoE.from_experts(
            cfg, w[p + "gate.weight"], experts,
            keep_plain=(self.plan.keeps_plain(cfg.hidden_size)
                        and self.plan.keeps_plain(cfg.intermediate_size)),
            silu_and_mul=self.ops.silu_and_mul))


class Qwen3MoeModel(_MoEModel):
    qk_norm = True

    def sparse(self, i: int) -> bool:
        hf = self.hf
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        return i not in (getattr(hf, "mlp_only_layers", None) or []) and (i + 1) % step == 0


class MixtralModel(_MoEModel):
    block = "block_sparse_moe"
    expert_weights = ("w1", "w3", "w2")


class OlmoeModel(_MoEModel):
    qk_norm_whole = True

    @classmethod
    def check(cls, hf: Any) -> None:
        super().check(hf)
        if getattr(hf, "clip_qkv", None):
            raise ValueError("OLMoE with clip_qkv is not supported")

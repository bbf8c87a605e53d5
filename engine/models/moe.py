"""The mixture-of-experts feed-forward block of Qwen3-MoE, Mixtral and OLMoE: a router
scores E SwiGLU experts per token, the top k run, and their outputs, each scaled by its
routing weight, are summed.

Layouts (T tokens, E experts, H hidden, I an expert's intermediate size):
  x [T, H] (the step's flat batch) -> [T, H]; router weight [E, H]
  gate_up [E, 2I, H]: expert e's gate_proj (w1) rows, then its up_proj (w3) rows
  down    [E, H, I]: down_proj (w2)
(HF transformers 5 fuses the experts into these 3-D parameters; checkpoints keep one
tensor per expert, which `MoE.from_experts` stacks.)

Two executions of the experts, one contract:
  torch (CPU): the (token, slot) pairs sorted by expert, one GEMM per expert that got
    rows through engine.models.layers.Linear (one copy of each weight, unpacked: a few
    rows stream it through the matrix-vector kernel, more take F.linear), so a decode
    step reads only its k experts' weights. Op for op HF's loop (its roundings, its
    order of accumulation): equal bit for bit in fp32 and bf16.
  triton (CUDA): kernels/fused_moe.py, host-sync free for CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.models.layers import Linear
from kernels import reference as ref

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class MoEConfig:
    """What the block needs of a model's config. `renormalize`: the top-k weights are
    rescaled to sum to 1 (`norm_topk_prob`; Mixtral always). `fp32_weights`: the routing
    weights stay fp32 and scale the expert outputs in fp32 (HF's Mixtral); otherwise
    they are cast to the activation dtype first (Qwen3-MoE, OLMoE)."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    renormalize: bool
    fp32_weights: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..num_experts "
                             f"({self.num_experts})")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> MoEConfig:
        """From a config.json of model_type qwen3_moe, mixtral or olmoe."""
        mt = cfg.get("model_type")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported expert activation {cfg['hidden_act']!r}")
        # the hub's files say num_experts (Qwen3-MoE, OLMoE) or num_local_experts
        # (Mixtral); transformers 5's to_dict() may write the other name
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        common = dict(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                      hidden_size=cfg["hidden_size"])
        if mt == "mixtral":
            return cls(renormalize=True, intermediate_size=cfg["intermediate_size"],
                       fp32_weights=True, **common)
        if mt in ("qwen3_moe", "olmoe"):
            inter = cfg["moe_intermediate_size" if mt == "qwen3_moe" else "intermediate_size"]
            return cls(intermediate_size=inter,
                       renormalize=bool(cfg.get("norm_topk_prob", False)), **common)
        raise ValueError(f"no mixture-of-experts block for model_type {mt!r}")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          fp32_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k] int64, best first) of router_logits [T, E]:
    softmax over all experts in fp32, top k, renormalized to sum to 1 if asked, then in
    the logits' dtype unless `fp32_weights`. HF's routers, cast for cast. (Mixtral's
    original softmax over the top-k logits is the renormalized form up to rounding.)"""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if fp32_weights else weights.to(router_logits.dtype)), ids


class MoE:
    """The block: `moe(x [T, H]) -> [T, H]` (layouts in the module doc)."""

    def __init__(self, cfg: MoEConfig, router: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, backend: str = "auto", keep_plain: bool = False,
                 silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = ref.silu_and_mul
                 ) -> None:
        """`backend`: "torch" (grouped per-expert GEMMs), "triton" (kernels/fused_moe),
        "auto": triton where the weights are on CUDA. `keep_plain`: Linear's (bf16
        experts go through the few-row kernel where their widths allow; never packed).
        `silu_and_mul`: the platform's (LayerOps.silu_and_mul), for the torch backend."""
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        if (router.shape != (e, h) or gate_up.shape != (e, 2 * i, h)
                or down.shape != (e, h, i)):
            raise ValueError(f"router {tuple(router.shape)}, gate_up {tuple(gate_up.shape)}, "
                             f"down {tuple(down.shape)}: want [{e}, {h}], [{e}, {2 * i}, {h}],"
                             f" [{e}, {h}, {i}]")
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: one of {BACKENDS}")
        if backend == "auto":
            backend = "triton" if gate_up.is_cuda else "torch"
        self.cfg, self.backend, self.silu_and_mul = cfg, backend, silu_and_mul
        self.router = Linear(router, keep_plain=keep_plain)
        if backend == "triton":  # the stacked weights, as the kernel reads them
            self.gate_up, self.down = gate_up.contiguous(), down.contiguous()
        else:  # per-expert views of the stacks
            gate_up, down = gate_up.contiguous(), down.contiguous()
            # one copy each (no oneDNN-packed twin: the experts are most of the model's
            # bytes); a few rows stream it through linear_small, more take F.linear
            self.expert_gate_up = [Linear(gate_up[x], keep_plain=keep_plain, pack=False)
                                   for x in range(e)]
            self.expert_down = [Linear(down[x], keep_plain=keep_plain, pack=False)
                                for x in range(e)]

    @classmethod
    def from_experts(cls, cfg: MoEConfig, router: torch.Tensor,
                     experts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                     **kwargs: Any) -> MoE:
        """From the checkpoint's per-expert (gate [I, H], up [I, H], down [H, I]) tensors
        (gate_proj/up_proj/down_proj, Mixtral's w1/w3/w2), in expert order."""
        gate_up = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
        down = torch.stack([d for _, _, d in experts])
        return cls(cfg, router, gate_up, down, **kwargs)

    @classmethod
    def from_linears(cls, cfg: MoEConfig, router: torch.Tensor, gate_up: Sequence[Any],
                     down: Sequence[Any],
                     silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = ref.silu_and_mul
                     ) -> MoE:
        """The torch backend over matmuls given per expert, in expert order: gate_up[e]
        [2I, H] (gate rows, then up), down[e] [H, I], e.g. GGUFLinears reading a GGUF's
        expert blocks as the file stores them (no stacked copy is made)."""
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        shapes = {(g.out_features, g.in_features, d.out_features, d.in_features)
                  for g, d in zip(gate_up, down)}
        if len(gate_up) != e or len(down) != e or shapes != {(2 * i, h, h, i)}:
            raise ValueError(f"{len(gate_up)}/{len(down)} experts of shapes {sorted(shapes)}: "
                             f"want {e} of gate_up [{2 * i}, {h}] and down [{h}, {i}]")
        moe = cls.__new__(cls)
        moe.cfg, moe.backend, moe.silu_and_mul = cfg, "torch", silu_and_mul
        moe.router = Linear(router)
        moe.expert_gate_up, moe.expert_down = list(gate_up), list(down)
        return moe

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.backend == "triton":
            from kernels.fused_moe import fused_moe  # imports Triton: only when chosen

            return fused_moe(x, self.gate_up, self.down, weights, ids)
        return self.grouped(x, weights, ids)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of x [T, H] (see `route`)."""
        c = self.cfg
        return route(self.router(x), c.top_k, c.renormalize, c.fp32_weights)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
        """The torch backend: the pairs sorted by expert, one GEMM per expert that got
        rows, each row scaled by its weight and added to its token's output in ascending
        expert order (HF's order: fp32 results bit-comparable)."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        tokens = order // k
        counts = torch.bincount(flat, minlength=self.cfg.num_experts).tolist()
        xs = x[tokens]
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                h = self.silu_and_mul(self.expert_gate_up[e](xs[rows]))
                ys[rows] = self.expert_down[e](h)
                start += n
        ys = (ys * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, ys)

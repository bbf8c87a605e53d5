"""A layer's elementwise ops (RMSNorm, RoPE and the KV cache write, SiLU-mul) in the
implementations the platform chooses among (engine/platform.py OpsKind): torch code
(kernels/reference.py), the fused Triton kernels, the compiled CPU kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine.attention.base import AttentionBackend
from engine.platform import OpsKind
from kernels import cpu_ops
from kernels import reference as ref

if TYPE_CHECKING:
    from engine.models.arch import ModelArch

Rot = tuple[torch.Tensor, ...]  # what rope_setup returns: each layer's rope reads it


class LayerOps:
    """The interface, and the rope + cache write the torch and Triton ops share."""

    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]

    def rope_setup(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   dtype: torch.dtype) -> Rot:
        """Once per step, for all layers: what `rope` needs of the step's positions."""
        raise NotImplementedError

    def rope(self, qk: torch.Tensor, num_heads: int, rot: Rot) -> torch.Tensor:
        """q and k [n, heads + kv_heads, head_dim] rotated (maybe in place)."""
        raise NotImplementedError

    def rope_store(self, qkv: torch.Tensor, rot: Rot, arch: ModelArch,
                   attn: AttentionBackend, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [n, heads or kv_heads, head_dim] of qkv [n, (heads + 2 * kv_heads) *
        head_dim], q and k rotated, k and v stored in the cache."""
        n, d = qkv.shape[0], arch.head_dim
        q_size, kv_size = arch.num_heads * d, arch.num_kv_heads * d
        # q and k rotate together: one rope over their [n, heads + kv_heads, d] view.
        qk = self.rope(qkv[:, : q_size + kv_size].view(n, -1, d), arch.num_heads, rot)
        q, k = qk.split([arch.num_heads, arch.num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size :].view(n, arch.num_kv_heads, d)
        attn.write_cache(k, v, k_cache, v_cache, meta)
        return q, k, v

    @staticmethod
    def store(qkv: torch.Tensor, arch: ModelArch, attn: AttentionBackend,
              k_cache: torch.Tensor, v_cache: torch.Tensor, meta: object
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rope_store for a layer without rotary (SmolLM3's NoPE layers): q, k, v views
        of qkv, k and v stored in the cache."""
        n, d = qkv.shape[0], arch.head_dim
        q, k, v = qkv.view(n, -1, d).split(
            [arch.num_heads, arch.num_kv_heads, arch.num_kv_heads], dim=1)
        attn.write_cache(k, v, k_cache, v_cache, meta)
        return q, k, v

    @classmethod
    def rope_store_partial(cls, qkv: torch.Tensor, rot: Rot, arch: ModelArch,
                           attn: AttentionBackend, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, meta: object
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rope_store where only the first arch.rotary_dim dims of each head rotate
        (Phi-3's partial rotary), with `rot` from reference.rope_gather over tables of
        that width: rotated in torch, in place, whatever the platform's ops."""
        n, d, r = qkv.shape[0], arch.head_dim, arch.head_rotary_dim
        qk = qkv[:, : (arch.num_heads + arch.num_kv_heads) * d].view(n, -1, d)
        qk[..., :r] = ref.rope(qk[..., :r], *rot)
        return cls.store(qkv, arch, attn, k_cache, v_cache, meta)


class TorchOps(LayerOps):
    """The ops as torch code (kernels/reference.py)."""

    rms_norm = staticmethod(ref.rms_norm)
    silu_and_mul = staticmethod(ref.silu_and_mul)

    def rope_setup(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   dtype: torch.dtype) -> Rot:
        return ref.rope_gather(cos, sin, positions, dtype)

    def rope(self, qk: torch.Tensor, num_heads: int, rot: Rot) -> torch.Tensor:
        return ref.rope(qk, *rot)


class TritonOps(LayerOps):
    """The ops as the fused Triton kernels (kernels/fused_norm_rope_act.py)."""

    def __init__(self) -> None:
        from kernels import fused_norm_rope_act as fused  # imports Triton: only when chosen

        self.rms_norm = fused.rms_norm
        self.silu_and_mul = fused.silu_and_mul
        self._rope = fused.rope

    def rope_setup(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   dtype: torch.dtype) -> Rot:
        return positions, cos, sin

    def rope(self, qk: torch.Tensor, num_heads: int, rot: Rot) -> torch.Tensor:
        self._rope(qk[:, :num_heads], qk[:, num_heads:], *rot)  # in place
        return qk


class CompiledOps(LayerOps):
    """The ops as the compiled CPU kernels (kernels/cpu_ops.py); rope also stores k and
    v in the cache in the same pass, so the backend's write_cache is skipped."""

    rms_norm = staticmethod(cpu_ops.rms_norm)
    silu_and_mul = staticmethod(cpu_ops.silu_and_mul)

    def rope_setup(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   dtype: torch.dtype) -> Rot:
        return positions, cos, sin

    def rope_store(self, qkv: torch.Tensor, rot: Rot, arch: ModelArch,
                   attn: AttentionBackend, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q as rope_store's, and q again for k and v: the cpu backend's compiled
        attention reads them from the cache."""
        positions, cos, sin = rot
        cpu_ops.rope_cache(qkv, positions, cos, sin, k_cache, v_cache, meta.slot_mapping,
                           arch.num_heads)
        n = qkv.shape[0]
        q = qkv[:, : arch.num_heads * arch.head_dim].view(n, arch.num_heads, arch.head_dim)
        return q, q, q


def make_ops(kind: OpsKind) -> LayerOps:
    """The ops the platform chose (ModelPlan.ops)."""
    if kind is OpsKind.TRITON:
        return TritonOps()
    return CompiledOps() if kind is OpsKind.COMPILED else TorchOps()

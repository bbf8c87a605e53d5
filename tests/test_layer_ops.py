"""engine/layer_ops.py: the layer ops the platform chooses among agree with each other."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import PagedMetadata
from engine.attention.cpu import CpuAttention
from engine.layer_ops import CompiledOps, TorchOps, make_ops
from engine.models.arch import ModelArch
from engine.platform import OpsKind
from kernels import cpu_ops
from kernels import reference as ref

ARCH = ModelArch(model_type="llama", vocab_size=320, hidden_size=128, intermediate_size=256,
                 num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                 rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
                 qkv_bias=False)


def test_make_ops_builds_the_kind_asked_for() -> None:
    assert type(make_ops(OpsKind.TORCH)) is TorchOps
    assert type(make_ops(OpsKind.COMPILED)) is CompiledOps


def test_compiled_rope_store_equals_the_torch_ops() -> None:
    """Rotated q, and k and v at their slots of the cpu backend's cache: the same from
    the compiled kernel's one pass as from torch's rope and the backend's write_cache."""
    if not cpu_ops.available():
        pytest.skip("no C++ compiler: the compiled CPU kernels are unavailable")
    a = ARCH
    torch.manual_seed(0)
    positions = torch.tensor([3, 7, 8, 20, 0])
    slots = torch.tensor([3, 7, 8, 20, 33])  # blocks 0, 0, 0, 1, 2 of 16 slots
    meta = PagedMetadata(slots, torch.zeros((5, 1), dtype=torch.int32),
                         torch.ones(5, dtype=torch.int32), torch.arange(6, dtype=torch.int32))
    qkv = torch.randn(5, (a.num_heads + 2 * a.num_kv_heads) * a.head_dim)
    cos, sin = ref.rope_cos_sin(a.head_dim, a.max_position_embeddings, a.rope_theta)
    attn = CpuAttention(a.num_heads, a.num_kv_heads, a.head_dim, 16, torch.float32,
                        compiled=True)
    got = {}
    for ops in (TorchOps(), CompiledOps()):
        kc, vc = torch.zeros(attn.cache_shape(4)), torch.zeros(attn.cache_shape(4))
        rot = ops.rope_setup(cos, sin, positions, torch.float32)
        q, _, _ = ops.rope_store(qkv.clone(), rot, a, attn, kc, vc, meta)
        got[type(ops).__name__] = (q.clone(), kc, vc)
    for want, have in zip(got["TorchOps"], got["CompiledOps"]):
        torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)
    assert got["TorchOps"][1].abs().sum() > 0  # the keys were written

"""engine/models/moe.py and kernels/fused_moe.py against HF transformers' own sparse-MoE
blocks (Qwen3-MoE, Mixtral, OLMoE) built from tiny random configs: the routing exactly,
the block's output in fp32, the Triton kernels (under TRITON_INTERPRET=1 without a GPU)
against the torch path, bf16 against fp32."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import MixtralConfig, OlmoeConfig, PretrainedConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from engine.models.moe import MoE, MoEConfig, route
from kernels import cpu_ops
from kernels.fused_moe import (ALIGN_KERNEL_MAX_PAIRS, align_by_expert,
                               align_by_expert_torch, fused_moe)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA GPU")

# (family, norm_topk_prob): Mixtral always renormalizes (its config has no such field)
CASES = [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True), ("olmoe", False),
         ("olmoe", True)]
# interpreter-sized tiles: BLOCK_M 16 (tl.dot's least), the hidden size in two columns
BLOCKS = (16, 32, 32)


def hf_block(family: str, norm: bool, experts: int = 8, top_k: int = 2, hidden: int = 64,
             inter: int = 32, seed: int = 0) -> tuple[Any, MoEConfig]:
    """HF's block with random weights (its router starts at zeros: every expert tied)
    and our config read from the same config's dict."""
    common: dict[str, Any] = dict(hidden_size=hidden, num_experts_per_tok=top_k)
    cfg: PretrainedConfig
    block: Any  # the families' block classes share no base with these attributes
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(moe_intermediate_size=inter, num_experts=experts,
                             norm_topk_prob=norm, **common)
        block = Qwen3MoeSparseMoeBlock(cfg)
    elif family == "mixtral":
        cfg = MixtralConfig(intermediate_size=inter, num_local_experts=experts, **common)
        block = MixtralSparseMoeBlock(cfg)
    else:
        cfg = OlmoeConfig(intermediate_size=inter, num_experts=experts, norm_topk_prob=norm,
                          **common)
        block = OlmoeSparseMoeBlock(cfg)
    cfg._experts_implementation = "eager"  # HF's per-expert loop (a standalone block has none)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.1)
    return block.eval(), MoEConfig.from_hf_config(cfg.to_dict())


def ours(block: Any, cfg: MoEConfig, dtype: torch.dtype = torch.float32,
         **kwargs: Any) -> MoE:
    """Our block over the HF block's weights (its fused 3-D expert parameters)."""
    gate, experts = block.gate, block.experts
    return MoE(cfg, gate.weight.detach().to(dtype), experts.gate_up_proj.detach().to(dtype),
               experts.down_proj.detach().to(dtype), **kwargs)


def tokens(n: int, hidden: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,norm", CASES)
def test_config_from_hf(family: str, norm: bool) -> None:
    _, cfg = hf_block(family, norm)
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size) == (8, 2, 64, 32)
    assert cfg.renormalize is (norm or family == "mixtral")
    assert cfg.fp32_weights is (family == "mixtral")


def test_config_refuses_other_families() -> None:
    with pytest.raises(ValueError, match="model_type 'llama'"):
        MoEConfig.from_hf_config({"model_type": "llama", "num_experts_per_tok": 2,
                                  "hidden_size": 8})
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(num_experts=4, top_k=5, hidden_size=8, intermediate_size=8, renormalize=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,norm", CASES)
def test_routing_equals_hf(family: str, norm: bool, dtype: torch.dtype) -> None:
    block, cfg = hf_block(family, norm)
    block.to(dtype)
    x = tokens(64).to(dtype)
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        weights, ids = ours(block, cfg, dtype).route(x)
    assert torch.equal(ids, hf_ids)
    assert weights.dtype == hf_weights.dtype  # Mixtral's stay fp32; the others cast
    assert torch.equal(weights, hf_weights)


def test_mixtral_topk_then_softmax_is_the_renormalized_form() -> None:
    """Mixtral's original routing (softmax over the top-k logits) picks the same experts
    as softmax-top-k-renormalize, with the same weights up to rounding."""
    logits = torch.randn(256, 8, generator=torch.Generator().manual_seed(3))
    top, top_ids = logits.topk(2, dim=-1)
    weights, ids = route(logits, 2, renormalize=True, fp32_weights=True)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(weights, torch.softmax(top, dim=-1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n", [0, 1, 3, 64])
@pytest.mark.parametrize("family,norm", CASES)
def test_block_equals_hf_fp32(family: str, norm: bool, n: int) -> None:
    block, cfg = hf_block(family, norm)
    x = tokens(n)
    with torch.no_grad():
        want = block(x[None])[0]
        got = ours(block, cfg, backend="torch")(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_equal_to_hf(dtype: torch.dtype) -> None:
    """The same GEMMs over the same rows, the same roundings, the same order of
    accumulation as HF's loop: equal bit for bit (bf16 through oneDNN-packed weights,
    which engine.models.layers.Linear only uses where they match F.linear)."""
    block, cfg = hf_block("qwen3_moe", True)
    x = tokens(64).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(block, cfg, dtype)(x), block.to(dtype)(x[None])[0])


def test_more_experts_than_tokens_touch() -> None:
    """E=64, k=8 at one token: only the 8 routed experts run (the rest get no rows)."""
    block, cfg = hf_block("olmoe", False, experts=64, top_k=8)
    x = tokens(1)
    with torch.no_grad():
        torch.testing.assert_close(ours(block, cfg)(x), block(x[None])[0], atol=1e-5,
                                   rtol=1e-5)


def test_from_experts_stacks_per_expert_tensors() -> None:
    """The checkpoint's per-expert gate/up/down (w1/w3/w2) make the same block."""
    block, cfg = hf_block("mixtral", True)
    gu, dn = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    i = cfg.intermediate_size
    per_expert = [(gu[e, :i], gu[e, i:], dn[e]) for e in range(cfg.num_experts)]
    moe = MoE.from_experts(cfg, block.gate.weight.detach(), per_expert)
    x = tokens(5)
    with torch.no_grad():
        assert torch.equal(moe(x), ours(block, cfg)(x))


def test_from_linears_runs_given_matmuls_per_expert() -> None:
    """Matmuls given per expert (how a GGUF's expert blocks run) make the same block as
    the stacked tensors; a wrong count or shape is refused."""
    from engine.models.layers import Linear

    block, cfg = hf_block("qwen3_moe", True)
    gu, dn = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    e = cfg.num_experts
    moe = MoE.from_linears(cfg, block.gate.weight.detach(),
                           [Linear(gu[x], pack=False) for x in range(e)],
                           [Linear(dn[x], pack=False) for x in range(e)])
    x = tokens(7)
    with torch.no_grad():
        assert torch.equal(moe(x), ours(block, cfg)(x))
    with pytest.raises(ValueError, match="experts"):
        MoE.from_linears(cfg, block.gate.weight.detach(),
                         [Linear(gu[x], pack=False) for x in range(e - 1)],
                         [Linear(dn[x], pack=False) for x in range(e - 1)])
    with pytest.raises(ValueError, match="want"):
        MoE.from_linears(cfg, block.gate.weight.detach(),
                         [Linear(dn[x], pack=False) for x in range(e)],
                         [Linear(gu[x], pack=False) for x in range(e)])


def test_shapes_are_checked() -> None:
    block, cfg = hf_block("qwen3_moe", True)
    with pytest.raises(ValueError, match="gate_up"):
        MoE(cfg, torch.zeros(8, 64), torch.zeros(8, 32, 64), torch.zeros(8, 64, 32))
    with pytest.raises(ValueError, match="backend"):
        ours(block, cfg, backend="cuda")


@pytest.mark.parametrize("align", [align_by_expert, align_by_expert_torch])
def test_align_by_expert_layout(align: Callable[..., tuple[torch.Tensor, ...]]) -> None:
    """Pairs (token * k + slot) grouped by expert, each run padded with N to BLOCK_M, the
    buffer sized for the worst case, and the expert of every block."""
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEV)
    sorted_pairs, block_expert, num_rows = align(ids, num_experts=4, block_m=4)
    n = 6  # the padding sentinel
    assert num_rows.tolist() == [12]
    assert sorted_pairs[:12].tolist() == [1, 4, n, n, 3, n, n, n, 0, 2, 5, n]
    # 6 + min(4, 6) * 3 rows at most: 5 blocks; those past num_rows are never run
    assert sorted_pairs.shape == (20,) and block_expert.shape == (5,)
    assert block_expert[:3].tolist() == [0, 1, 2]


@pytest.mark.parametrize("tokens_,top_k,experts,block_m", [
    (1, 8, 128, 16), (5, 8, 128, 16), (40, 2, 6, 32), (300, 2, 8, 16), (512, 2, 64, 64)])
def test_align_kernel_equals_torch(tokens_: int, top_k: int, experts: int,
                                   block_m: int) -> None:
    """The one-program Triton alignment (several chunks of pairs and of blocks, experts
    not a power of two) against the torch ops, on the rows a GEMM reads."""
    g = torch.Generator().manual_seed(tokens_)
    ids = torch.rand(tokens_, experts, generator=g).topk(top_k, dim=-1).indices.to(DEV)
    assert ids.numel() <= ALIGN_KERNEL_MAX_PAIRS
    got, want = (align(ids, experts, block_m)
                 for align in (align_by_expert, align_by_expert_torch))
    rows = int(want[2])
    assert int(got[2]) == rows
    assert torch.equal(got[0][:rows], want[0][:rows])
    assert torch.equal(got[1][: rows // block_m], want[1][: rows // block_m])


@pytest.mark.parametrize("n", [1, 5, 17])
@pytest.mark.parametrize("family,dtype", [("qwen3_moe", torch.float32),
                                          ("qwen3_moe", torch.bfloat16),
                                          ("mixtral", torch.bfloat16)])  # fp32 weights
def test_triton_equals_torch(family: str, dtype: torch.dtype, n: int) -> None:
    block, cfg = hf_block(family, True)
    x = tokens(n).to(dtype)
    torch_moe = ours(block, cfg, dtype, backend="torch")
    triton_moe = ours(block, cfg, dtype, backend="triton")
    with torch.no_grad():
        weights, ids = torch_moe.route(x)
        want = torch_moe.grouped(x, weights, ids)
        got = fused_moe(x.to(DEV), triton_moe.gate_up.to(DEV), triton_moe.down.to(DEV),
                        weights.to(DEV), ids.to(DEV), blocks=BLOCKS)
    # fp32: only the order of the sums differs; bf16: each of the roundings may then
    # land an ulp apart (of the expert outputs, which may cancel in the sum)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)


def test_triton_backend_routes_the_call() -> None:
    """MoE(backend="triton") runs kernels/fused_moe (its default tiles) end to end."""
    block, cfg = hf_block("olmoe", False)
    block.to(DEV)
    x = tokens(3).to(DEV)
    with torch.no_grad():
        got = ours(block, cfg, backend="triton")(x)
        torch.testing.assert_close(got, block(x[None])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keep_plain", [False, True])
@pytest.mark.parametrize("family,norm", [("qwen3_moe", True), ("mixtral", True)])
def test_bf16_close_to_fp32(family: str, norm: bool, keep_plain: bool) -> None:
    """bf16 experts (oneDNN-packed; with keep_plain, 1-4 rows through the compiled
    matrix-vector kernel) against fp32 over the same routing (bf16 may flip a near tie)."""
    if keep_plain and not cpu_ops.available():
        pytest.skip("no compiled CPU kernels")
    block, cfg = hf_block(family, norm, inter=64)
    x = tokens(40)
    moe16 = ours(block, cfg, torch.bfloat16, keep_plain=keep_plain)
    moe32 = ours(block, cfg)
    with torch.no_grad():
        weights, ids = moe16.route(x.bfloat16())
        got = moe16.grouped(x.bfloat16(), weights, ids).float()
        want = moe32.grouped(x, weights.float(), ids)
        assert got.dtype == torch.float32 and moe16(x.bfloat16()).dtype == torch.bfloat16
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
        hf = block.to(torch.bfloat16)(x.bfloat16()[None])[0].float()
    torch.testing.assert_close(got, hf, atol=3e-2, rtol=3e-2)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_graph_capture(dtype: torch.dtype) -> None:
    """A decode batch captured in a CUDA graph without a host sync replays new inputs
    with the eager result."""
    block, cfg = hf_block("qwen3_moe", True, experts=64, top_k=8, hidden=256, inter=128)
    moe = ours(block.to(DEV), cfg, dtype)
    static_x = torch.randn(8, 256, device=DEV, dtype=dtype)
    stream = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(stream):
        moe(static_x)  # compile outside the capture
        torch.cuda.set_sync_debug_mode("error")  # a host sync raises
        try:
            moe(static_x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            static_out = moe(static_x)
    torch.cuda.synchronize()
    for seed in range(3):
        static_x.copy_(torch.randn(8, 256, device=DEV, dtype=dtype,
                                   generator=torch.Generator(DEV).manual_seed(seed)))
        graph.replay()
        with torch.no_grad():
            torch.testing.assert_close(static_out, moe(static_x), atol=0, rtol=0)

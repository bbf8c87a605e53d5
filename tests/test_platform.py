"""engine/platform.py: the machine-wide choices and each model's plan, with the machine
(CPU flags, cores, environment, whether the compiled kernels load) injected."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from engine.config import EngineConfig
from engine.models.arch import ModelArch
from engine.platform import (ATTENTION_BACKENDS, DTYPES, FastPath, OpsKind, Platform,
                             auto_dtype, physical_cores, read_cpu_flags)

AVX2 = frozenset({"avx", "avx2", "fma"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}
AMX = AVX2 | {"amx_bf16", "amx_tile"}


def arch(hidden: int = 576, intermediate: int = 1536, heads: int = 9, kv_heads: int = 3,
         head_dim: int = 64) -> ModelArch:
    """SmolLM2-135M's shapes unless told otherwise."""
    return ModelArch(model_type="llama", vocab_size=320, hidden_size=hidden,
                     intermediate_size=intermediate, num_layers=2, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=256,
                     tie_word_embeddings=True, qkv_bias=False)


def never() -> bool:
    raise AssertionError("the compiled kernels were consulted")


def platform(backend: str = "cpu", dtype: str = "float32", eager: bool = False,
             kernels: Callable[[], bool] = lambda: True) -> Platform:
    device = "cuda" if backend == "cuda" else "cpu"
    return Platform(backend, device, dtype, None, AVX2, eager, kernels)


# -- Platform.choose ------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "isa", "want"), [
    ("cpu", AVX2, "float32"),  # emulated bf16 GEMMs: 5x slower than fp32
    ("cpu", AVX512_BF16, "bfloat16"),
    ("cpu", AMX, "bfloat16"),
    ("triton-interpret", AVX2, "float32"),  # the interpreter runs on the CPU
    ("triton-interpret", AVX512_BF16, "bfloat16"),
    ("cuda", AVX2, "bfloat16"),  # a GPU computes bf16 natively, whatever the CPU
])
def test_auto_dtype_follows_the_device_and_the_cpu_flags(backend: str, isa: frozenset[str],
                                                         want: str) -> None:
    p = Platform.choose(EngineConfig(attention_backend=backend), isa=isa, env={},
                        cores=lambda: 4)
    assert (p.dtype_name, p.dtype) == (want, DTYPES[want])
    assert p.device == ("cuda" if backend == "cuda" else "cpu")
    assert auto_dtype(p.device, isa) == want


def test_a_named_dtype_is_kept() -> None:
    p = Platform.choose(EngineConfig(dtype="fp16"), isa=AVX512_BF16, env={}, cores=lambda: 4)
    assert (p.dtype_name, p.dtype) == ("fp16", torch.float16)


def test_threads_one_per_core_unless_set_or_left_to_openmp() -> None:
    cfg = EngineConfig()
    assert Platform.choose(cfg, isa=AVX2, env={}, cores=lambda: 6).threads == 6
    # an OMP_NUM_THREADS the user set is kept, and applied to the engine thread (OpenMP
    # reads it once, at load: a value set later would not reach a new thread); one
    # OpenMP cannot parse as a count is left to OpenMP
    assert Platform.choose(cfg, isa=AVX2, env={"OMP_NUM_THREADS": "3"},
                           cores=lambda: 6).threads == 3
    assert Platform.choose(cfg, isa=AVX2, env={"OMP_NUM_THREADS": "2,1"},
                           cores=lambda: 6).threads == 2
    assert Platform.choose(cfg, isa=AVX2, env={"OMP_NUM_THREADS": "x"},
                           cores=lambda: 6).threads is None
    assert Platform.choose(EngineConfig(threads=5), isa=AVX2, env={"OMP_NUM_THREADS": "3"},
                           cores=lambda: 6).threads == 5


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown attention_backend 'tpu'"):
        Platform.choose(EngineConfig(attention_backend="tpu"), isa=AVX2, env={})
    assert list(ATTENTION_BACKENDS) == ["cpu", "cuda", "triton-interpret"]


def test_apply_sets_the_threads_it_chose() -> None:
    before = torch.get_num_threads()
    try:
        platform().apply()  # threads None: left as they are
        assert torch.get_num_threads() == before
        Platform("cpu", "cpu", "float32", 1).apply()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_machine_is_read_once_at_choose() -> None:
    p = Platform.choose(EngineConfig(), env={})
    assert p.isa == read_cpu_flags() and "flags" not in p.isa and ":" not in p.isa
    assert p.threads == physical_cores() >= 1


def test_kernels_load_only_where_the_platform_runs_them() -> None:
    assert platform("cpu", kernels=lambda: True).load_kernels()
    assert not platform("cpu", kernels=lambda: False).load_kernels()
    assert not platform("triton-interpret", kernels=never).load_kernels()
    assert not platform("cuda", kernels=never).runs_cpu_kernels


# -- Platform.plan ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_model_runs_the_compiled_step(dtype: str) -> None:
    plan = platform(dtype=dtype).plan(arch())
    assert (plan.ops, plan.fast_path, plan.compiled_attention) == (
        OpsKind.COMPILED, FastPath.COMPILED_STEP, True)
    assert plan.linear_small == (dtype == "bfloat16")
    assert (plan.device, plan.dtype) == ("cpu", DTYPES[dtype])


def test_enforce_eager_keeps_the_kernels_but_no_fast_path() -> None:
    plan = platform(eager=True).plan(arch())
    assert (plan.ops, plan.fast_path, plan.compiled_attention) == (
        OpsKind.COMPILED, FastPath.NONE, True)


@pytest.mark.parametrize(("head_dim", "attention", "ops"), [
    (48, False, OpsKind.TORCH),  # not a head dim of the paged kernel: SDPA
    (16, True, OpsKind.TORCH),  # the paged kernel takes it, rope_cache (% 32) does not
    (80, True, OpsKind.TORCH),
    (96, True, OpsKind.COMPILED),
    (128, True, OpsKind.COMPILED),
])
def test_a_head_dim_the_compiled_step_cannot_take_falls_back(head_dim: int, attention: bool,
                                                             ops: OpsKind) -> None:
    plan = platform().plan(arch(heads=4, kv_heads=2, head_dim=head_dim))
    assert (plan.compiled_attention, plan.ops) == (attention, ops)
    want = FastPath.COMPILED_STEP if ops is OpsKind.COMPILED else FastPath.NONE
    assert plan.fast_path is want


@pytest.mark.parametrize(("hidden", "intermediate"), [(72, 1536), (576, 40)])
def test_sizes_off_the_kernels_rows_run_torch_ops(hidden: int, intermediate: int) -> None:
    plan = platform().plan(arch(hidden=hidden, intermediate=intermediate))
    assert (plan.compiled_attention, plan.ops, plan.fast_path) == (
        True, OpsKind.TORCH, FastPath.NONE)


def test_bf16_weights_the_step_cannot_read_fall_back() -> None:
    """A bf16 weight keeps its plain copy (what the step reads) only with rows of a
    multiple of 32 values; fp32 weights are read as they are."""
    small = arch(hidden=48, heads=3, kv_heads=1, head_dim=64, intermediate=96)
    bf16 = platform(dtype="bfloat16").plan(small)
    assert (bf16.ops, bf16.fast_path) == (OpsKind.COMPILED, FastPath.NONE)
    assert [bf16.keeps_plain(n) for n in (48, 96, 192)] == [False, True, True]
    assert platform(dtype="float32").plan(small).fast_path is FastPath.COMPILED_STEP
    int8 = platform(dtype="bfloat16").plan(small, quantization="int8")
    assert int8.fast_path is FastPath.COMPILED_STEP  # int8 weights: always read as they are


def test_without_compiled_kernels_everything_is_torch() -> None:
    plan = platform(dtype="bfloat16", kernels=lambda: False).plan(arch())
    assert (plan.compiled_attention, plan.ops, plan.fast_path, plan.linear_small) == (
        False, OpsKind.TORCH, FastPath.NONE, False)
    assert not plan.keeps_plain(576)


def test_fp16_never_runs_the_compiled_kernels() -> None:
    plan = platform(dtype="float16").plan(arch())
    assert (plan.compiled_attention, plan.ops, plan.fast_path) == (
        False, OpsKind.TORCH, FastPath.NONE)


@pytest.mark.parametrize("backend", ["triton-interpret", "cuda"])
def test_the_triton_backends_replay_graphs_with_fused_ops(backend: str) -> None:
    plan = platform(backend, kernels=never).plan(arch(head_dim=48))
    assert (plan.ops, plan.fast_path, plan.compiled_attention) == (
        OpsKind.TRITON, FastPath.CUDA_GRAPHS, False)
    assert platform(backend, eager=True, kernels=never).plan(arch()).fast_path is FastPath.NONE


def test_bf16_on_the_interpreter_may_use_the_small_matmul_kernel() -> None:
    assert platform("triton-interpret", "bfloat16").plan(arch()).linear_small
    assert not platform("cuda", "bfloat16", kernels=never).plan(arch()).linear_small


def test_int8_quantization_needs_the_compiled_kernels_and_rows_of_16() -> None:
    assert platform().plan(arch(), quantization="int8").quantization == "int8"
    assert platform().plan(arch(head_dim=16, heads=4, kv_heads=2),
                           quantization="int8").ops is OpsKind.TORCH
    for p, a in [(platform(kernels=lambda: False), arch()),
                 (platform("triton-interpret", kernels=never), arch()),
                 (platform(), arch(intermediate=1544)),
                 (platform(), arch(head_dim=48, heads=4))]:
        with pytest.raises(ValueError, match="int8 quantization needs the cpu attention"):
            p.plan(a, quantization="int8")
    with pytest.raises(ValueError, match="quantization must be none, int8, int4 or gguf"):
        platform().plan(arch(), quantization="int3")


def test_gguf_weights_run_on_the_compiled_cpu_kernels_only() -> None:
    """A GGUF's block types: the CPU backend with its kernels, the compiled decode step
    included (it reads the blocks as they are)."""
    for q in ("gguf", "int4"):
        plan = platform().plan(arch(), quantization=q)
        assert plan.quantization == q and plan.fast_path is FastPath.COMPILED_STEP
    assert platform(eager=True).plan(arch(), quantization="gguf").fast_path is \
        FastPath.NONE
    for p in (platform(kernels=lambda: False), platform("triton-interpret", kernels=never)):
        with pytest.raises(ValueError, match="gguf quantization .* needs the cpu attention"):
            p.plan(arch(), quantization="gguf")
    for q in ("gguf", "int4"):  # (the block kernels take fp32 or bf16 activations)
        with pytest.raises(ValueError, match="runs in bfloat16 or float32, not float16"):
            platform(dtype="float16").plan(arch(), quantization=q)


def test_gguf_blocks_take_int8_activations_unless_float32_is_named() -> None:
    """The 4-bit matmuls quantize x to int8 in a bf16 run and in an fp32 one chosen for
    the machine (dtype auto on a CPU without native bf16); float32 asked for by name keeps
    the exact sums; unquantized weights never do."""
    auto_fp32 = Platform.choose(EngineConfig(dtype="auto"), isa=AVX2, env={})
    assert auto_fp32.dtype_name == "float32" and auto_fp32.dtype_auto
    named = Platform.choose(EngineConfig(dtype="float32"), isa=AVX2, env={})
    for q in ("gguf", "int4"):
        assert platform(dtype="bfloat16").plan(arch(), quantization=q).int8_activations
        assert not named.plan(arch(), quantization=q).int8_activations
        assert dataclasses.replace(auto_fp32, cpu_kernels=lambda: True).plan(
            arch(), quantization=q).int8_activations
    assert not platform(dtype="bfloat16").plan(arch()).int8_activations


def test_the_cpu_backend_is_built_as_planned() -> None:
    from engine.attention.cpu import CpuAttention

    for kernels in (True, False):
        p = platform(kernels=lambda k=kernels: k)  # type: ignore[misc]
        a = arch()
        attn = p.attention(a, p.plan(a, kv_cache_dtype="auto"), block_size=16)
        assert isinstance(attn, CpuAttention) and attn.compiled is kernels
        assert attn.cache_shape(4) == (3, 4, 16, 64)


# -- the runner follows the plan ------------------------------------------------------


def test_the_runner_follows_the_plan(tiny_models) -> None:
    from engine import LLM
    from engine.layer_ops import CompiledOps, TorchOps
    from kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("no C++ compiler: the compiled CPU kernels are unavailable")
    for head_dim, ops, step in [(16, TorchOps, False), (32, CompiledOps, True)]:
        llm = LLM(model=str(tiny_models("llama", 0, head_dim=head_dim)), dtype="float32",
                  kv_tier="none")
        runner = llm.engine.runner
        assert runner.plan == llm.engine.platform.plan(llm.engine.arch)
        assert type(runner.model.ops) is ops and runner.attn.compiled
        assert (runner.compiled_step is not None) == step and runner.graphs is None

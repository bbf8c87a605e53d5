"""The platform: which code runs on this machine, decided once.

`Platform.choose(config)` reads the machine once (CPU feature flags, physical cores)
and settles what EngineConfig leaves open: the activations' dtype for "auto", torch's
thread count, the attention backend and the device it keeps tensors on. `plan()` then
decides, for one model, every hardware-dependent choice of running it (the attention
kernel, the layer ops, the matmul kernels, the fast decode path); the eligibility rules
(head dims, hidden sizes, dtype, quantization, enforce_eager) are written there and
nowhere else. ModelRunner and the model (engine/models) follow the plan: they test no backend names.

"cpu" in Tidewire names this platform's CPU side: the `cpu` attention backend
(engine/attention/cpu.py) and the C++ kernels of kernels/cpu/, which kernels/cpu_ops.py
builds, loads and wraps.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend
from engine.attention.cpu import CpuAttention
from engine.attention.triton import TritonAttention, TritonInterpretAttention
from engine.config import EngineConfig
from kernels import cpu_ops

if TYPE_CHECKING:
    from engine.models.arch import ModelArch

# EngineConfig.dtype's names (engine.config.DTYPE_NAMES) as torch dtypes
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}

# EngineConfig.attention_backend: cpu (tuned for CPUs), cuda (Triton kernels), and
# triton-interpret (the Triton kernels under Triton's interpreter, on the CPU: slow, for tests)
ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "cpu": CpuAttention, "cuda": TritonAttention, "triton-interpret": TritonInterpretAttention}

# CPU flags of native bf16 arithmetic; without them torch's bf16 GEMM is emulated
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def _omp_threads(env: Mapping[str, str]) -> int | None:
    """OMP_NUM_THREADS's first level as a number, applied to the engine thread explicitly:
    OpenMP reads the variable once, when it loads, so a value set later in the process
    (an embedding application, the test suite) would otherwise not reach a new thread.
    None where it is not a number (OpenMP's own reading stands)."""
    first = env["OMP_NUM_THREADS"].split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None

class OpsKind(enum.Enum):
    """Which implementation runs a layer's elementwise ops (engine/layer_ops.py)."""

    TORCH = "torch"  # kernels/reference.py
    TRITON = "triton"  # the fused Triton kernels
    COMPILED = "compiled"  # the compiled CPU kernels; rope also writes the KV cache


# what of ModelArch.features the compiled whole-model decode step runs: a Llama stack
# with a sliding window per layer (Mistral), q and k heads RMS-normed before rotary
# (Qwen3), layers without rotary (SmolLM3), rotary on part of each head (Phi-3; a multiple
# of 32 dims)
COMPILED_STEP_FEATURES = frozenset({"sliding_window", "qk_norm", "nope", "partial_rotary"})


class FastPath(enum.Enum):
    """What runs a small decode step instead of the eager forward."""

    NONE = "none"
    CUDA_GRAPHS = "cuda-graphs"  # engine/cuda_graphs.py (run eagerly under the interpreter)
    COMPILED_STEP = "compiled-step"  # engine/compiled_step.py


def read_cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        line = ""
    return frozenset(line.partition(":")[2].split())


def auto_dtype(device: str, isa: frozenset[str]) -> str:
    """What `dtype="auto"` means: bfloat16 on a GPU, and on a CPU with native bf16 math
    (AVX512-BF16 or AMX); elsewhere float32. On an AVX2-only CPU (seen: AMD EPYC)
    torch's bf16 GEMM ran at ~15 GFLOP/s against ~78 for fp32, a 5x slower model."""
    if device == "cuda":
        return "bfloat16"
    return "bfloat16" if BF16_FLAGS & isa else "float32"


def physical_cores() -> int:
    """Cores this process may run on, each counted once however many hardware threads it
    has (two threads of one core share its vector units: the matmuls gain nothing)."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


@dataclass(frozen=True)
class ModelPlan:
    """How one model runs on a platform (Platform.plan); the model (engine/models) and
    ModelRunner follow it."""

    device: str  # where the weights, the KV cache and the step's tensors live
    dtype: torch.dtype  # the activations' and weights' dtype
    ops: OpsKind
    fast_path: FastPath
    # cpu backend: the compiled paged-attention kernel (else SDPA over gathered blocks)
    compiled_attention: bool = False
    # bf16 weights on the CPU: those that take it also keep a plain copy for
    # cpu_ops.linear_small (see keeps_plain)
    linear_small: bool = False
    quantization: str = "none"  # "none", "int8", "int4" (engine/quant.py), "gguf" (gguf_weights)
    kv_cache_dtype: str = "auto"  # "auto" (the activations' dtype) or "int8"
    # GGUF blocks (int4 among them): x quantized to int8 into their small-batch matmuls
    # (cpu_ops.gguf_linear_small int8_x), as llama.cpp does. Every bf16 run, and an fp32
    # one whose dtype was "auto" (a CPU without native bf16); float32 asked for by name
    # keeps the exact sums (the parity tests' oracle)
    int8_activations: bool = False

    def keeps_plain(self, in_features: int) -> bool:
        """Whether a bf16 weight with rows of `in_features` is kept plain beside its
        oneDNN-packed copy, for batches of a few rows (engine/models/layers.py Linear)."""
        return self.linear_small and in_features % 32 == 0


@dataclass(frozen=True)
class Platform:
    """The machine-wide choices (Platform.choose), made once per engine and shared by
    every model it runs (the target and a draft)."""

    attention_backend: str  # a name in ATTENTION_BACKENDS
    device: str  # "cpu" or "cuda": where the backend keeps tensors
    dtype_name: str  # a name in DTYPES ("auto" resolved)
    threads: int | None  # torch threads of the engine thread; None: OpenMP's own default
    isa: frozenset[str] = field(default=frozenset(), repr=False)  # CPU flags, read once
    enforce_eager: bool = False  # no fast decode path
    # whether the compiled CPU kernels load: builds them on the first call (once per
    # machine), then answers from the loader's memory
    cpu_kernels: Callable[[], bool] = field(default=cpu_ops.available, repr=False,
                                            compare=False)
    dtype_auto: bool = False  # dtype_name was chosen for this machine ("auto")

    @classmethod
    def choose(cls, config: EngineConfig, isa: frozenset[str] | None = None,
               env: Mapping[str, str] = os.environ,
               cores: Callable[[], int] = physical_cores) -> Platform:
        """The platform `config` asks for on this machine (`isa`, `env` and `cores`
        stand in for the machine in tests). Compiles nothing: see load_kernels."""
        backend = config.attention_backend
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention_backend {backend!r}; "
                             f"choose from {list(ATTENTION_BACKENDS)}")
        isa = read_cpu_flags() if isa is None else isa
        device = ATTENTION_BACKENDS[backend].device
        dtype = auto_dtype(device, isa) if config.dtype == "auto" else config.dtype
        # 0 keeps an OMP_NUM_THREADS the user set, else one thread per physical core
        threads = config.threads or (_omp_threads(env) if "OMP_NUM_THREADS" in env else cores())
        return cls(backend, device, dtype, threads, frozenset(isa), config.enforce_eager,
                   dtype_auto=config.dtype == "auto")

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def runs_cpu_kernels(self) -> bool:
        """Whether this platform's attention runs the compiled CPU kernels (where they
        build): the engine builds them at start-up, in a phase of their own."""
        return self.attention_backend == "cpu"

    def apply(self) -> None:
        """The process-wide settings, made on the calling thread (OpenMP's team size is
        per thread): the engine thread calls this before its first torch op."""
        if self.threads:
            torch.set_num_threads(self.threads)

    def load_kernels(self) -> bool:
        """Build (once per machine) and load the compiled CPU kernels where this platform
        runs them; whether they are available."""
        return self.runs_cpu_kernels and self.cpu_kernels()

    def plan(self, arch: ModelArch, quantization: str = "none",
             kv_cache_dtype: str = "auto") -> ModelPlan:
        """Every hardware-dependent choice of running `arch` here, with its rule. The
        compiled CPU kernels take fp32 or bf16, the head dims of cpu_ops.PAGED_HEAD_DIMS
        (attention), rows of a multiple of 16 values (norm, SiLU-mul, linear_small) and
        head dims of a multiple of 32 (rope_cache); the compiled decode step needs every
        matmul's weight in a layout it reads (int8, fp32, or bf16 kept plain) and a Llama
        stack (a family with other `arch.features` decodes on the eager path)."""
        cpu, dtype = self.attention_backend == "cpu", self.dtype
        q_size = arch.num_heads * arch.head_dim
        in_features = (arch.hidden_size, q_size, arch.intermediate_size)
        compiled_attention = (cpu and arch.head_dim in cpu_ops.PAGED_HEAD_DIMS
                              and dtype in (torch.float32, torch.bfloat16)
                              and self.cpu_kernels())
        if not cpu:
            ops = OpsKind.TRITON
        elif (compiled_attention and arch.hidden_size % 16 == 0
              and arch.intermediate_size % 16 == 0 and arch.head_dim % 32 == 0):
            ops = OpsKind.COMPILED
        else:
            ops = OpsKind.TORCH
        if quantization in ("gguf", "int4") and dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{quantization} quantization runs in bfloat16 or float32, not "
                             f"{str(dtype).removeprefix('torch.')}")
        if quantization == "int8":
            if not compiled_attention or any(n % 16 for n in in_features):
                raise ValueError("int8 quantization needs the cpu attention backend with its "
                                 "compiled kernels (a C++ compiler), and hidden size, "
                                 "intermediate size and heads x head_dim multiples of 16")
            if arch.num_experts:
                raise ValueError("int8 quantization of mixture-of-experts models is not "
                                 "supported yet")
        elif quantization == "gguf":
            if not (cpu and self.cpu_kernels()):
                raise ValueError("gguf quantization (a GGUF's weights as they are) needs the "
                                 "cpu attention backend with its compiled kernels; on a GPU "
                                 "a GGUF runs dequantized (without --quantization)")
        elif quantization == "int4":
            if not (cpu and self.cpu_kernels()) or any(n % 32 for n in in_features):
                raise ValueError("int4 quantization needs the cpu attention backend with its "
                                 "compiled kernels, and hidden size, intermediate size and "
                                 "heads x head_dim multiples of 32")
            if arch.num_experts:
                raise ValueError("int4 quantization of mixture-of-experts models is not "
                                 "supported yet")
        elif quantization != "none":
            raise ValueError(f"quantization must be none, int8, int4 or gguf, got "
                             f"{quantization!r}")
        linear_small = self.device == "cpu" and dtype == torch.bfloat16 and self.cpu_kernels()
        int8_activations = quantization in ("gguf", "int4") and (
            dtype == torch.bfloat16 or self.dtype_auto)
        plan = ModelPlan(self.device, dtype, ops, FastPath.NONE, compiled_attention,
                         linear_small, quantization, kv_cache_dtype, int8_activations)
        # weights the compiled step reads: int8; GGUF blocks (int4 among them); fp32 (never
        # packed); bf16 kept plain
        readable = (quantization in ("int8", "gguf", "int4") or dtype == torch.float32
                    or all(plan.keeps_plain(n) for n in in_features))
        if self.enforce_eager:
            fast = FastPath.NONE
        elif not cpu:
            fast = FastPath.CUDA_GRAPHS
        elif (ops is OpsKind.COMPILED and readable and arch.features <= COMPILED_STEP_FEATURES
              and arch.head_rotary_dim % 32 == 0):
            # the compiled step runs a Llama stack (sliding windows included): other
            # families decode eagerly
            fast = FastPath.COMPILED_STEP
        else:
            fast = FastPath.NONE
        return replace(plan, fast_path=fast)

    def attention(self, arch: ModelArch, plan: ModelPlan, block_size: int) -> AttentionBackend:
        """The attention backend of a model run by `plan`."""
        args = (arch.num_heads, arch.num_kv_heads, arch.head_dim, block_size, plan.dtype,
                plan.kv_cache_dtype)
        if self.attention_backend == "cpu":
            attn: AttentionBackend = CpuAttention(*args, compiled=plan.compiled_attention)
        else:
            attn = ATTENTION_BACKENDS[self.attention_backend](*args)
        if arch.attn_scale is not None:  # Gemma's query_pre_attn_scalar
            attn.scale = arch.attn_scale
        return attn

"""The model layer's building blocks: linears (bf16 prepacked for oneDNN, int8), the
activations of the gated MLPs, and the weights of one decoder layer.

Weights are plain tensors (no nn.Module per layer: fewer Python hops per step); the
projections that read the same input are fused into one GEMM (q/k/v, gate/up).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.quant import dequantize_int8
from kernels import cpu_ops


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
                 keep_plain: bool = False, pack: bool = True) -> None:
        """`keep_plain`: keep the plain weight beside a packed one, for batches of up to
        `small_rows` rows (ModelPlan.keeps_plain; False where the caller never sends so
        few). `pack=False`: no packed copy (one copy of the weight, not two: the experts
        of a MoE model, most of its bytes), so batches past `small_rows` take F.linear."""
        self.weight, self.bias = weight.contiguous(), bias
        self.out_features, self.in_features = weight.shape
        self.plain: torch.Tensor | None = None  # kept for linear_small
        packed = (_mkldnn_pack(self.weight) if pack and weight.dtype == torch.bfloat16
                  else None)
        if not pack and keep_plain and weight.dtype == torch.bfloat16:
            self.plain = self.weight  # the same tensor: linear_small for a few rows
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
    reading them). Bigger batches in bf16, on a CPU with the integer GEMM
    (cpu_ops.gguf_gemm_int8: AVX-512 VNNI and BF16, AMX not in use) and rows of a
    multiple of 256 values, take cpu_ops.linear_int8_gemm: x in int8 against the weights
    as they are, so no other copy of them is kept. Elsewhere, where that kernel loses to
    a dense GEMM, they use the dequantized weights in the activation dtype (the same
    values), made at load."""

    small_rows = 4

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        self.q, self.scale, self.bias = q.contiguous(), scale.float().contiguous(), bias
        self.out_features, self.in_features = q.shape
        self.gemm = dtype == torch.bfloat16 and cpu_ops.gguf_gemm_int8(8, self.in_features)
        # (no plain copy: batches of up to small_rows rows never reach it)
        self.dense = None if self.gemm else Linear(dequantize_int8(q, scale).to(dtype), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if _few_rows(x, self.small_rows):
            return cpu_ops.linear_small(x, self.q, self.scale, self.bias)
        if self.dense is None:
            return cpu_ops.linear_int8_gemm(x.contiguous(), self.q, self.scale, self.bias)
        return self.dense(x)


class GGUFLinear:
    """y = x W^T (+ b) with W in a GGUF file's own block types (engine/gguf_weights.py),
    given as parts stacked by rows (q/k/v, gate/up: a Q4_K_M file stores some of them in
    Q4_K, others in Q6_K), each a QuantWeight or a plain matrix.

    Up to `small_rows[type]` rows (decode) stream each part's blocks once through
    cpu_ops.gguf_linear_small, which never dequantizes them. Where the small kernel takes
    x in int8 and the CPU has the integer GEMM (cpu_ops.gguf_gemm_int8: AVX-512 VNNI and
    BF16 without AMX), every batch above `gemm_rows[type]` rows,
    prefill included, takes it: x in int8 against the 4-8 bit codes as bytes, faster
    than the bf16 GEMM on the dequantized weight would be. Else decode batches
    of up to `tiled_rows` bf16 rows, where the CPU has AVX512-BF16, take
    cpu_ops.gguf_linear_tiled: a few weight rows at a time dequantized into a
    cache-resident tile that every row of x meets (one dequantization a weight a call).
    Bigger batches (prefill chunks), and fp32 or other CPUs, dequantize a part
    `tile_bytes` of the activations' dtype at a time into one reused buffer for the dense
    GEMM: the weights stay 4-8 bits in memory, the GEMM sees its usual operands.
    (Thresholds measured with `python -m bench.gguf_kernels --tiled`: on a Zen 4 without
    AMX the tiled kernel leads the dense path to ~96 rows, 0.87x the packed bf16 GEMM at
    64; on a Xeon with AMX, whose tiled kernel multiplies on the matrix unit, to 256.)"""

    # by block type (ggml's ids): the K types' small-batch kernel takes x in int8 and
    # stays ahead of the tiled one to 8 rows; Q4_0/Q4_1's (int8 x per 64 values) to 4
    small_rows = {2: 4, 3: 4, 8: 4, 12: 8, 13: 8, 14: 8}
    # where the integer GEMM runs, the small kernel keeps only the batches it is faster on
    # (8192 x 2048 on a Zen 4: Q4_K/Q5_K the GEMM from 5 rows, Q6_K from 7; Q8_0 from 4,
    # Q4_0/Q4_1 from 2, but they keep their 4 so that the compiled step, which stops
    # where the small kernel does, keeps its decode batches)
    gemm_rows = {2: 4, 3: 4, 8: 4, 12: 4, 13: 4, 14: 6}
    tiled_rows = 96
    tiled_rows_amx = 256
    # the dense path's buffer: each GEMM call of a part re-reads x and hands the threads
    # over between the dequantization and oneDNN, so fewer, bigger tiles win (a 512-row
    # x against 16,384 x 2,048 Q4_K on a Zen 4: 0.88x the packed bf16 GEMM with 4 MiB
    # tiles, 0.90-0.95x with 16-32 MiB, no better whole)
    tile_bytes = 16 << 20
    _tiles = threading.local()  # one tile buffer a thread, shared by every GGUFLinear

    def __init__(self, parts: list[Any], bias: torch.Tensor | None, dtype: torch.dtype,
                 int8_x: bool | None = None, pack: bool = True) -> None:
        from engine.gguf_weights import PackedWeight, QuantWeight

        merged: list[Any] = []
        for p in parts:  # rows of one block type join into one matrix where that is free
            last = merged[-1] if merged else None
            joined = last.joined(p) if isinstance(p, QuantWeight) and \
                isinstance(last, QuantWeight) else None
            if joined is not None:
                merged[-1] = joined
            else:
                merged.append(p if isinstance(p, QuantWeight) else p.to(dtype).contiguous())
        self.bias, self.dtype = bias, dtype
        # the small-batch kernel's x in int8 (ModelPlan.int8_activations; None: in bf16)
        self.int8_x = dtype == torch.bfloat16 if int8_x is None else int8_x
        # Q4_K, Q6_K and Q8_0 parts repacked as tiles of 16 rows where the CPU multiplies them
        # (PackedWeight: every batch size, x in int8), but not where AMX runs (its tiled
        # kernel reads the blocks) nor for a matrix an embedding also reads in a copy of
        # its own (pack=False; a view of the mapped file reads back from the file)
        if pack and self.int8_x and dtype in (torch.bfloat16, torch.float32) and \
                cpu_ops.available() and not cpu_ops.amx():
            merged = [PackedWeight.of(p) if PackedWeight.takes(p) else p for p in merged]
        self.parts = merged
        self.in_features = int(parts[0].shape[1])
        self.out_features = sum(int(p.shape[0]) for p in parts)
        self._gemm_by_part: dict[tuple[int, bool], bool] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from engine.gguf_weights import PackedWeight, QuantWeight

        x = x.contiguous()
        out = torch.empty((x.shape[0], self.out_features), dtype=x.dtype)
        n = x.shape[0]
        tiled = x.dtype == torch.bfloat16 and cpu_ops.gguf_tiled()
        most = self.tiled_rows_amx if tiled and cpu_ops.amx() else self.tiled_rows
        o = 0
        for p in self.parts:
            rows = int(p.shape[0])
            dest = out[:, o : o + rows]
            if isinstance(p, PackedWeight):
                cpu_ops.gguf_packed_linear(x, p.data, p.base, None, out=dest)
            elif not isinstance(p, QuantWeight):
                dest.copy_(F.linear(x, p))
            elif tiled and n > self.small_limit(p) and self._gemm(p):
                cpu_ops.gguf_linear_tiled(x, p.data, p.qtype, None, out=dest, int8_x=True)
            elif 0 < n <= self.small_rows[p.qtype]:
                cpu_ops.gguf_linear_small(x, p.data, p.qtype, None, out=dest,
                                          int8_x=self.int8_x)
            elif tiled and 0 < n <= most:
                cpu_ops.gguf_linear_tiled(x, p.data, p.qtype, None, out=dest)
            else:
                self._dense(x, p, dest)
            o += rows
        if self.bias is not None:
            out += self.bias
        return out

    def _gemm(self, p: Any) -> bool:
        """Whether bf16 batches past small_limit(p) rows take the integer GEMM (asked for
        every part of every call: kept by part and AMX state)."""
        key = (id(p), cpu_ops.amx())
        got = self._gemm_by_part.get(key)
        if got is None:
            got = self._gemm_by_part[key] = bool(
                self.int8_x and self.dtype == torch.bfloat16 and p.qtype in self.gemm_rows
                and cpu_ops.gguf_tiled() and cpu_ops.gguf_gemm_int8(p.qtype, p.cols))
        return got

    def small_limit(self, p: Any) -> int:
        """The most rows of bf16 x the small-batch kernel takes for QuantWeight part p
        (a PackedWeight: every batch runs on its kernels; the compiled step's 8)."""
        from engine.gguf_weights import PackedWeight

        if isinstance(p, PackedWeight):
            return 8
        return self.gemm_rows[p.qtype] if self._gemm(p) else self.small_rows[p.qtype]

    def _dense(self, x: torch.Tensor, p: Any, dest: torch.Tensor) -> None:
        """dest = x W^T through dequantized tiles of W's rows."""
        step = max(16, self.tile_bytes // (p.cols * x.element_size()))
        buf = getattr(self._tiles, "buf", None)
        if buf is None or buf.numel() * buf.element_size() < step * p.cols * x.element_size():
            buf = self._tiles.buf = torch.empty(step * p.cols * x.element_size(),
                                                dtype=torch.uint8)
        for r0 in range(0, p.rows, step):
            r1 = min(p.rows, r0 + step)
            n = (r1 - r0) * p.cols
            tile = buf.view(x.dtype)[:n].view(r1 - r0, p.cols)
            torch.ops.tidewire.gguf_dequant(tile, p.data[r0:r1], p.qtype)
            dest[:, r0:r1] = F.linear(x, tile)


class GGUFEmbedding:
    """An embedding table in a GGUF block type: each step dequantizes only the rows it
    looks up."""

    def __init__(self, weight: Any, dtype: torch.dtype) -> None:  # a QuantWeight
        self.weight, self.dtype = weight, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.data.index_select(0, ids.reshape(-1))
        out = cpu_ops.gguf_dequant(rows, self.weight.qtype, self.weight.cols, self.dtype)
        return out.view(*ids.shape, self.weight.cols)


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


Matmul = Linear | Int8Linear | GGUFLinear


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] = [gate | up] -> gelu_tanh(gate) * up (Gemma's GeGLU)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


ACTIVATIONS = ("silu", "gelu_tanh")
# HF config `hidden_act` / `hidden_activation` names of the activations above
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_tanh": "gelu_tanh"}


def activation_of(hf_name: str) -> str:
    """Tidewire's name of an HF activation; ValueError for one it does not run."""
    if hf_name not in HF_ACTIVATIONS:
        raise ValueError(f"unsupported activation {hf_name!r}; supported: "
                         f"{', '.join(sorted(HF_ACTIVATIONS))}")
    return HF_ACTIVATIONS[hf_name]


@dataclass
class DenseMLP:
    """down(act(gate) * up), gate and up one fused matmul."""

    gate_up: Matmul  # [2 * intermediate, hidden]
    down: Matmul  # [hidden, intermediate]
    act: str = "silu"  # a name in ACTIVATIONS

    def __call__(self, h: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
                 ) -> torch.Tensor:
        """`silu_and_mul`: the platform's (a compiled kernel on the CPU)."""
        g = self.gate_up(h)
        return self.down(silu_and_mul(g) if self.act == "silu" else gelu_tanh_and_mul(g))


@dataclass
class LayerWeights:
    """One decoder layer. Optional parts are None where the family has none."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Matmul  # [(heads + 2 * kv_heads) * head_dim, hidden] (+ bias: Qwen2)
    o: Matmul  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]: before the MLP
    mlp: Any  # DenseMLP or engine.models.moe.MoE: (h, silu_and_mul) -> [tokens, hidden]
    q_norm: torch.Tensor | None = None  # [head_dim]: per-head RMSNorm before rotary (Qwen3)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # Gemma: on attention's output, before the add
    mlp_out_norm: torch.Tensor | None = None  # Gemma: on the MLP's output, before the add
    window: int = 0  # 0: full causal attention; W: the last W keys
    rope: str | None = "global"  # key of the model's rotary tables; None: no rotary (NoPE)

"""Tidewire's compiled CPU operators (kernels/cpu/: ops.cpp and its headers), built once
per machine, loaded, and wrapped here with their contracts (shapes, dtypes, layouts).

The C++ sources are compiled with `-march=native` by torch.utils.cpp_extension the first
time they are needed (about 30 s on 2 cores; `make install` does it ahead of time) and
cached under `$TIDEWIRE_CACHE/ext/` keyed by the sources, the torch version and the CPU,
so a copied cache never runs code built for another processor. The operators register
as `torch.ops.tidewire.*`. Where no compiler is available (or TIDEWIRE_CPU_OPS=0),
`available()` is False and engine/platform.py plans models on the torch references in
kernels/reference.py instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("tidewire.kernels")

_SRC = Path(__file__).parent / "cpu"
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_identity() -> str:
    """Model name and feature flags of this CPU (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
    except OSError:
        lines = []
    return platform.machine() + "".join(sorted(set(lines)))


def build_dir() -> Path:
    sources = sorted(_SRC.glob("*.[ch]*"))
    h = hashlib.sha256(torch.__version__.encode() + _cpu_identity().encode())
    for p in sources:
        h.update(p.name.encode() + p.read_bytes())
    root = Path(os.environ.get("TIDEWIRE_CACHE") or Path.home() / ".cache" / "tidewire")
    return root / "ext" / f"cpu_ops-{h.hexdigest()[:16]}"


def _build() -> None:
    from torch.utils.cpp_extension import load

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    fresh = not any(out.glob("*.so"))
    t0 = time.monotonic()
    if fresh:
        log.info("compiling Tidewire's CPU kernels into %s (once per machine)", out)
    load(name="tidewire_cpu_ops", sources=[str(_SRC / "ops.cpp")], build_directory=str(out),
         # -fopenmp: at::parallel_for is a header template that is parallel only where
         # the including file is compiled with OpenMP; libgomp.so.1 then resolves to the
         # copy torch has already loaded (one thread pool for torch and these kernels).
         extra_cflags=["-O3", "-march=native", "-std=c++17", "-fopenmp"],
         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    if fresh:
        log.info("compiled the CPU kernels in %.1fs", time.monotonic() - t0)


def available() -> bool:
    """Whether torch.ops.tidewire.* are loaded (building them on first use)."""
    with _lock:
        if "ok" not in _state:
            ok = os.environ.get("TIDEWIRE_CPU_OPS", "1") not in ("0", "false", "")
            if ok:
                try:
                    _build()
                except Exception as e:  # no compiler, no ninja, a failed build: fall back
                    log.warning("Tidewire's CPU kernels are unavailable (%s); using torch ops",
                                str(e).splitlines()[0] if str(e) else type(e).__name__)
                    ok = False
            _state["ok"] = ok
            if ok:  # TIDEWIRE_CPU_AMX=0: no kernel touches the tiles in this process
                allow = os.environ.get("TIDEWIRE_CPU_AMX", "1") not in ("0", "false", "")
                _state["amx"] = bool(torch.ops.tidewire.cpu_amx(int(allow)))
        return bool(_state["ok"])


PAGED_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the head dims paged_attention takes


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start: torch.Tensor, scale: float,
                    num_decodes: int | None = None, window: int = 0,
                    cascade: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                    ) -> None:
    """Causal paged attention of a ragged batch, read in place from the cache, into `out`.

    q, out [num_tokens, num_heads, head_dim] (heads contiguous, any token stride);
    k_cache, v_cache [num_kv_heads, num_blocks, block_size, head_dim] contiguous, in q's
    dtype, or both int8 caches (uint8 [num_kv_heads, num_blocks, block_size * (head_dim
    + 4)], kernels/cpu/kv_q8.h); block_table [num_seqs, max_blocks], seq_lens [num_seqs]
    (context after this step), query_start [num_seqs + 1], all int32. Query i of
    sequence s sits at position seq_lens[s] - q_len + i. float32 or bfloat16 (fp32
    accumulation either way); head_dim in PAGED_HEAD_DIMS. Sequences
    [0, num_decodes) are decode steps (None: every one-token sequence), which over an
    int8 cache may take int8 queries (q8_decode_quantizes_queries). window > 0: sliding
    window, the query at position p sees keys (p - window, p] (reference.paged_attention),
    and keys no query of a work item can see are never read; 0: full causal attention.

    cascade = (members, offsets, shared), int32 (window 0 only): shared-prefix attention.
    Group g is the sequences members[offsets[g]:offsets[g + 1]], whose block-table rows
    begin with the same blocks for their first shared[g] keys, which lie before each of
    their queries. Those keys are read once for the group, its queries stacked as the
    rows of one work item, and merged with each sequence's own keys by log-sum-exp: the
    same result to rounding (cascade_groups finds such groups)."""
    members, offsets, shared = cascade if cascade is not None else (None, None, None)
    torch.ops.tidewire.paged_attention(out, q, k_cache, v_cache, block_table, seq_lens,
                                       query_start, scale,
                                       -1 if num_decodes is None else num_decodes, window,
                                       members, offsets, shared)


def q8_decode_quantizes_queries() -> bool:
    """Whether decodes over an int8 KV cache can run the integer kernel, which takes each
    query row through int8 too (kernels/cpu/attention_decode.h): where the CPU has
    AVX512-VNNI (the kernels are built with -march=native), for head_dim a multiple of
    64, at most 8 query heads per KV head and block sizes a multiple of 16. Otherwise,
    and for prefill chunks everywhere, tiles are dequantized and the queries kept."""
    flags = set(_cpu_identity().split())
    return {"avx512_vnni", "avx512bw"} <= flags


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rms_norm, fused: returns (normed, new residual). With a residual, the sum
    x + residual is written into `residual` (which must be the caller's to overwrite) and
    returned as the new residual. x, residual: contiguous [rows, hidden], hidden % 16 == 0.
    The weight: in x's dtype, or fp32 (Gemma's norms: see reference.rms_norm)."""
    out = torch.empty_like(x)
    if residual is None:
        torch.ops.tidewire.rms_norm(out, x, x, weight, eps, False)
        return out, x
    torch.ops.tidewire.rms_norm(out, x, residual, weight, eps, True)
    return out, residual


def rope_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
               num_heads: int) -> None:
    """reference.rope over the q and k heads of qkv [tokens, (heads + 2 * kv_heads) *
    head_dim] (rows contiguous), in place, then each token's k and v stored at its slot of
    the [kv_heads, num_blocks, block_size, head_dim] caches, or quantized into int8 caches
    as reference.q8_write does (slot -1: not stored).
    positions, slot_mapping: int64 [tokens]; cos, sin: fp32 [max_positions, head_dim / 2]
    (engine/models/rotary.py); head_dim % 32 == 0."""
    torch.ops.tidewire.rope_cache(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping,
                                  num_heads)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """reference.silu_and_mul: x [rows, 2d] contiguous -> [rows, d], d % 16 == 0."""
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    torch.ops.tidewire.silu_and_mul(out, x)
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """reference.apply_token_bitmask, in one pass over the masked rows (whole words of
    allowed tokens skipped)."""
    torch.ops.tidewire.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64))


MAX_SMALL_ROWS = 8


def linear_small(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (* scale per output channel) (+ bias) for 1 to 8 rows of x [rows, in]
    (rows contiguous; in % 16 == 0): W [out, in] contiguous, in x's dtype or int8 (then
    `scale`, fp32 [out], dequantizes). fp32 accumulation; y [rows, out] in x's dtype.
    Streams W once for all rows: the decode-time matmul, bound by memory speed."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
    torch.ops.tidewire.linear_small(out, x, weight, scale, bias)
    return out


# GGUF block types the compiled kernels read as they are (ggml's type ids): values and
# bytes per block (kernels/cpu/gguf_quant.h)
GGUF_BLOCKS = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 13: (256, 176),
               14: (256, 210)}


def gguf_linear_small(x: torch.Tensor, weight: torch.Tensor, qtype: int,
                      bias: torch.Tensor | None = None,
                      out: torch.Tensor | None = None,
                      int8_x: bool | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for 1 to 8 rows of x [rows, in] and W in a GGUF block type
    (`qtype`, a key of GGUF_BLOCKS) as the file stores it: uint8 [out, row bytes]. Never
    dequantizes W: each group of values sharing a scale is summed against x and scaled
    once. int8_x (None: where x is bf16): x quantized to int8 per 256 values (64 for the
    32-value types) and multiplied as bytes, on CPUs with AVX2 (llama.cpp's way: each
    value rounded to 1/254 of its group's largest magnitude, well inside the 4-6 bit
    weights' own rounding); False: the sums in fp32, as exact as the dequantized matmul.
    `out`: where to write ([rows, out], unit column stride; a column slice of a wider
    tensor will do)."""
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
    if int8_x is None:
        int8_x = x.dtype == torch.bfloat16
    torch.ops.tidewire.gguf_linear_small(out, x, weight, qtype, bias, bool(int8_x))
    return out


PACKED = 256  # + the block type: gguf_pack's tiles, as decode_step's qtypes name them
PACK_TILE_BYTES = {12: 2368, 14: 3360, 8: 4352}  # Q4_K, Q6_K, Q8_0


def gguf_packs(qtype: int) -> bool:
    """Whether gguf_pack takes `qtype` on this CPU: Q4_K, Q6_K and Q8_0 on CPUs with
    AVX-512 VNNI (kernels/cpu/gguf_packed.h)."""
    return bool(torch.ops.tidewire.gguf_packs(qtype))


def gguf_pack(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """Q4_K, Q6_K or Q8_0 rows uint8 [rows, row bytes] (rows a multiple of 16, rows of a
    multiple of 256 values) repacked as tiles of 16 rows: uint8 [rows / 16, in / 256,
    PACK_TILE_BYTES[qtype]] (gguf_packed.h has the layouts)."""
    rows, width = weight.shape
    block = GGUF_BLOCKS[qtype][1] * 256 // GGUF_BLOCKS[qtype][0]
    out = torch.empty((rows // 16, width // block, PACK_TILE_BYTES[qtype]), dtype=torch.uint8)
    torch.ops.tidewire.gguf_pack(out, weight.contiguous(), qtype)
    return out


def gguf_unpack(packed: torch.Tensor, qtype: int) -> torch.Tensor:
    """gguf_pack's inverse: the rows in the file's block layout again."""
    tiles, nb, _ = packed.shape
    out = torch.empty((tiles * 16, nb * GGUF_BLOCKS[qtype][1] * 256 // GGUF_BLOCKS[qtype][0]),
                      dtype=torch.uint8)
    torch.ops.tidewire.gguf_unpack(out, packed, qtype)
    return out


def gguf_packed_linear(x: torch.Tensor, packed: torch.Tensor, qtype: int,
                       bias: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for any number of rows of x [rows, in] and W packed by gguf_pack
    from `qtype` blocks; x is quantized to int8 as gguf_linear_small's int8_x does
    (gguf_x_group: per 256 values for the K types, per 32 for Q8_0).
    `out`: [rows, out], unit column stride (a column slice will do)."""
    if out is None:
        out = torch.empty((x.shape[0], packed.shape[0] * 16), dtype=x.dtype)
    torch.ops.tidewire.gguf_packed_linear(out, x, packed, qtype, bias)
    return out


def gguf_x_group(qtype: int) -> int:
    """How many values of a row of x share one int8 scale where gguf_linear_small (with
    int8_x) and gguf_packed_linear take x in int8 for `qtype` on this CPU: 256 for the K
    types, 64 for Q4_0/Q4_1, Q8_0 32 on AVX-512 VNNI (64 on AVX2)."""
    return int(torch.ops.tidewire.gguf_x_group(qtype))


def gguf_reads_int8(qtype: int, in_features: int) -> bool:
    """Whether gguf_linear_small, given int8_x, multiplies x as int8 for weights of type
    `qtype` with rows of `in_features` values on this CPU (AVX2: every type, the 32-value
    ones for rows of a multiple of 64, on AVX2 and AVX-512 VNNI alike; else none)."""
    return bool(torch.ops.tidewire.gguf_reads_int8(qtype, in_features))


def gguf_tiled() -> bool:
    """Whether gguf_linear_tiled runs here: the compiled kernels on a CPU with
    AVX512-BF16 (they are built with -march=native). Decided once (every GGUF matmul
    asks)."""
    if "tiled" not in _state:
        _state["tiled"] = available() and "avx512_bf16" in set(_cpu_identity().split())
    return bool(_state["tiled"])


def gguf_gemm_int8(qtype: int, in_features: int) -> bool:
    """Whether gguf_linear_tiled(..., int8_x=True) multiplies weights of type `qtype`
    (rows of `in_features` values, a multiple of 256) on the integer GEMM here: every
    type in GGUF_BLOCKS, on a CPU with AVX-512 VNNI and BF16, where AMX is not in use (its
    bf16 tiles lead there).
    Asked for every GGUF matmul: cached by (type, width, AMX on)."""
    key = f"gemm_int8:{qtype}:{in_features}:{amx()}"
    if key not in _state:
        _state[key] = gguf_tiled() and bool(torch.ops.tidewire.gguf_gemm_int8(qtype, in_features))
    return bool(_state[key])


def linear_int8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x (q * scale[:, None])^T (+ bias) for bf16 x [rows, in] with any number of rows
    and int8 weights q [out, in] with an fp32 scale a row (`--quantization int8`), where
    gguf_gemm_int8(8, in): x quantized to int8 per 256 values and multiplied as bytes on
    the integer GEMM (kernels/cpu/gguf_gemm.h), so batches need no bf16 copy of q."""
    out = torch.empty((x.shape[0], q.shape[0]), dtype=x.dtype)
    torch.ops.tidewire.linear_int8_gemm(out, x, q, scale, bias)
    return out


def amx(allow: bool | None = None) -> bool:
    """Whether the compiled kernels multiply on AMX tiles (the CPU has AMX-BF16 and Linux
    granted this process the tile state: kernels/cpu/amx.h): the GGUF tiled matmul and
    attention over many query rows. `allow` False or True turns their use off or back on
    first (tests reach the AVX-512 paths on an AMX CPU); TIDEWIRE_CPU_AMX=0 turns it off
    for the process (read when the kernels load)."""
    if not available():
        return False
    if allow is not None:
        _state["amx"] = bool(torch.ops.tidewire.cpu_amx(int(allow)))
    return bool(_state["amx"])


def gguf_linear_tiled(x: torch.Tensor, weight: torch.Tensor, qtype: int,
                      bias: torch.Tensor | None = None,
                      out: torch.Tensor | None = None,
                      int8_x: bool = False) -> torch.Tensor:
    """gguf_linear_small for bf16 x with any number of rows (where gguf_tiled()): the
    weight rows are dequantized a few at a time into a bf16 tile that stays in cache while
    every row of x is multiplied with it (fp32 sums), so a batch pays one dequantization
    a weight and reads the 4-bit weights once. Where amx(): 32 rows a tile, multiplied on
    AMX tiles while the next part of the tile is dequantized; else 16 rows a tile and
    vdpbf16ps. int8_x, where gguf_gemm_int8(qtype, in): x quantized to int8 as
    gguf_linear_small quantizes it, and the codes multiplied as bytes (vpdpbusd) with no
    bf16 copy of any weight (kernels/cpu/gguf_gemm.h): on a Zen 4, Q4_K 1.1-1.4x the
    packed bf16 GEMM of the same shape from 64 to 512 rows, every type 1.1-1.4x from 256
    rows (docs/cpu-engine.md)."""
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
    torch.ops.tidewire.gguf_linear_tiled(out, x, weight, qtype, bias, bool(int8_x))
    return out


def gguf_dequant(weight: torch.Tensor, qtype: int, in_features: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """The values of GGUF block-quantized rows (uint8 [n, row bytes]) as [n, in] in
    `dtype` (fp32 or bf16)."""
    out = torch.empty((weight.shape[0], in_features), dtype=dtype)
    torch.ops.tidewire.gguf_dequant(out, weight, qtype)
    return out


if __name__ == "__main__":  # `python -m kernels.cpu_ops`: build now (make install does)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"Tidewire CPU kernels: {'ready' if available() else 'unavailable (torch fallback)'}"
          f" ({build_dir()})")

"""A GGUF file's weights as the file stores them (`--quantization gguf`).

The file is memory-mapped; each 2-D tensor in a block type the compiled kernels read
(kernels/cpu/gguf_quant.h: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) stays a view of its bytes
(QuantWeight), never dequantized as a whole: the linears multiply by it as it is
(engine/models/layers.py GGUFLinear), the embedding dequantizes only the rows a step
looks up. Tensors in other types (the norms' F32, F16, rarer quantizations) are read
into torch tensors one at a time. So a model costs its file's size in memory (shared
with the page cache), not a dequantized copy.

Names map to HF's through engine/gguf_reader.py's tables (the families it reads: Llama,
Qwen2, Qwen3, Phi-3, SmolLM3); the rows of q and k of the Llama-family files, which
llama.cpp's converter interleaves, are put back in HF's order (a row permutation, so
block rows move as they are).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import gguf_reader

SOURCE_FILE = "tidewire_gguf.txt"  # in a native model directory: the GGUF's path


class _Stored(ABC):
    """What QuantWeight and PackedWeight share: a matrix of `rows` x `cols` values held
    as the bytes of `data`."""

    data: torch.Tensor
    cols: int

    @property
    @abstractmethod
    def rows(self) -> int: ...

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@dataclass(frozen=True)
class QuantWeight(_Stored):
    """A matrix [rows, cols] in a GGUF block type: `data` uint8 [rows, row bytes]."""

    qtype: int  # ggml's type id (kernels.cpu_ops.GGUF_BLOCKS)
    data: torch.Tensor
    cols: int
    mapped: bool = False  # `data` is a view of the mapped file (else memory of its own)

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from kernels import cpu_ops

        return cpu_ops.gguf_dequant(self.data, self.qtype, self.cols, dtype)

    def take_rows(self, index: torch.Tensor) -> QuantWeight:
        return QuantWeight(self.qtype, self.data.index_select(0, index), self.cols)

    def joined(self, after: QuantWeight) -> QuantWeight | None:
        """This matrix with `after`'s rows below, without copying either: where both are
        copies of their own (then one copy), or views of the file that lie back to back
        (then one view); None otherwise (copying would double a mapped matrix)."""
        if after.qtype != self.qtype or after.cols != self.cols:
            return None
        if not self.mapped and not after.mapped:
            return QuantWeight(self.qtype, torch.cat([self.data, after.data]), self.cols)
        if self.mapped and after.mapped and \
                self.data.data_ptr() + self.nbytes == after.data.data_ptr():
            rows, width = self.rows + after.rows, self.data.shape[1]
            return QuantWeight(self.qtype, self.data.as_strided((rows, width), (width, 1)),
                               self.cols, mapped=True)
        return None


@dataclass(frozen=True)
class PackedWeight(_Stored):
    """A Q4_K, Q6_K or Q8_0 matrix repacked once as tiles of 16 rows for the AVX-512 VNNI
    kernels (kernels/cpu/gguf_packed.h; cpu_ops.gguf_packed_linear multiplies it for any
    number of rows): `data` uint8 [rows / 16, cols / 256, tile bytes]. Q6_K's and Q8_0's
    tiles hold as many bytes as their blocks, Q4_K's 2.8% more (the six-bit scales as
    bytes)."""

    base: int  # the block type it was packed from (12, 14 or 8)
    data: torch.Tensor
    cols: int

    @property
    def qtype(self) -> int:  # the compiled decode step's name for it
        from kernels import cpu_ops

        return cpu_ops.PACKED + self.base

    @property
    def rows(self) -> int:
        return int(self.data.shape[0]) * 16

    def unpacked(self) -> QuantWeight:
        from kernels import cpu_ops

        return QuantWeight(self.base, cpu_ops.gguf_unpack(self.data, self.base), self.cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.unpacked().dequantize(dtype)

    @staticmethod
    def takes(w: Any) -> bool:
        """Whether `w` can be packed here: a Q4_K, Q6_K or Q8_0 QuantWeight of whole tiles, on a
        CPU whose kernels multiply packed tiles (AVX-512 VNNI); TIDEWIRE_GGUF_PACK=0:
        never."""
        from kernels import cpu_ops

        return (isinstance(w, QuantWeight) and w.qtype in PACKABLE and w.rows % 16 == 0
                and w.cols % 256 == 0 and os.environ.get("TIDEWIRE_GGUF_PACK", "1") != "0"
                and cpu_ops.available() and cpu_ops.gguf_packs(w.qtype))

    @classmethod
    def of(cls, w: QuantWeight) -> PackedWeight:
        """`w` packed; a view of the mapped file gives its pages back (they would count
        twice beside the packed copy, and read back from the file if touched)."""
        from kernels import cpu_ops

        packed = cls(w.qtype, cpu_ops.gguf_pack(w.data, w.qtype), w.cols)
        if w.mapped:
            _release_range(w.data.data_ptr(), w.nbytes)
        return packed


PACKABLE = (12, 14, 8)  # Q4_K, Q6_K, Q8_0


def kernel_types() -> frozenset[int]:
    from kernels import cpu_ops

    return frozenset(cpu_ops.GGUF_BLOCKS)


def native_supported(path: Path) -> str | None:
    """None if `path` can run with its weights as they are, else why not."""
    reader = gguf_reader._reader(path)
    arch = gguf_reader._architecture(reader)
    if arch not in gguf_reader.MODEL_TYPES:
        return (f"architecture {arch!r} (GGUF weights run as they are for "
                f"{sorted(gguf_reader.MODEL_TYPES)})")
    return None


def write_config(path: Path, out: Path) -> None:
    """config.json, the tokenizer and a pointer to `path`, without any weights."""
    import json

    reader = gguf_reader._reader(path)
    arch = gguf_reader._architecture(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = gguf_reader.hf_config(arch, gguf_reader._metadata(reader), tensors)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gguf_reader._tokenizer(path).save_pretrained(out)
    (out / SOURCE_FILE).write_text(str(path.resolve()) + "\n")


def source_of(model_dir: Path) -> Path | None:
    """The GGUF a native model directory stands for (None: an ordinary directory)."""
    f = model_dir / SOURCE_FILE
    return Path(f.read_text().strip()) if f.exists() else None


def load(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor | QuantWeight]:
    """The file's tensors under HF names: QuantWeights for the kernels' block types (2-D),
    torch tensors for the rest."""
    reader = gguf_reader._reader(path)
    arch = gguf_reader._architecture(reader)
    kinds = kernel_types()
    with warnings.catch_warnings():  # a read-only map: nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        # the whole file as one tensor: matrices are slices of it (so that neighbours can
        # be joined into one view, QuantWeight.joined)
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        whole = torch.from_numpy(mapped)
    out: dict[str, Any] = {}
    for t in reader.tensors:
        name = t.name
        if name in (gguf_reader.ROPE_FREQS, *gguf_reader.LONGROPE):
            continue  # in config.json as rope_parameters
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w: torch.Tensor | QuantWeight
        if int(t.tensor_type) in kinds and len(shape) == 3:  # [experts, rows, cols]
            start = int(t.data_offset)
            data = whole[start : start + int(t.n_bytes)].view(shape[0], shape[1], -1)
            experts = [QuantWeight(int(t.tensor_type), data[e], shape[2], mapped=True)
                       for e in range(shape[0])]
            probe = gguf_reader._hf_names(arch, name, torch.empty(shape[0], 0))
            out.update(zip(probe, experts))  # one name an expert, in expert order
            continue
        if int(t.tensor_type) in kinds and len(shape) == 2:
            start = int(t.data_offset)
            data = whole[start : start + int(t.n_bytes)].view(shape[0], -1)
            w = QuantWeight(int(t.tensor_type), data, shape[1], mapped=True)
        else:
            w = gguf_reader._dequantize(t)
        if arch in gguf_reader._PERMUTED and name.startswith("blk.") and (
                ".attn_q." in name or ".attn_k." in name):
            w = _unpermute(w, num_heads if ".attn_q." in name else num_kv_heads)
            if isinstance(w, QuantWeight):  # a copy in HF's row order: the mapped rows,
                _release(mapped, int(t.data_offset), int(t.n_bytes))  # read once, go
        if isinstance(w, QuantWeight):
            out.update(_named(arch, name, w))
        else:
            out.update(gguf_reader._hf_names(arch, name, w))
    return out


def _release(mapped: np.memmap, start: int, size: int) -> None:
    """Drop the pages of [start, start + size) of the file's map from this process (they
    stay in the page cache, and would read back from the file if touched): the bytes of a
    matrix that was copied out of the map, so that its rows do not count twice."""
    page = mmap.PAGESIZE
    a, b = -(-start // page) * page, (start + size) // page * page
    if b > a:
        mapped._mmap.madvise(mmap.MADV_DONTNEED, a, b - a)  # type: ignore[attr-defined]


def _release_range(address: int, size: int) -> None:
    """_release for the bytes at `address` of a read-only map of the file (the pages of a
    matrix that was repacked; they read back from the file if touched)."""
    page = mmap.PAGESIZE
    a, b = -(-address // page) * page, (address + size) // page * page
    if b > a:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), mmap.MADV_DONTNEED)


def _named(arch: str, name: str, w: QuantWeight) -> dict[str, QuantWeight]:
    """gguf_reader._hf_names for a QuantWeight (a 2-D tensor: one name)."""
    probe = gguf_reader._hf_names(arch, name, torch.empty(0))
    (hf_name,) = probe
    return {hf_name: w}


def _unpermute(w: torch.Tensor | QuantWeight, n_heads: int) -> torch.Tensor | QuantWeight:
    if isinstance(w, torch.Tensor):
        return gguf_reader._unpermute(w, n_heads)
    rows = w.rows
    order = torch.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).transpose(1, 2)
    return w.take_rows(order.reshape(-1))

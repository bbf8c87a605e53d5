"""The `cpu` attention backend: the compiled paged-attention kernel of
kernels/cpu_ops.py, or, where the platform cannot run it (engine/platform.py), a torch
fallback (SDPA over gathered cache blocks). The backend-neutral parts are in
engine/attention/base.py.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.base import (AttentionBackend, PagedMetadata, PrefillSpec, StepLayout,
                                   cascade_groups)
from kernels import cpu_ops
from kernels import reference as ref


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array of bytes (the last dimension in bytes):
    numpy has no bfloat16. Always a view (writes through it land in `t`): `t`'s last
    dimension must be contiguous, as the caches' and the tier blocks' are."""
    return t.view(torch.uint8).numpy()


HUGE_MIN_BYTES = 4 << 20  # a copy this large gets a mapping of its own (_huge_empty)


def _huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor for a large one-off copy (blocks on their way to the
    host tier): an anonymous mapping of its own, asked to use transparent huge pages
    (MADV_HUGEPAGE, where the kernel's THP setting is `madvise` or `always`).

    Buffers past glibc's 32 MB mmap threshold (runtime.tune_malloc) are fresh mappings
    each time, and a 4 KiB page costs ~4 us to fault in under a hypervisor: a 188-block
    snapshot (69 MB of SmolLM2 blocks) took 43-46 ms in torch.empty, 15 ms here (2-core
    Zen 4). Only these buffers: torch's own allocations with huge pages
    (THP_MEM_ALLOC_ENABLE=1) prefilled a 1B-class model 1-3% slower in three runs."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # (Linux)
    if advice is not None:
        with contextlib.suppress(OSError):  # (a kernel without THP: 4 KiB pages)
            buf.madvise(advice)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps `buf` alive


def bucket_decodes(num_blocks: list[int], min_rows: int = 8, ratio: float = 0.5,
                   max_buckets: int = 4) -> list[tuple[int, int]]:
    """Split decode rows (sorted by block count, non-increasing) into row ranges padded
    separately: a new range starts once a row needs at most `ratio` of the current
    range's longest, so short contexts stop paying for the longest one."""
    ranges: list[tuple[int, int]] = []
    start = 0
    for i, nb in enumerate(num_blocks):
        if (i - start >= min_rows and nb <= ratio * num_blocks[start]
                and len(ranges) < max_buckets - 1):
            ranges.append((start, i))
            start = i
    if num_blocks:
        ranges.append((start, len(num_blocks)))
    return ranges


@dataclass
class DecodeBucket:
    start: int
    end: int
    block_ids: torch.Tensor  # [rows * max_blocks] int64: the padded block table, flat
    mask: torch.Tensor | None  # [rows, 1, 1, max_blocks * block_size] bool; None: no padding
    k_out: torch.Tensor  # gather target [kvh, rows * max_blocks, bs * d] (shared buffer)
    v_out: torch.Tensor
    k: torch.Tensor  # k_out viewed as [rows, kvh, max_blocks * bs, d]
    v: torch.Tensor
    lens: torch.Tensor  # [rows] int64: each row's context
    # per sliding window: `mask` also hiding keys before each row's window (_decode_mask)
    windowed: dict[int, torch.Tensor | None] = field(default_factory=dict)
    # per cache size: block_ids bounded to it (_bounded)
    bounded: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class CpuPrefill:
    q_start: int
    q_len: int
    ctx_len: int
    block_ids: torch.Tensor | None  # None: no cached context, attend to this step's k/v
    mask: torch.Tensor | None  # [q_len, ctx_len] bool when there is cached context
    # per sliding window: [q_len, ctx_len] bool, causal and within it (_prefill_mask)
    windowed: dict[int, torch.Tensor | None] = field(default_factory=dict)
    bounded: dict[int, torch.Tensor] = field(default_factory=dict)  # (as DecodeBucket's)


def _bounded(ids: torch.Tensor, num_blocks: int, memo: dict[int, torch.Tensor]) -> torch.Tensor:
    """`ids` for a cache of `num_blocks` blocks. A windowed layer of a model with global
    layers too has a cache of the full blocks only (block_manager.HybridPool); the ids
    past it in a table sit behind the window, where the mask hides whatever the gather
    reads, so they read block 0 instead. Once per step and cache size."""
    if num_blocks not in memo:
        memo[num_blocks] = ids.clamp(max=num_blocks - 1) \
            if ids.numel() and int(ids.max()) >= num_blocks else ids
    return memo[num_blocks]


@dataclass
class CpuMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    decodes: list[DecodeBucket]
    prefills: list[CpuPrefill]


class CpuAttention(AttentionBackend):
    """Attention for CPUs.

    Cache layout (per layer, K and V alike): [num_kv_heads, num_blocks, block_size,
    head_dim]. With the compiled kernels (kernels/cpu_ops.py) a whole step, decodes and
    prefill chunks alike, is one call that reads K/V in place. Without them (no compiler)
    the torch fallback gathers whole blocks (head-major, so an index_select yields
    [kv_heads, batch, tokens, head_dim] with no transpose) and runs SDPA with GQA.

    kv_cache_dtype "int8" (compiled kernels only): the q8 cache of kernels/cpu/kv_q8.h,
    uint8 [num_kv_heads, num_blocks, block_size * (head_dim + 4)], each block's rows of
    one-byte codes followed by their fp32 scales: (head_dim + 4) bytes a row against
    2 * head_dim for bf16, so ~1.9x the blocks in the same memory (head_dim 64) and
    decode attention reading about half as much.
    """

    name = "cpu"
    kv_cache_dtypes = ("auto", "int8")

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto", *,
                 compiled: bool):
        """`compiled`: run the compiled kernels (Platform.plan decides: they loaded, and
        take this dtype and head_dim)."""
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, dtype, kv_cache_dtype)
        self.compiled = compiled
        # shared-prefix (cascade) attention where a step's sequences share prefix blocks
        # and the cost rule says it pays (TIDEWIRE_CASCADE=0: never)
        self.cascade = os.environ.get("TIDEWIRE_CASCADE", "1") not in ("0", "false", "")
        self.cascade_steps = 0  # steps that took it (`tidewire bench cascade` reports it)
        self.q8 = kv_cache_dtype == "int8"
        # the kernel stacks many query rows on AMX tiles (bf16 K/V and q): the cost rule's
        # thresholds differ with it
        self._tiles = (compiled and not self.q8 and dtype == torch.bfloat16 and head_dim % 32 == 0
                       and cpu_ops.amx())
        if self.q8:
            if not compiled:
                raise ValueError("kv_cache_dtype int8 needs Tidewire's compiled CPU kernels (a "
                                 "C++ compiler; see docs/cpu-engine.md), fp32 or bf16 weights "
                                 f"and a head_dim in {cpu_ops.PAGED_HEAD_DIMS}")
            self.cache_dtype = torch.uint8
        # Gather buffers reused by every layer and step: a fresh multi-MB tensor per
        # gather costs page faults that take longer than the copy itself.
        self._bufs: dict[str, torch.Tensor] = {}

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.q8:
            return (self.num_kv_heads, num_blocks, self.block_size * (self.head_dim + 4))
        return (self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    def block_shape(self, num_layers: int) -> tuple[int, ...]:
        if self.q8:  # a block's bytes per (layer, K/V, KV head), as the cache holds them
            return (num_layers, 2, self.num_kv_heads, self.block_size * (self.head_dim + 4))
        return super().block_shape(num_layers)

    def gather_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        # One copy a block, by numpy (see scatter_blocks), straight into the canonical
        # layout: an index_select, then a permuted copy on the way to the tier, took
        # twice the memory traffic, on torch's OpenMP pool, on the engine thread.
        ids = block_ids.tolist()
        out = _huge_empty((len(ids), *self.block_shape(kv.shape[0])), kv.dtype)
        src, dst = _bytes(kv), _bytes(out)
        for j, b in enumerate(ids):
            if self.q8:  # [layers, 2, kv_heads, n, bytes] -> [n, layers, 2, kv_heads, bytes]
                np.copyto(dst[j], src[:, :, :, b])
            else:  # [layers, 2, kv_heads, n, bs, d] -> [n, layers, 2, bs, kv_heads, d]
                np.copyto(dst[j], src[:, :, :, b].transpose(0, 1, 3, 2, 4))
        return out

    def scatter_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor,
                       data: torch.Tensor) -> None:
        # A copy per block, by numpy: each moves runs of head_dim values between the two
        # layouts (one index_copy_ over all of them took 1.6x as long). numpy copies on
        # this thread without the GIL; torch's copies of this size run on its OpenMP pool,
        # and while a tier load streams in, Redis and the I/O thread hold the cores: a
        # 16-block chunk then waited for a descheduled pool thread, 13-30 ms instead of
        # ~1.5 (a 3,008-token Redis hit on the 2-core test machine).
        if data.dtype != kv.dtype:  # (bytes are copied as they are)
            raise TypeError(f"blocks of {data.dtype} for a {kv.dtype} cache")
        if data.stride(-1) != 1:  # (a source only: a copy of it is as good)
            data = data.contiguous()
        dst, src = _bytes(kv), _bytes(data)
        for j, b in enumerate(block_ids.tolist()):
            if self.q8:  # [n, layers, 2, kv_heads, bytes] -> [layers, 2, kv_heads, n, bytes]
                np.copyto(dst[:, :, :, b], src[j])
            else:  # [n, layers, 2, bs, kv_heads, d] -> [layers, 2, kv_heads, n, bs, d]
                np.copyto(dst[:, :, :, b], src[j].transpose(0, 1, 3, 2, 4))

    def build_metadata(self, layout: StepLayout) -> CpuMetadata | PagedMetadata:
        if self.compiled:
            return self._paged_meta(layout)
        bs = self.block_size
        nblocks = [-(-n // bs) for n in layout.decode_seq_lens]
        buckets, offset = [], 0
        for start, end in bucket_decodes(nblocks):
            width = nblocks[start]
            flat = [b for ids in layout.decode_block_ids[start:end]
                    for b in ids[:width] + [0] * (width - len(ids[:width]))]
            lens = torch.tensor(layout.decode_seq_lens[start:end])
            mask = None
            if int(lens.min()) < width * bs:
                mask = (torch.arange(width * bs)[None, :] < lens[:, None])[:, None, None, :]
            buckets.append(self._bucket(start, end, flat, width, mask, lens, offset))
            offset += len(flat)
        prefills = [self._prefill_meta(p) for p in layout.prefills]
        return CpuMetadata(torch.tensor(layout.slot_mapping, dtype=torch.int64), buckets, prefills)

    def _paged_meta(self, layout: StepLayout) -> PagedMetadata:
        bs = self.block_size
        tables = [ids[: -(-n // bs)] for ids, n in zip(layout.decode_block_ids,
                                                        layout.decode_seq_lens)]
        tables += [p.block_ids for p in layout.prefills]
        width = max((len(t) for t in tables), default=1)
        flat: list[int] = []
        for ids in tables:
            flat += ids
            flat += [0] * (width - len(ids))
        table = torch.tensor(flat, dtype=torch.int32).view(len(tables), width)
        lens = layout.decode_seq_lens + [p.ctx_len for p in layout.prefills]
        q_lens = [1] * len(layout.decode_seq_lens) + [p.q_len for p in layout.prefills]
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        return PagedMetadata(torch.tensor(layout.slot_mapping, dtype=torch.int64), table,
                             torch.tensor(lens, dtype=torch.int32),
                             torch.tensor(starts, dtype=torch.int32),
                             len(layout.decode_seq_lens), self._cascade(tables, lens, q_lens))

    # Shared-prefix attention's cost rule, measured on the compiled kernel with
    # `tidewire bench cascade` (bf16, 9/3 heads, decodes). A group's fixed cost is a second
    # pass and the merge; what it buys depends on the matrix unit.
    # - AMX (Xeon): it pays once the members save reading about 1,000 keys between them
    #   and the stacked queries fill the tile's 8-row minimum. Two members of 2,048 shared
    #   keys: 0.85x; 4 of 256: 1.08x; 8 of 256: 1.26x; 64 of 64: 1.15x; 64 of 2,048: 2.9x.
    # - AVX-512 without AMX (Zen 4): the shared keys of a chat prompt stay in L2/L3, so the
    #   plain decodes are not memory-bound and the stacked rows gain less. 8 of 256: 0.78x;
    #   64 of 64: 0.74x; 4 of 2,048: 1.01x; 16 of 256: 1.10x; 8 of 2,048: 1.22x; 64 of
    #   2,048: 1.55x. So at least 256 shared keys and 3,072 saved.
    CASCADE_MIN_ROWS = 8
    CASCADE_MIN_SAVED_KEYS = 1024  # with AMX
    CASCADE_MIN_SAVED_KEYS_VECTOR = 3072  # without: AVX-512 or AVX2 rows, fp32, an int8 cache
    CASCADE_MIN_SHARED_KEYS_VECTOR = 256

    def _cascade_pays(self, members: int, rows: int, keys: int) -> bool:
        """The cost rule above for one group: `members` sequences stacking `rows` query
        rows over `keys` shared keys."""
        if rows < self.CASCADE_MIN_ROWS:
            return False
        saved = (members - 1) * keys
        if self._tiles:
            return saved >= self.CASCADE_MIN_SAVED_KEYS
        return keys >= self.CASCADE_MIN_SHARED_KEYS_VECTOR and saved >= self.CASCADE_MIN_SAVED_KEYS_VECTOR

    def _cascade(self, tables: list[list[int]], lens: list[int],
                 q_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if not self.cascade or len(tables) < 2:
            return None
        members: list[int] = []
        offsets, shared = [0], []
        for group, keys in cascade_groups(tables, lens, q_lens, self.block_size):
            if self._cascade_pays(len(group), sum(q_lens[i] for i in group) * self.group, keys):
                members += group
                offsets.append(len(members))
                shared.append(keys)
        if not shared:
            return None
        self.cascade_steps += 1
        return (torch.tensor(members, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32),
                torch.tensor(shared, dtype=torch.int32))

    def _bucket(self, start: int, end: int, flat: list[int], width: int,
                mask: torch.Tensor | None, lens: torch.Tensor, offset: int) -> DecodeBucket:
        """Gather targets are carved from step-wide buffers once here, not per layer."""
        kvh, d, bs, n = self.num_kv_heads, self.head_dim, self.block_size, end - start
        outs = []
        for name in ("k", "v"):
            buf = self._buffer(name, kvh * (offset + len(flat)) * bs * d)
            region = buf[kvh * offset * bs * d : kvh * (offset + len(flat)) * bs * d]
            outs.append(region.view(kvh, len(flat), bs * d))
        views = [o.view(kvh, n, width * bs, d).transpose(0, 1) for o in outs]
        return DecodeBucket(start, end, torch.tensor(flat, dtype=torch.int64), mask,
                            outs[0], outs[1], views[0], views[1], lens)

    def _buffer(self, name: str, numel: int) -> torch.Tensor:
        """A reused flat buffer of at least `numel` elements. Growing it replaces the
        tensor, so views taken earlier in the same step keep the old storage alive."""
        store = self._bufs.get(name)
        if store is None or store.numel() < numel or store.dtype != self.dtype:
            store = self._bufs[name] = torch.empty(max(numel, 1 << 20), dtype=self.dtype)
        return store

    def _prefill_meta(self, p: PrefillSpec) -> CpuPrefill:
        if p.ctx_len == p.q_len:
            return CpuPrefill(p.q_start, p.q_len, p.ctx_len, None, None)
        rows = torch.arange(p.q_len)[:, None] + (p.ctx_len - p.q_len)  # query positions
        mask = torch.arange(p.ctx_len)[None, :] <= rows
        ids = torch.tensor(p.block_ids, dtype=torch.int64)
        return CpuPrefill(p.q_start, p.q_len, p.ctx_len, ids, mask)

    def write_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,  # type: ignore[override]  # noqa: E501 - this backend's metadata
                    v_cache: torch.Tensor, meta: CpuMetadata | PagedMetadata) -> None:
        # k, v: [num_tokens, kv_heads, head_dim] -> slots of the flat [kv_heads, slots, D]
        slots = meta.slot_mapping
        if self.q8:
            ref.q8_write(k_cache, v_cache, k, v, slots)
            return
        kv_heads, d = self.num_kv_heads, self.head_dim
        k_cache.view(kv_heads, -1, d)[:, slots] = k.transpose(0, 1)
        v_cache.view(kv_heads, -1, d)[:, slots] = v.transpose(0, 1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,  # type: ignore[override]  # noqa: E501 - this backend's metadata
                v_cache: torch.Tensor, meta: CpuMetadata | PagedMetadata,
                window: int = 0) -> torch.Tensor:
        if isinstance(meta, PagedMetadata):
            out = torch.empty(q.shape, dtype=q.dtype)
            cpu_ops.paged_attention(out, q, k_cache, v_cache, meta.block_table, meta.seq_lens,
                                    meta.query_start, self.scale, meta.num_decodes,
                                    window=window, cascade=meta.cascade if window == 0 else None)
            return out
        if not meta.prefills and len(meta.decodes) == 1:  # the common all-decode step
            return self._decode(q, k_cache, v_cache, meta.decodes[0], window)
        out = torch.empty_like(q)
        for b in meta.decodes:
            out[b.start : b.end] = self._decode(q[b.start : b.end], k_cache, v_cache, b, window)
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, p, window)
        return out

    def _gather(self, cache: torch.Tensor, block_ids: torch.Tensor, buf: str) -> torch.Tensor:
        """[kvh, num_blocks, bs, d] -> [kvh, numel(block_ids), bs * d], into the prefill
        gather buffer (valid until the next gather into it)."""
        kvh, nb, bs, d = cache.shape
        numel = kvh * block_ids.numel() * bs * d
        out = self._buffer(buf, numel)[:numel].view(kvh, block_ids.numel(), bs * d)
        return torch.index_select(cache.view(kvh, nb, bs * d), 1, block_ids, out=out)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=self.scale, enable_gqa=self.group > 1)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                b: DecodeBucket, window: int = 0) -> torch.Tensor:
        kvh, nb = k_cache.shape[0], k_cache.shape[1]
        ids = _bounded(b.block_ids, nb, b.bounded)
        torch.index_select(k_cache.view(kvh, nb, -1), 1, ids, out=b.k_out)
        torch.index_select(v_cache.view(kvh, nb, -1), 1, ids, out=b.v_out)
        # b.k, b.v: [n, kvh, L, d] strided views of the gathered blocks; SDPA takes them.
        mask = self._decode_mask(b, window)
        return self._sdpa(q.unsqueeze(2), b.k, b.v, mask).squeeze(2)  # [n, heads, d]

    @staticmethod
    def _decode_mask(b: DecodeBucket, window: int) -> torch.Tensor | None:
        """The bucket's mask, or under a sliding window that cuts into a row's context one
        that also hides each row's keys before lens - window; built once per step and
        window (the layers that share a window share it)."""
        if window <= 0:
            return b.mask
        if window not in b.windowed:
            lens = b.lens[:, None]
            kpos = torch.arange(b.k.shape[2])[None, :]
            cut = int(b.lens.max()) > window
            b.windowed[window] = ((kpos < lens) & (kpos >= lens - window))[:, None, None, :] \
                if cut else b.mask
        return b.windowed[window]

    @staticmethod
    def _prefill_mask(p: CpuPrefill, window: int) -> torch.Tensor | None:
        """The chunk's mask (None: plain causal), or under a sliding window that cuts into
        its context one where the query at position t sees keys (t - window, t]."""
        if window <= 0 or p.ctx_len <= window:
            return p.mask
        if window not in p.windowed:
            qpos = torch.arange(p.q_len)[:, None] + (p.ctx_len - p.q_len)
            kpos = torch.arange(p.ctx_len)[None, :]
            p.windowed[window] = (kpos <= qpos) & (kpos > qpos - window)
        return p.windowed[window]

    def _prefill(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, p: CpuPrefill,
                 window: int = 0) -> torch.Tensor:
        kvh, d = self.num_kv_heads, self.head_dim
        if p.block_ids is None:  # the whole context is this chunk: no cache read needed
            k, v = k_new.transpose(0, 1), v_new.transpose(0, 1)  # [kvh, T, d]
        else:
            ids = _bounded(p.block_ids, k_cache.shape[1], p.bounded)
            k = self._gather(k_cache, ids, "pk").view(kvh, -1, d)[:, : p.ctx_len]
            v = self._gather(v_cache, ids, "pv").view(kvh, -1, d)[:, : p.ctx_len]
        mask = self._prefill_mask(p, window)
        o = self._sdpa(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask,
                       causal=mask is None)
        return o[0].transpose(0, 1)

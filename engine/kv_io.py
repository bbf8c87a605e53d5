"""The host tier's I/O worker: one thread that runs lookups, reads and writes against a
tier (cache_store), loads before writes, and encodes / decodes block payloads there.

It holds the tier, the payload format and the counters, nothing of the engine's: the
engine-side manager (engine/kv_offload.py) queues jobs and reads their results, so a
worker still running never keeps the model's weights or KV pool alive."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from cache_store import CorruptValue, KVTier, decode_block, encode_block
from cache_store.codec import header_size
from engine.request import Request
from engine.runner import BlockCopy

log = logging.getLogger("tidewire.kv_offload")

KEY_PREFIX = "tw:kv:v1"
# A load reads its values in chunks, one round trip each (a Redis pipeline), into a
# chunk buffer it hands to the engine thread, which copies the blocks into the pool
# while the next chunk is read: at most LOAD_CHUNK values and LOAD_CHUNK_BYTES a chunk
# (16 blocks of a 135M model's bf16 KV are 6 MB; an 8B model's take 4 a chunk), and
# LOAD_BUFFERS buffers in turn, allocated and touched once (faulting in fresh pages for
# every load cost more than the copies).
LOAD_CHUNK = 16
LOAD_CHUNK_BYTES = 8 << 20
LOAD_BUFFERS = 4


def tier_key(fingerprint: bytes, chain_hash: bytes) -> str:
    """`tw:kv:v1:{fingerprint}:{chain_hash}` (hex). The chain hash already covers the
    tenant salt and every token of the prefix."""
    return f"{KEY_PREFIX}:{fingerprint.hex()}:{chain_hash.hex()}"


@dataclass(frozen=True)
class BlockFormat:
    """What a block's payload is checked against when read (cache_store.codec)."""

    fingerprint: bytes
    dtype_name: str
    shape: tuple[int, ...]
    itemsize: int
    mac_key: bytes | None = field(default=None, repr=False)  # TierConfig.mac_key


class ChunkBuffer:
    """Room for `slots` stored values of one load's chunk. Each value sits in its own
    slot so that its payload starts on a 64-byte boundary: the payloads form one strided
    [slots, *block_shape] tensor (`blocks`), which the engine copies into the pool from
    directly."""

    def __init__(self, slots: int, fmt: BlockFormat, dtype: torch.dtype) -> None:
        hsize = header_size(fmt.mac_key)
        block_bytes = math.prod(fmt.shape) * fmt.itemsize
        pad = -(-hsize // 64) * 64  # where a payload starts in its slot
        step = -(-(pad + block_bytes) // 64) * 64
        self.block_bytes = block_bytes
        self.raw = torch.zeros(slots * step, dtype=torch.uint8)  # (touched: zeros)
        flat = memoryview(self.raw.numpy().data)
        # what the tier writes into: a whole stored value, header then payload
        self.values = [flat[i * step + pad - hsize : i * step + pad + block_bytes]
                       for i in range(slots)]
        self.blocks = self.raw.as_strided((slots, block_bytes), (step, 1), pad) \
            .view(dtype).view(slots, *fmt.shape)

    @property
    def slots(self) -> int:
        return len(self.values)


@dataclass(eq=False)
class LoadedChunk:
    buf: ChunkBuffer
    hashes: list[bytes]  # the checked blocks in buf's first slots, in order


@dataclass(eq=False)
class LoadJob:
    """One request's prefix on its way from the tier. The worker appends chunks as they
    arrive (and sets `arrived` after each), so the engine thread can put them into the
    pool while the next chunk is still on the wire; `done` once the last has arrived."""

    req: Request
    first: int  # index of the first block asked for (those before are on the device)
    hashes: list[bytes]
    keys: list[str]
    deadline: float
    # appended by the worker (under `lock`, against `cancelled`); the engine thread reads
    # a length, then the chunks before it (a list append is atomic under the GIL)
    chunks: list[LoadedChunk] = field(default_factory=list)
    taken: int = 0  # chunks the engine thread has put into the pool
    given: int = 0  # chunks whose buffers went back to the worker
    inserted: int = 0  # blocks in those chunks
    done: bool = False
    cancelled: bool = False
    found: int = -1  # whether the tier has the first block (0 or 1), once looked up (then
    # looked_up set)
    looked_up: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def num_arrived(self) -> int:
        return sum(len(c.hashes) for c in self.chunks)


@dataclass(eq=False)
class WriteJob:
    hashes: list[bytes]
    data: BlockCopy  # [n, *block_shape], a private copy (maybe still in flight)


@dataclass
class OffloadStats:
    loads: int = 0  # tier loads started
    load_blocks: int = 0  # blocks that arrived
    load_bytes: int = 0
    load_seconds: float = 0.0  # worker time spent loading (sum)
    load_timeouts: int = 0
    corrupt: int = 0  # values rejected by the codec (and deleted)
    written_blocks: int = 0
    dropped_writes: int = 0  # blocks not written: the write queue was full


class TierWorker:
    """The I/O thread and its two queues. Writes are admitted against a bound on the
    blocks queued or being written (`reserve`); past it they are dropped (the tier is a
    cache), or the caller waits (a flush at shutdown)."""

    def __init__(self, tier: KVTier, fmt: BlockFormat, stats: OffloadStats,
                 max_pending_writes: int, dtype: torch.dtype) -> None:
        """`dtype`: the payloads' element type (the KV cache's)."""
        self.tier, self.fmt, self.stats = tier, fmt, stats
        value_bytes = header_size(fmt.mac_key) + math.prod(fmt.shape) * fmt.itemsize
        slots = max(1, min(LOAD_CHUNK, LOAD_CHUNK_BYTES // value_bytes))
        self._free_bufs: queue.SimpleQueue[ChunkBuffer] = queue.SimpleQueue()
        for _ in range(LOAD_BUFFERS):
            self._free_bufs.put(ChunkBuffer(slots, fmt, dtype))
        self.max_pending_writes = max_pending_writes
        self.arrived = threading.Event()  # set whenever a load is done
        self.pending_writes = 0  # blocks queued or being written (under _cv)
        self._cv = threading.Condition()
        self._load_q: deque[LoadJob] = deque()
        self._write_q: deque[WriteJob] = deque()
        self._stopping = False
        self.thread = threading.Thread(target=self._work, name="tidewire-kv-io", daemon=True)
        self.thread.start()

    # -- the engine thread's side ------------------------------------------------------------

    def load(self, job: LoadJob) -> None:
        with self._cv:
            self._load_q.append(job)
            self._cv.notify()

    def give_back(self, job: LoadJob, cancel: bool = False) -> None:
        """The buffers of the chunks the engine thread has taken (job.taken) come back;
        with `cancel`, the job ends here and the chunks it did not take come back too
        (the worker gives back what it reads after this itself)."""
        with job.lock:
            if cancel:
                job.cancelled = True
                job.taken = len(job.chunks)
            for c in job.chunks[job.given : job.taken]:
                self._free_bufs.put(c.buf)
            job.given = job.taken

    def reserve(self, n: int, wait_until: float = 0.0) -> bool:
        """Room for n more blocks in the write queue; waits up to `wait_until` (a
        monotonic deadline) for it, else counts them as dropped and says no."""
        with self._cv:
            while self.pending_writes + n > self.max_pending_writes \
                    and time.monotonic() < wait_until:
                self._cv.wait(wait_until - time.monotonic())
            if self.pending_writes + n > self.max_pending_writes:
                self.stats.dropped_writes += n
                return False
            self.pending_writes += n
            return True

    def write(self, jobs: list[WriteJob]) -> None:
        """Queue writes whose blocks were reserved."""
        with self._cv:
            self._write_q.extend(jobs)
            self._cv.notify_all()

    def drain(self, deadline: float) -> None:
        """Wait until every queued write is done, or the deadline."""
        with self._cv:
            while self.pending_writes and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())

    def stop(self) -> None:
        """Let the thread exit once its queues are empty, without waiting for it."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    # -- the I/O thread ---------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            self.tier.warm()
        except Exception:  # noqa: BLE001 - a tier that raises is a miss later, not a dead thread
            log.exception("kv tier warm-up failed")
        while True:
            with self._cv:
                while not (self._load_q or self._write_q or self._stopping):
                    self._cv.wait()
                if self._load_q:
                    job: LoadJob | WriteJob = self._load_q.popleft()
                elif self._write_q:
                    job = self._write_q.popleft()
                else:
                    return
            try:
                self._load(job) if isinstance(job, LoadJob) else self._write(job)
            except Exception:  # noqa: BLE001 - the worker must survive anything a tier does
                log.exception("kv tier I/O failed")
                if isinstance(job, LoadJob):
                    job.done = True  # (what did arrive is used)
                    self.arrived.set()
                else:
                    self._written(job, 0)

    def _load(self, job: LoadJob) -> None:
        """Read the job's blocks a chunk at a time, each value straight into a chunk
        buffer's slot, checked, and handed over as it arrives. Only the first key is
        looked up (a miss, the common case, answers the engine's short wait); the reads
        say where the tier's run of blocks ends (the first value missing), so no round
        trip asks about every key."""
        t0 = time.monotonic()
        if not job.cancelled:
            job.found = self.tier.lookup(job.keys[:1])
            job.looked_up.set()
        pos = 0 if job.found > 0 else len(job.keys)
        while pos < len(job.keys):
            buf = self._buffer_for(job)
            if buf is None:
                break
            part = job.keys[pos : pos + buf.slots]
            good: list[bytes] = []
            try:
                good = self._read_chunk(job, pos, part, buf)
            finally:  # (also when the tier raised: the buffer is never lost)
                with job.lock:
                    if good and not job.cancelled:
                        job.chunks.append(LoadedChunk(buf, good))
                    else:
                        self._free_bufs.put(buf)
            pos += len(part)
            if len(good) < len(part):
                break
            self.arrived.set()
        self.stats.load_seconds += time.monotonic() - t0
        job.done = True
        self.arrived.set()

    def _read_chunk(self, job: LoadJob, pos: int, part: list[str], buf: ChunkBuffer) -> list[bytes]:
        """The values of keys `part` (from job.keys[pos]) read into buf and checked: the
        hashes of the leading run that arrived whole and sound."""
        f = self.fmt
        good = []
        values = buf.values[: len(part)]
        for key, h, n, value in zip(part, job.hashes[pos:], self.tier.get_into(part, values),
                                    values):
            if n is None:
                break  # gone (or never there): recompute from here
            try:
                if n > len(value):
                    raise CorruptValue("longer than a block")
                decode_block(value[:n], f.fingerprint, h, f.dtype_name, f.shape, f.itemsize,
                             f.mac_key)
            except CorruptValue as e:
                log.warning("corrupt kv block %s (%s): deleted", key, e)
                self.stats.corrupt += 1
                self.tier.delete([key])
                break
            good.append(h)
        self.stats.load_blocks += len(good)
        self.stats.load_bytes += len(good) * buf.block_bytes
        return good

    def _buffer_for(self, job: LoadJob) -> ChunkBuffer | None:
        """A free chunk buffer (the engine thread gives them back as it empties them);
        None once the job is cancelled or the worker stops."""
        while not (job.cancelled or self._stopping):
            try:
                return self._free_bufs.get(timeout=0.05)
            except queue.Empty:
                continue
        return None

    def _write(self, job: WriteJob) -> None:
        f = self.fmt
        raw = job.data.wait().view(torch.uint8).reshape(len(job.hashes), -1).numpy()
        items = [(tier_key(f.fingerprint, h),
                  encode_block(f.fingerprint, h, f.dtype_name, f.shape, raw[i], f.mac_key))
                 for i, h in enumerate(job.hashes)]
        self._written(job, self.tier.put_many(items))

    def _written(self, job: WriteJob, stored: int) -> None:
        with self._cv:
            self.pending_writes -= len(job.hashes)
            self.stats.written_blocks += stored
            self._cv.notify_all()

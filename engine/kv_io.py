"""The host tier's I/O worker: one thread that runs lookups, reads and writes against a
tier (cache_store), loads before writes, and encodes / decodes block payloads there.

It holds the tier, the payload format and the counters, nothing of the engine's: the
engine-side manager (engine/kv_offload.py) queues jobs and reads their results, so a
worker still running never keeps the model's weights or KV pool alive."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from cache_store import CorruptValue, KVTier, decode_block, encode_block
from engine.request import Request
from engine.runner import BlockCopy

log = logging.getLogger("tidewire.kv_offload")

KEY_PREFIX = "tw:kv:v1"


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


@dataclass(eq=False)
class LoadJob:
    req: Request
    first: int  # index of the first block asked for (those before are on the device)
    hashes: list[bytes]
    keys: list[str]
    deadline: float
    payloads: list[memoryview] | None = None  # set by the worker, then done
    done: bool = False
    cancelled: bool = False
    found: int = -1  # the tier's contiguous hit count, once looked up (then looked_up set)
    looked_up: threading.Event = field(default_factory=threading.Event)


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
                 max_pending_writes: int) -> None:
        self.tier, self.fmt, self.stats = tier, fmt, stats
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
                    job.payloads, job.done = [], True
                    self.arrived.set()
                else:
                    self._written(job, 0)

    def _load(self, job: LoadJob) -> None:
        t0 = time.monotonic()
        payloads: list[memoryview] = []
        f = self.fmt
        if not job.cancelled:
            job.found = n = self.tier.lookup(job.keys)
            job.looked_up.set()
            vals = self.tier.get_many(job.keys[:n]) if n and not job.cancelled else []
            for key, h, v in zip(job.keys, job.hashes, vals):
                if v is None:
                    break  # gone since the lookup: recompute from here
                try:
                    payloads.append(decode_block(v, f.fingerprint, h, f.dtype_name, f.shape,
                                                 f.itemsize, f.mac_key))
                except CorruptValue as e:
                    log.warning("corrupt kv block %s (%s): deleted", key, e)
                    self.stats.corrupt += 1
                    self.tier.delete([key])
                    break
        st = self.stats
        st.load_seconds += time.monotonic() - t0
        st.load_blocks += len(payloads)
        st.load_bytes += sum(len(p) for p in payloads)
        job.payloads = payloads
        job.done = True
        self.arrived.set()

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

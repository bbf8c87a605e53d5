"""Moving full KV blocks between the device pool and a host tier (cache_store).

Engine thread (all bookkeeping, all KV tensor access):
- a cached block the pool evicts is copied out before anything overwrites it (write-back);
  with write-through, prompt blocks are copied as soon as they are full. Only the copy's
  first half, a gather into a private device tensor, runs before the step's forward
  (capture); its move to pinned host memory and the hand-off to the I/O thread wait
  until the forward is under way (ship);
- at admission, `start` asks the tier for the request's blocks past its device hits and
  the request waits in LOADING; `poll` (each schedule) puts what arrived into free
  device blocks under their hashes, where the admission finds them as ordinary prefix
  hits. A load that fails, comes back short or passes its deadline leaves the request to
  recompute from the last block that did arrive.

I/O worker thread: lookups, reads (decoded and checked here: a corrupt value is a miss
and is deleted), and writes (encoded here), loads before writes. A remote tier (Redis)
is never called from the engine thread, which at most waits on a lookup's answer within
a 2 ms budget per step: a slow or dead Redis cannot stall a step longer. An in-process
tier answers the first-block lookup inline (a dict probe under a lock).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np
import torch

from cache_store import CorruptValue, KVTier, decode_block, encode_block
from engine.block_manager import KVCacheManager
from engine.config import TierConfig
from engine.request import Request
from engine.runner import BlockCopy, ModelRunner

log = logging.getLogger("tidewire.kv_offload")

KEY_PREFIX = "tw:kv:v1"
LAYOUT = "layers,2,block_size,kv_heads,head_dim;v1"  # canonical block layout of the payload
_KNOWN_LIMIT = 1 << 18  # hashes remembered as already in the tier (write dedupe)
_STAGING_BYTES = 64 << 20
_LOOKUP_WAIT_PER_STEP = 0.002


def kv_fingerprint(model_id: str, weights_checksum: str, kv_dtype: str, block_size: int,
                   num_layers: int, num_kv_heads: int, head_dim: int) -> bytes:
    """sha256 over everything that decides a block's bytes, with length-prefixed fields
    (so no two field lists collide): blocks of another model, dtype, block size or
    layout can never be read."""
    h = hashlib.sha256()
    for f in ("tidewire.kv", LAYOUT, model_id, weights_checksum, kv_dtype, block_size,
              num_layers, num_kv_heads, head_dim):
        b = str(f).encode()
        h.update(len(b).to_bytes(4, "little") + b)
    return h.digest()


def tier_key(fingerprint: bytes, chain_hash: bytes) -> str:
    """`tw:kv:v1:{fingerprint}:{chain_hash}` (hex). The chain hash already covers the
    tenant salt and every token of the prefix."""
    return f"{KEY_PREFIX}:{fingerprint.hex()}:{chain_hash.hex()}"


@dataclass(eq=False)
class _Load:
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
class _Write:
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


class KVOffload:
    """The engine's side of the host tier; implements the scheduler's TierLoader."""

    def __init__(self, tier: KVTier, config: TierConfig, kv: KVCacheManager,
                 runner: ModelRunner, fingerprint: bytes) -> None:
        self.tier, self.config, self.kv, self.runner = tier, config, kv, runner
        self.fingerprint = fingerprint
        self.shape = runner.block_shape()
        self.dtype = runner.kv_caches[0][0].dtype
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.itemsize = self.dtype.itemsize
        self.stats = OffloadStats()
        self._loads: dict[str, _Load] = {}
        self._evicted: list[tuple[int, bytes]] = []
        self._captured: list[tuple[list[bytes], torch.Tensor]] = []  # snapshots to ship
        self._known: OrderedDict[bytes, None] = OrderedDict()  # hashes the tier has
        self._cv = threading.Condition()
        self._load_q: deque[_Load] = deque()
        self._write_q: deque[_Write] = deque()
        self._pending_writes = 0  # blocks queued or being written
        self._stopping = False
        self._arrived = threading.Event()
        self._waited = 0.0  # seconds spent this step waiting on lookups
        # Loads land here before going into the cache: allocated and touched once, since
        # faulting in tens of fresh MB per load cost more than the copies themselves.
        block_bytes = math.prod(self.shape) * self.itemsize
        n = max(1, min(kv.pool.num_blocks, _STAGING_BYTES // block_bytes))
        self._staging = torch.zeros((n, *self.shape), dtype=self.dtype)
        self._staging_bytes = self._staging.view(torch.uint8).reshape(n, -1).numpy()
        kv.pool.on_evict = self._on_evict
        if config.write_through:
            kv.new_prompt_blocks = []
        self._thread = threading.Thread(target=self._work, name="tidewire-kv-io", daemon=True)
        self._thread.start()

    # -- TierLoader (engine thread) ---------------------------------------------------------

    def start(self, req: Request, num_device_blocks: int) -> bool:
        bs = self.kv.block_size
        num_full = (req.num_tokens - 1) // bs  # at least one token is left to compute
        if num_full <= num_device_blocks:
            return False
        self.kv.update_hashes(req)
        hashes = req.block_hashes[num_device_blocks:num_full]
        keys = [tier_key(self.fingerprint, h) for h in hashes]
        if self.tier.local and not self.tier.lookup(keys[:1]):
            return False  # in-process: a miss costs nothing, skip the LOADING round
        job = _Load(req, num_device_blocks, hashes, keys,
                    time.monotonic() + self.config.load_timeout)
        with self._cv:
            self._load_q.append(job)
            self._cv.notify()
        if self._lookup_misses(job):
            return False  # nothing in the tier: admit it now instead of a LOADING round
        self._loads[req.request_id] = job
        self.stats.loads += 1
        return True

    def new_step(self) -> None:
        """Reset the per-step budget for waiting on lookups (called before schedule)."""
        self._waited = 0.0

    def _lookup_misses(self, job: _Load) -> bool:
        """Wait briefly for a remote lookup: a miss (the common case) answered within
        the step's small budget (2 ms in all, ~0.2 ms a lookup on a LAN) keeps the
        request out of LOADING, which would cost it a whole step. A slow Redis costs at
        most the budget per step, then requests go LOADING as usual."""
        left = _LOOKUP_WAIT_PER_STEP - self._waited
        if left > 0 and not job.looked_up.is_set():
            t0 = time.monotonic()
            job.looked_up.wait(left)
            self._waited += time.monotonic() - t0
        if job.looked_up.is_set() and job.found == 0:
            job.cancelled = True
            return True
        return False

    def poll(self) -> list[Request]:
        ended = []
        now = time.monotonic()
        for rid, job in list(self._loads.items()):
            if job.done:
                self._insert(job)
            elif now > job.deadline:
                job.cancelled = True
                self.stats.load_timeouts += 1
            else:
                continue
            del self._loads[rid]
            ended.append(job.req)
        return ended

    def cancel(self, req: Request) -> None:
        job = self._loads.pop(req.request_id, None)
        if job is not None:
            job.cancelled = True

    def wait(self, timeout: float) -> None:
        """Block the engine thread until a load arrives (when nothing else can run)."""
        self._arrived.wait(timeout)
        self._arrived.clear()

    def _insert(self, job: _Load) -> None:
        """Put the loaded blocks into free device blocks, cached under their hashes and
        left free (the request's admission takes them as prefix hits)."""
        pool = self.kv.pool
        todo = []
        for h, payload in zip(job.hashes, job.payloads or ()):
            if pool.lookup(h) is None:  # (another request may have computed it meanwhile)
                todo.append((h, payload))
        job.req.num_host_cached_tokens = len(job.payloads or ()) * self.kv.block_size
        # Hold the prefix already on the device: it is the oldest free memory, the first
        # thing the allocation below would evict, breaking the chain it continues.
        held = []
        for h in job.req.block_hashes[: job.first]:
            b = pool.lookup(h)
            if b is None:
                break
            held.append(b)
        pool.touch(held)
        todo = todo[: max(0, pool.num_free - 1)]
        blocks = pool.allocate(len(todo)) if todo else []
        self.capture()  # blocks this allocation evicted: copy them before overwriting
        step = len(self._staging)
        for i in range(0, len(blocks), step):
            part = todo[i : i + step]
            self.runner.write_blocks([b.block_id for b in blocks[i : i + step]],
                                     self._stage(part))
        for b, (h, _) in zip(blocks, todo):
            pool.cache(b, h)
            self._remember(h)
        # Back to the free queue, the prefix's first block last (the last evicted).
        pool.free(list(reversed(blocks)))
        pool.free(list(reversed(held)))

    def _stage(self, todo: list[tuple[bytes, memoryview]]) -> torch.Tensor:
        """The payloads copied into the staging buffer: [n, *block_shape]."""
        flat = self._staging_bytes
        size = flat.shape[1]
        for i, (_, payload) in enumerate(todo):
            flat[i] = np.frombuffer(payload, dtype=np.uint8, count=size)
        return self._staging[: len(todo)]

    # -- writes (engine thread side) ----------------------------------------------------------

    def _on_evict(self, block_id: int, block_hash: bytes) -> None:
        if block_hash not in self._known:
            self._evicted.append((block_id, block_hash))

    def capture(self) -> None:
        """Snapshot the blocks evicted since the last call (one gather on the device);
        must run before the model (or a load) writes into them. ship() sends them on."""
        if self._evicted:
            ev, self._evicted = self._evicted, []
            self._snapshot([h for _, h in ev], [b for b, _ in ev], block=False)

    @property
    def captured(self) -> bool:
        """Whether snapshots wait for ship()."""
        return bool(self._captured)

    def ship(self) -> None:
        """Start the host copies of the snapshots taken since the last call and queue
        them for the I/O thread. The engine calls this once the step's forward is under
        way (after the step's socket hand-off), where the thread would otherwise only
        wait for the device."""
        if self._captured:
            captured, self._captured = self._captured, []
            writes = [_Write(hashes, self.runner.to_host(blocks)) for hashes, blocks in captured]
            with self._cv:
                self._write_q.extend(writes)
                self._cv.notify_all()

    def write_through(self) -> None:
        """Queue the prompt blocks that became full this step (write-through mode)."""
        fresh = self.kv.new_prompt_blocks
        if fresh:
            todo = [(b, h) for b, h in fresh if h not in self._known]
            fresh.clear()
            if todo:
                self._snapshot([h for _, h in todo], [b for b, _ in todo], block=False)
                self.ship()

    def flush(self, timeout: float = 30.0) -> int:
        """Write every cached device block the tier does not have yet and wait for the
        queue to drain (graceful shutdown). Returns the number of blocks queued."""
        self.capture()
        self.ship()
        todo = [(b.block_id, h) for h, b in self.kv.pool.cached.items() if h not in self._known]
        deadline = time.monotonic() + timeout
        for i in range(0, len(todo), 64):
            part = todo[i : i + 64]
            self._snapshot([h for _, h in part], [b for b, _ in part], block=True,
                           deadline=deadline)
            self.ship()
        with self._cv:
            while self._pending_writes and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())
        return len(todo)

    def _snapshot(self, hashes: list[bytes], block_ids: list[int], block: bool,
                  deadline: float = 0.0) -> None:
        """Reserve room in the write queue (or drop the blocks: the tier is a cache) and
        take their device snapshot."""
        with self._cv:
            limit = self.config.max_pending_writes
            while block and self._pending_writes + len(hashes) > limit \
                    and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())
            if self._pending_writes + len(hashes) > limit:
                self.stats.dropped_writes += len(hashes)
                return
            self._pending_writes += len(hashes)
        self._captured.append((hashes, self.runner.snapshot_blocks(block_ids)))
        for h in hashes:
            self._remember(h)

    def _remember(self, h: bytes) -> None:
        known = self._known
        known[h] = None
        known.move_to_end(h)
        if len(known) > _KNOWN_LIMIT:
            known.popitem(last=False)

    # -- the I/O worker ------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cv:
                while not (self._load_q or self._write_q or self._stopping):
                    self._cv.wait()
                if self._load_q:
                    job: _Load | _Write = self._load_q.popleft()
                elif self._write_q:
                    job = self._write_q.popleft()
                else:
                    return
            try:
                self._load(job) if isinstance(job, _Load) else self._write(job)
            except Exception:  # noqa: BLE001 - the worker must survive anything a tier does
                log.exception("kv tier I/O failed")
                if isinstance(job, _Load):
                    job.payloads, job.done = [], True
                    self._arrived.set()
                else:
                    self._written(job, 0)

    def _load(self, job: _Load) -> None:
        t0 = time.monotonic()
        payloads: list[memoryview] = []
        if not job.cancelled:
            job.found = n = self.tier.lookup(job.keys)
            job.looked_up.set()
            vals = self.tier.get_many(job.keys[:n]) if n and not job.cancelled else []
            for key, h, v in zip(job.keys, job.hashes, vals):
                if v is None:
                    break  # gone since the lookup: recompute from here
                try:
                    payloads.append(decode_block(v, self.fingerprint, h, self.dtype_name,
                                                 self.shape, self.itemsize))
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
        self._arrived.set()

    def _write(self, job: _Write) -> None:
        raw = job.data.wait().view(torch.uint8).reshape(len(job.hashes), -1).numpy()
        items = [(tier_key(self.fingerprint, h),
                  encode_block(self.fingerprint, h, self.dtype_name, self.shape, raw[i]))
                 for i, h in enumerate(job.hashes)]
        self._written(job, self.tier.put_many(items))

    def _written(self, job: _Write, stored: int) -> None:
        with self._cv:
            self._pending_writes -= len(job.hashes)
            self.stats.written_blocks += stored
            self._cv.notify_all()

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker (after the writes already queued) and close the tier."""
        self.ship()
        self.stop()
        self._thread.join(timeout=30)
        self.tier.close()
        self.kv.pool.on_evict = None  # no cycle left: freed as soon as the engine is

    def stop(self) -> None:
        """Let the worker exit once its queues are empty, without waiting for it. The
        running worker holds this object (and through it the runner's weights and KV
        pool), so an engine that is dropped without close() calls this to be freed."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

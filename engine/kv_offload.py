"""Moving full KV blocks between the device pool and a host tier (cache_store).

Engine thread (all bookkeeping, all KV tensor access):
- a cached block the pool evicts is copied out before anything overwrites it (write-back);
  with write-through, prompt blocks are copied as soon as they are full. Only the copy's
  first half, a gather into a private device tensor, runs before the step's forward
  (capture); its move to pinned host memory and the hand-off to the I/O thread wait
  until the forward is under way (ship);
- at admission, `start` asks the tier for the request's blocks past its device hits and
  the request waits in LOADING; the I/O thread hands the blocks over a chunk at a time,
  and `poll` (each schedule, and each time a chunk lands while nothing else runs) puts
  what arrived into free device blocks under their hashes while the next chunk is read.
  Once the last has arrived the admission finds them as ordinary prefix hits. A load
  that fails, comes back short or passes its deadline leaves the request to recompute
  from the last block that did arrive.

I/O worker thread (engine/kv_io.py): lookups, reads (decoded and checked there: a
corrupt value is a miss and is deleted), and writes (encoded there), loads before
writes. A remote tier (Redis) is never called from the engine thread, which at most
waits on a lookup's answer within a 2 ms budget per step: a slow or dead Redis cannot
stall a step longer. An in-process tier answers the first-block lookup inline (a dict
probe under a lock).

The pool's eviction hook is an EvictionLog, given to the block manager when it is built:
it only records (block, hash) pairs, and `capture` takes them.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import OrderedDict
from typing import Any

import torch

from cache_store import KVTier
from cache_store.codec import header_size
from engine.block_manager import KVCacheManager
from engine.config import TierConfig
from engine.kv_io import (BlockFormat, LoadedChunk, LoadJob, OffloadStats, TierWorker, WriteJob,
                          tier_key)
from engine.request import Request
from engine.runner import ModelRunner
from engine.stats import OffloadCounters, TierCounters

log = logging.getLogger("tidewire.kv_offload")

LAYOUT = "layers,2,block_size,kv_heads,head_dim;v1"  # canonical block layout of the payload
# hashes remembered as already in the tier (write dedupe), at most: ~170 B each
# (tracemalloc: a 65 B hash object and a 107 B ordered-dict entry), so ~45 MB when full.
# A tier of known size caps it lower: past the number of blocks the tier holds, the
# oldest entries are surely stale.
_KNOWN_LIMIT = 1 << 18
_LOOKUP_WAIT_PER_STEP = 0.002
UNKEYED_REDIS_WARNING = (
    "kv tier redis without --kv-tier-secret: the tier trusts whoever can write Redis (a "
    "forged block would be served as cached KV and could steer outputs), and block keys "
    "are plain hashes of the prompts (whoever can read Redis can test whether a prompt "
    "was cached); give every replica the same TIDEWIRE_KV_TIER_SECRET")


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


class EvictionLog:
    """The block pool's on_evict hook: records each evicted cached block until taken."""

    def __init__(self) -> None:
        self._items: list[tuple[int, bytes]] = []

    def __call__(self, block_id: int, block_hash: bytes) -> None:
        self._items.append((block_id, block_hash))

    def __bool__(self) -> bool:
        return bool(self._items)

    def take(self) -> list[tuple[int, bytes]]:
        items, self._items = self._items, []
        return items


class KVOffload:
    """The engine's side of the host tier; implements the scheduler's TierLoader."""

    def __init__(self, tier: KVTier, config: TierConfig, kv: KVCacheManager,
                 runner: ModelRunner, fingerprint: bytes, evicted: EvictionLog) -> None:
        """`evicted`: the hook the block manager's pool was built with."""
        self.tier, self.config, self.kv, self.runner = tier, config, kv, runner
        self.fingerprint = fingerprint
        self.shape = runner.block_shape()
        self.dtype = runner.kv_caches[0][0].dtype
        self.stats = OffloadStats()
        self._loads: dict[str, LoadJob] = {}
        self._evicted = evicted
        self._captured: list[tuple[list[bytes], torch.Tensor]] = []  # snapshots to ship
        self._known: OrderedDict[bytes, None] = OrderedDict()  # hashes the tier has
        self._waited = 0.0  # seconds spent this step waiting on lookups
        self.block_bytes = block_bytes = math.prod(self.shape) * self.dtype.itemsize
        cap = tier.capacity_bytes  # a stored value: the block's bytes behind a header
        self.known_limit = _KNOWN_LIMIT if cap is None else \
            max(1, min(_KNOWN_LIMIT, cap // (header_size(config.mac_key) + block_bytes)))
        if config.write_through:
            kv.new_prompt_blocks = []
        fmt = BlockFormat(fingerprint, str(self.dtype).removeprefix("torch."), self.shape,
                          self.dtype.itemsize, config.mac_key)
        if config.kind == "redis" and not config.secret:
            log.warning(UNKEYED_REDIS_WARNING)
        self.worker = TierWorker(tier, fmt, self.stats, config.max_pending_writes, self.dtype)

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
            self._forget(hashes)
            return False  # in-process: a miss costs nothing, skip the LOADING round
        job = LoadJob(req, num_device_blocks, hashes, keys,
                      time.monotonic() + self.config.load_timeout)
        self.worker.load(job)
        if self._lookup_misses(job):
            return False  # nothing in the tier: admit it now instead of a LOADING round
        self._loads[req.request_id] = job
        self.stats.loads += 1
        return True

    def new_step(self) -> None:
        """Reset the per-step budget for waiting on lookups (called before schedule)."""
        self._waited = 0.0

    def _lookup_misses(self, job: LoadJob) -> bool:
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
            self._forget(job.hashes)
            return True
        return False

    def poll(self) -> list[Request]:
        """Put what arrived since the last call into the pool; the requests whose loads
        ended (done, or past their deadline: they recompute what did not arrive)."""
        ended = []
        now = time.monotonic()
        for rid, job in list(self._loads.items()):
            done = job.done  # (read first: every chunk is in the list once it is set)
            self._insert(job)
            if done:
                self._finish(job)
            elif now > job.deadline:
                self.stats.load_timeouts += 1
                self._finish(job, cancel=True)
            else:
                continue
            del self._loads[rid]
            ended.append(job.req)
        return ended

    def cancel(self, req: Request) -> None:
        job = self._loads.pop(req.request_id, None)
        if job is not None:
            self.worker.give_back(job, cancel=True)

    def wait(self, timeout: float) -> None:
        """Block the engine thread until a load arrives (when nothing else can run)."""
        self.worker.arrived.wait(timeout)
        self.worker.arrived.clear()

    def _finish(self, job: LoadJob, cancel: bool = False) -> None:
        """The load is over (or, with `cancel`, given up): what was put into the pool is
        the request's host-cached prefix (its admission takes those blocks as prefix
        hits); the tier lacks the rest, or was too slow to tell."""
        if cancel:
            self.worker.give_back(job, cancel=True)
        reach = len(self._chain(job)) - job.first  # (what of the load the admission will hit)
        job.req.num_host_cached_tokens = max(0, reach) * self.kv.block_size
        if job.found >= 0:
            self._forget(job.hashes[job.inserted:])

    def _chain(self, job: LoadJob) -> list:
        """The pool's blocks of the request's chain from its first block: the device's
        prefix, then what the load put in, up to the first one missing. Blocks put in are
        free between polls, so another request's allocation may have evicted one."""
        pool = self.kv.pool
        held = []
        for h in job.req.block_hashes[: job.first] + job.hashes[: job.inserted]:
            b = pool.lookup(h)
            if b is None:
                break
            held.append(b)
        return held

    def _insert(self, job: LoadJob) -> None:
        """Put the chunks that arrived since the last call into the pool and give their
        buffers back to the worker."""
        n = len(job.chunks)
        while job.taken < n:
            self._insert_chunk(job, job.chunks[job.taken])
            job.taken += 1
        self.worker.give_back(job)

    def _insert_chunk(self, job: LoadJob, chunk: LoadedChunk) -> None:
        """One chunk's blocks into free device blocks, cached under their hashes and left
        free: the request holds nothing while it waits, and the blocks join the free
        queue's tail, the chain's first block last (the last evicted)."""
        pool = self.kv.pool
        # Hold the chain so far while this allocation makes room: the device's prefix and
        # the blocks earlier chunks put in are the oldest free memory, the first thing the
        # allocation would evict, breaking the chain these blocks continue.
        held = self._chain(job)
        if len(held) < job.first + job.inserted:  # broken since the last chunk (evicted):
            job.inserted += len(chunk.hashes)  # no prefix hit can reach past the gap
            return
        todo = []  # slots of the chunk the pool lacks (another request may have computed
        for i, h in enumerate(chunk.hashes):  # the others meanwhile)
            if pool.lacks(h):
                todo.append(i)
            else:
                held += pool.holders(h)
        job.inserted += len(chunk.hashes)
        pool.touch(held)
        todo = todo[: max(0, pool.num_free - 1)]
        blocks = pool.allocate(len(todo)) if todo else []
        self.capture()  # blocks this allocation evicted: copy them before overwriting
        if blocks:
            data = chunk.buf.blocks  # (a strided view: the copy into the pool is the only one)
            data = data[: len(todo)] if todo[-1] == len(todo) - 1 else data[torch.tensor(todo)]
            self.runner.write_blocks([b.block_id for b in blocks], data)
        for b, i in zip(blocks, todo):
            pool.cache(b, chunk.hashes[i])
            self._remember(chunk.hashes[i])
        pool.free(list(reversed(blocks)))
        pool.free(list(reversed(held)))

    # -- writes (engine thread side) ----------------------------------------------------------

    def capture(self) -> None:
        """Snapshot the blocks evicted since the last call that the tier does not have
        (one gather on the device); must run before the model (or a load) writes into
        them. ship() sends them on."""
        if self._evicted:
            ev = [(b, h) for b, h in self._evicted.take() if h not in self._known]
            if ev:
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
            self.worker.write([WriteJob(hashes, self.runner.to_host(blocks))
                               for hashes, blocks in captured])

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
        pool = self.kv.pool  # (a global-only block holds only some layers: its shadow)
        cached = pool.cached.items() | getattr(pool, "shadow", {}).items()
        todo = [(b.block_id, h) for h, b in cached
                if h not in self._known and b.block_id < pool.num_full]
        deadline = time.monotonic() + timeout
        for i in range(0, len(todo), 64):
            part = todo[i : i + 64]
            self._snapshot([h for _, h in part], [b for b, _ in part], block=True,
                           deadline=deadline)
            self.ship()
        self.worker.drain(deadline)
        return len(todo)

    def _snapshot(self, hashes: list[bytes], block_ids: list[int], block: bool,
                  deadline: float = 0.0) -> None:
        """Reserve room in the write queue (or drop the blocks: the tier is a cache) and
        take their device snapshot."""
        if not self.worker.reserve(len(hashes), deadline if block else 0.0):
            return
        self._captured.append((hashes, self.runner.snapshot_blocks(block_ids)))
        for h in hashes:
            self._remember(h)

    def _forget(self, hashes: list[bytes]) -> None:
        """The tier turned out not to have these (a lookup or a load missed them: Redis
        restarted or evicted them, a write was lost while it was down): write them
        again the next time they are evicted or computed."""
        known = self._known
        for h in hashes:
            known.pop(h, None)

    def _remember(self, h: bytes) -> None:
        known = self._known
        known[h] = None
        known.move_to_end(h)
        if len(known) > self.known_limit:
            known.popitem(last=False)

    def counters(self) -> tuple[OffloadCounters, tuple[TierCounters, ...]]:
        """This side's counters and each host tier's, for EngineStats (engine thread)."""
        o = self.stats
        mine = OffloadCounters(o.loads, o.load_blocks, o.load_timeouts, o.corrupt,
                               o.written_blocks, o.dropped_writes, o.load_seconds)
        return mine, tuple(_tier_counters(t) for t in getattr(self.tier, "tiers", [self.tier]))

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker (after the writes already queued) and close the tier."""
        self.ship()
        self.stop()
        self.worker.thread.join(timeout=30)
        self.tier.close()

    def stop(self) -> None:
        """Let the worker exit once its queues are empty, without waiting for it (an
        engine dropped without close() calls this)."""
        self.worker.stop()


def _tier_counters(t: Any) -> TierCounters:  # a cache_store.base.KVTier
    c = t.stats.as_dict()
    return TierCounters(t.name, c["lookups"], c["hits"], c["misses"], c["puts"], c["errors"],
                        c["bytes_read"], c["bytes_written"], t.state() != "ok", t.breaker_trips())

"""Paged KV block manager: a fixed pool of physical blocks, an O(1) LRU free queue,
reference counts, per-request block tables and a prefix cache keyed by chained hashes.

Torch-free. A block is one of three kinds at any time:
  in use   ref_cnt > 0, in one or more block tables, not in the free queue;
  cached   ref_cnt == 0, in the free queue, still holds a hash (reusable until evicted);
  free     ref_cnt == 0, in the free queue, no hash.
Only full blocks carry a hash. Evicting a cached block (when the pool hands it out
again) calls `on_evict(block_id, block_hash)` first: the hook for a host tier.

Sliding windows: for a model whose every layer attends to the last W keys only
(KVCacheManager `window`), a block whose tokens every future query of its request has
left behind goes back to the pool after each step (published first, so it stays a
prefix-cache entry until evicted); its table entry becomes RELEASED, whose id (0) the
attention kernels never read, since they start at each query's window.

Local and global layers (Gemma 2/3, Qwen2 with max_window_layers: some layers windowed,
the rest attending to everything; KVCacheManager `local_window`): block ids below
`num_full` have storage in every layer, the ids above it only in the global layers
(HybridPool). Every block a request allocates is full; once all its tokens fall behind
the local window its global layers' K/V move to a global-only block (KVCacheManager.moves,
copied by the engine before anything else touches the pool) and the full block goes
back. A long context then holds a window's worth of full blocks and the rest in the
global layers only, not the whole context in every layer.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from engine.request import Request

HASH_VERSION = b"tidewire.block.v1"


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def root_hash(salt: bytes) -> bytes:
    """The chain's seed: a tenant's salt, so tenants never share cache entries."""
    return hashlib.sha256(_field(HASH_VERSION) + _field(salt)).digest()


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """h_i = sha256(h_{i-1} | extra | token_ids_i), every field length-prefixed and token
    ids as 4-byte little-endian, so distinct inputs can never encode alike."""
    tokens = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.sha256(_field(parent) + _field(extra) + _field(tokens)).digest()


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev: KVBlock | None = None  # free-queue links; both None when not queued
    next: KVBlock | None = None


# A table entry whose block went back to the pool behind a sliding window (see above).
RELEASED = KVBlock(0, ref_cnt=-1)


class FreeBlockQueue:
    """Doubly linked list of blocks with ref_cnt 0, least recently freed at the head.

    O(1) popleft, append and remove (a cache hit takes a block out of the middle)."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        last.next, block.prev = block, last
        block.next, self._tail.prev = self._tail, block
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next
        assert first is not None
        self._head.next, block.prev = block, self._head
        block.next, first.prev = first, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        assert block.prev is not None and block.next is not None, "block is not queued"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next
        if first is self._tail or first is None:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self) -> Iterator[KVBlock]:
        b = self._head.next
        while b is not None and b is not self._tail:
            yield b
            b = b.next


class BlockPool:
    """Physical blocks, their ref counts and the hash -> block prefix-cache index."""

    def __init__(self, num_blocks: int, on_evict: Callable[[int, bytes], None] | None = None):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.on_evict = on_evict
        self.num_evictions = 0
        self.num_full = num_blocks  # ids below: storage in every layer (HybridPool: fewer)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def _queue(self, block: KVBlock) -> FreeBlockQueue:
        """The free queue a block returns to."""
        return self.free_queue

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n blocks from the LRU head, evicting their cached hashes."""
        if n > self.num_free:
            raise ValueError(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        h = block.block_hash
        assert h is not None
        if self.cached.get(h) is block:
            del self.cached[h]
        block.block_hash = None
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(block.block_id, h)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def lacks(self, block_hash: bytes) -> bool:
        """Whether no block with room in every layer holds this hash (a host tier's load
        is worth putting in)."""
        return block_hash not in self.cached

    def holders(self, block_hash: bytes) -> list[KVBlock]:
        """The cached blocks of this hash (to hold while a load makes room)."""
        b = self.cached.get(block_hash)
        return [] if b is None else [b]

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on cache hits (pulling free ones out of the queue)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self._queue(b).remove(b)
            b.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the queue tail in the given
        order (so callers pass tail blocks first: they are the least shareable)."""
        for b in blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {b.block_id} freed twice"
            if b.ref_cnt == 0:
                self._queue(b).append(b)

    def give_back(self, blocks: Sequence[KVBlock]) -> None:
        """Return fresh blocks that never held anything worth keeping (no hash, one
        reference) to the head of the queue: the next allocation takes them before it
        evicts a cached block."""
        for b in blocks:
            assert b.ref_cnt == 1 and b.block_hash is None, f"block {b.block_id} is shared"
            b.ref_cnt = 0
            self._queue(b).appendleft(b)

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Publish a full block under its hash. A hash already cached keeps its first
        block (this one stays a private duplicate)."""
        if block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def queued(self) -> list[KVBlock]:
        """Every block in a free queue (check_integrity)."""
        return list(self.free_queue)


class HybridPool(BlockPool):
    """Blocks [0, num_full) have storage in every layer, [num_full, num_blocks) only in
    the global (non-windowed) layers. Allocations, `num_free` and the eviction hook
    concern the full blocks; `take_global` hands out global-only ones.

    The prefix-cache index `cached` serves both kinds. A full block whose global layers
    moved to a global-only one keeps its hash as a shadow (`shadow`, evictable like any
    cached block): its windowed layers are what a prefix hit needs for the last window
    before the first position it computes (KVCacheManager.get_computed_blocks)."""

    def __init__(self, num_blocks: int, num_full: int,
                 on_evict: Callable[[int, bytes], None] | None = None):
        if not 1 <= num_full < num_blocks:
            raise ValueError(f"num_full must be in [1, {num_blocks}), not {num_full}")
        super().__init__(num_blocks, on_evict)
        self.num_full = num_full
        self.free_queue = FreeBlockQueue(self.blocks[:num_full])
        self.global_queue = FreeBlockQueue(self.blocks[num_full:])
        self.shadow: dict[bytes, KVBlock] = {}

    def _queue(self, block: KVBlock) -> FreeBlockQueue:
        return self.free_queue if block.block_id < self.num_full else self.global_queue

    @property
    def num_free_global(self) -> int:
        return self.global_queue.num_free

    def full_version(self, block: KVBlock) -> KVBlock | None:
        """`block` if it is full, else the full block shadowing its hash (or None)."""
        if block.block_id < self.num_full:
            return block
        return None if block.block_hash is None else self.shadow.get(block.block_hash)

    def lacks(self, block_hash: bytes) -> bool:
        known = self.cached.get(block_hash)
        return known is None or self.full_version(known) is None

    def holders(self, block_hash: bytes) -> list[KVBlock]:
        known = self.cached.get(block_hash)
        if known is None:
            return []
        full = self.full_version(known)
        return [known] if full is None or full is known else [known, full]

    def take_global(self) -> KVBlock | None:
        """A free global-only block (one reference, no hash), or None."""
        if self.global_queue.num_free == 0:
            return None
        block = self.global_queue.popleft()
        if block.block_hash is not None:
            self._evict(block)
        block.ref_cnt = 1
        return block

    def hand_over(self, block: KVBlock, dest: KVBlock) -> None:
        """`dest` (global-only) takes over the index entry of `block` (full), which stays
        behind as its shadow."""
        h = block.block_hash
        if h is not None and self.cached.get(h) is block:
            self.cached[h] = dest
            dest.block_hash = h
            self.shadow[h] = block

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """As BlockPool.cache; a full block whose hash only a global-only block has
        becomes its shadow."""
        known = self.cached.get(block_hash)
        if block.block_hash is None and known is not None and \
                known.block_id >= self.num_full and block.block_id < self.num_full and \
                block_hash not in self.shadow:
            block.block_hash = block_hash
            self.shadow[block_hash] = block
            return
        super().cache(block, block_hash)

    def _evict(self, block: KVBlock) -> None:
        h = block.block_hash
        assert h is not None
        if self.shadow.get(h) is block:
            del self.shadow[h]
        elif self.cached.get(h) is block:
            del self.cached[h]
            full = self.shadow.pop(h, None)
            if full is not None:  # a global-only block leaves: its shadow is the entry now
                self.cached[h] = full
        block.block_hash = None
        self.num_evictions += 1
        # a global-only block holds only some layers: nothing for a host tier to keep
        if block.block_id < self.num_full and self.on_evict is not None:
            self.on_evict(block.block_id, h)

    def queued(self) -> list[KVBlock]:
        return [*self.free_queue, *self.global_queue]


class KVCacheManager:
    """Per-request block tables over a BlockPool, with prefix caching."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_evict: Callable[[int, bytes], None] | None = None,
        window: int = 0,
        local_window: int = 0,
        num_full: int | None = None,
    ) -> None:
        """`window`: the model's sliding window where every layer has one (0: none);
        blocks behind it are released after each step (release_behind_window).
        `local_window` with `num_full` < num_blocks: the window of a model whose other
        layers attend to everything; ids from num_full up are global-only (HybridPool),
        and blocks behind the window move there after each step (move_behind_window)."""
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if window and local_window:
            raise ValueError("window (every layer) and local_window (some) exclude each other")
        self.block_size = block_size
        self.window = window
        hybrid = bool(local_window) and num_full is not None and num_full < num_blocks
        self.local_window = local_window if hybrid else 0
        # (source, destination) block ids whose global layers' K/V must be copied before
        # the pool is touched again (take_moves)
        self.moves: list[tuple[int, int]] = []
        self.num_moved = 0  # blocks moved to global-only storage (a counter for tests)
        # leading entries of each table already released behind the window
        self._released: dict[str, int] = {}
        self.num_released = 0  # blocks released behind windows (a counter for tests)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = HybridPool(num_blocks, num_full, on_evict) if hybrid and num_full else \
            BlockPool(num_blocks, on_evict)
        self.tables: dict[str, list[KVBlock]] = {}
        self._ids: dict[str, list[int]] = {}  # each table's block ids (block_ids())
        # leading blocks of each table already passed to pool.cache (each step then
        # looks only at blocks that became full, not the whole table)
        self._published: dict[str, int] = {}
        # When a list: (block id, hash) of each prompt block as it becomes cached, for
        # the host tier's write-through (drained by the engine after every step).
        self.new_prompt_blocks: list[tuple[int, bytes]] | None = None
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0  # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """The fuller of the two kinds of blocks (HybridPool), or of the one pool."""
        pool = self.pool
        used = 1.0 - pool.num_free / pool.num_full
        if isinstance(pool, HybridPool):
            used = max(used, 1.0 - pool.num_free_global / (pool.num_blocks - pool.num_full))
        return used

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids: a live list, extended as the request
        grows (every step reads it; none copies it). Callers must not change it."""
        ids = self._ids.get(request_id)
        return [] if ids is None else ids

    def update_hashes(self, req: Request) -> None:
        """Extend req.block_hashes over every full block of its known tokens."""
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= req.num_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else root_hash(req.salt)
            # one block's tokens: not a copy of the whole sequence per filled block
            req.block_hashes.append(hash_block(parent, req.token_slice(i * bs, (i + 1) * bs)))

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks from the start of the request.

        At least one token is always left to compute (the step needs its logits), so
        a fully cached request reuses all but its last block."""
        if not self.enable_prefix_caching:
            return [], 0
        self.update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        if self.local_window:
            hits = self._full_at_the_end(hits)
        self.num_queries += req.num_tokens
        self.num_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def first_to_load(self, req: Request, num_hits: int) -> int:
        """Where a host tier's load for `req` starts: past its `num_hits` device hits, or
        (HybridPool) where a hit cut short for want of full blocks at its end needs
        them: the last local window of the cached run (get_computed_blocks found it)."""
        if not self.local_window:
            return num_hits
        run = 0
        for h in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            if self.pool.lookup(h) is None:
                break
            run += 1
        if run <= num_hits:
            return num_hits
        return max(0, run * self.block_size - self.local_window + 1) // self.block_size

    def _full_at_the_end(self, hits: list[KVBlock]) -> list[KVBlock]:
        """The longest run of `hits` whose last local window lies in full blocks (each
        global-only hit there swapped for its shadow): the windowed layers read the keys
        (p - window, p) of the first position p computed after it, which global-only
        blocks do not hold."""
        pool = self.pool
        assert isinstance(pool, HybridPool)
        bs, w = self.block_size, self.local_window
        n = len(hits)
        while n > 0:
            first = max(0, n * bs - w + 1) // bs  # the first block p's window reaches
            tail = [pool.full_version(b) for b in hits[first:n]]
            missing = [i for i, b in enumerate(tail) if b is None]
            if not missing:
                return hits[:first] + tail  # type: ignore[operator]  # (no None left)
            n = first + missing[-1]  # (a longer run ending past it would reach it too)
        return []

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
        reserve_blocks: int = 0,
    ) -> bool:
        """Make room for `num_new_tokens` tokens after req.num_computed_tokens (plus
        `computed_blocks`, a fresh prefix-cache hit), leaving `reserve_blocks` free.
        False, changing nothing, if the pool is short."""
        table = self.tables.get(req.request_id)
        if table is not None and not computed_blocks and not reserve_blocks and \
                len(table) * self.block_size >= req.num_computed_tokens + num_new_tokens:
            return True  # (most decode steps) the last block has room
        table = table or []
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        need = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new = need - len(table) - len(computed_blocks)
        # With a window, hits wholly behind the first query's window are never read: they
        # enter the table released, with no reference taken (a long conversation's next
        # turn would otherwise need its whole history in the pool at once).
        behind = 0
        if self.window and computed_blocks and not table:
            behind = min(max(0, num_computed - self.window + 1) // self.block_size,
                         len(computed_blocks))
        live = computed_blocks[behind:]
        # Cached hits sitting in the free queue stop being free once touched.
        nf = self.pool.num_full
        num_evictable_hits = sum(1 for b in live if b.ref_cnt == 0 and b.block_id < nf)
        if num_new + num_evictable_hits + reserve_blocks > self.pool.num_free:
            return False
        self.pool.touch(live)
        table = self.tables.setdefault(req.request_id, table)
        ids = self._ids.setdefault(req.request_id, [])
        if behind:  # (already cached: nothing to publish or release there)
            table.extend([RELEASED] * behind)
            ids.extend([RELEASED.block_id] * behind)
            self._released[req.request_id] = behind
            self._published[req.request_id] = behind
        table.extend(live)
        ids.extend(b.block_id for b in live)
        if num_new > 0:
            new = self.pool.allocate(num_new)
            table.extend(new)
            ids.extend(b.block_id for b in new)
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Publish every block whose tokens are all computed (after a step); then, with a
        window, release the blocks behind it."""
        table = self.tables.get(req.request_id)
        if not table:
            return
        if self.enable_prefix_caching:
            self._publish(req, table)
        if self.window:
            self.release_behind_window(req)
        elif self.local_window:
            self.move_behind_window(req)

    def release_behind_window(self, req: Request) -> None:
        """Give back the blocks holding only tokens no future query of `req` can see: the
        next query sits at position num_computed_tokens and sees keys past
        num_computed_tokens - window."""
        table = self.tables.get(req.request_id)
        if not table:
            return
        first_visible = req.num_computed_tokens - self.window + 1
        dead = min(max(0, first_visible) // self.block_size, len(table))
        start = self._released.get(req.request_id, 0)
        if dead <= start:
            return
        behind = table[start:dead]
        ids = self._ids[req.request_id]
        for i in range(start, dead):
            table[i] = RELEASED
            ids[i] = RELEASED.block_id
        self._released[req.request_id] = dead
        self.num_released += len(behind)
        self.pool.free(behind)

    def move_behind_window(self, req: Request) -> None:
        """Move the blocks whose tokens no future query of `req` sees through the local
        window to global-only ones (the copies wait in `moves`); the full blocks go back
        to the pool, published ones as shadows. A block shared with another request stays
        (the other may still read it locally); so does the rest of the run when no
        global-only block is free (tried again next step)."""
        table = self.tables.get(req.request_id)
        if not table:
            return
        pool = self.pool
        assert isinstance(pool, HybridPool)
        first_visible = req.num_computed_tokens - self.local_window + 1
        dead = min(max(0, first_visible) // self.block_size, len(table))
        i = self._released.get(req.request_id, 0)
        ids = self._ids[req.request_id]
        while i < dead:
            b = table[i]
            if b.block_id < pool.num_full and b.ref_cnt == 1:
                h = b.block_hash
                twin = pool.cached.get(h) if h is not None and pool.shadow.get(h) is b else None
                if twin is not None:  # a hit on its shadow: moved once already, no copy
                    pool.touch([twin])
                    dest = twin
                else:
                    fresh = pool.take_global()
                    if fresh is None:
                        break
                    self.moves.append((b.block_id, fresh.block_id))
                    pool.hand_over(b, fresh)
                    dest = fresh
                table[i], ids[i] = dest, dest.block_id
                if b.block_hash is None:
                    pool.give_back([b])  # (unpublished: the next allocation takes it)
                else:
                    pool.free([b])
                self.num_moved += 1
            i += 1
        self._released[req.request_id] = i

    def take_moves(self) -> list[tuple[int, int]]:
        """The copies move_behind_window asked for since the last call; the engine makes
        them before the pool hands out a block again."""
        moves, self.moves = self.moves, []
        return moves

    def _publish(self, req: Request, table: list[KVBlock]) -> None:
        num_full = req.num_computed_tokens // self.block_size
        done = self._published.get(req.request_id, 0)
        if num_full <= done:
            return
        self.update_hashes(req)
        num_full = min(num_full, len(req.block_hashes))
        pool, fresh = self.pool, self.new_prompt_blocks
        for i in range(done, num_full):
            block, h = table[i], req.block_hashes[i]
            pool.cache(block, h)
            if fresh is not None and block.block_hash == h and (i + 1) * self.block_size \
                    <= req.num_prompt_tokens and pool.cached.get(h) is block:
                fresh.append((block.block_id, h))
        self._published[req.request_id] = num_full

    def trim(self, req: Request) -> None:
        """Give back the blocks past the ones the request's known tokens need (they held
        only rejected speculative tokens: fresh, never published)."""
        table = self.tables.get(req.request_id)
        keep = -(-req.num_tokens // self.block_size)
        if table is None or len(table) <= keep:
            return
        extra = table[keep:]
        del table[keep:]
        del self._ids[req.request_id][keep:]
        self.pool.give_back(extra)

    def free(self, req: Request) -> None:
        """Release the request's blocks; tail first so the prefix stays cached longest."""
        table = self.tables.pop(req.request_id, None)
        self._ids.pop(req.request_id, None)
        self._published.pop(req.request_id, None)
        released = self._released.pop(req.request_id, 0)
        if self.local_window:
            released = 0  # (the pointer counts blocks moved, which the table still holds)
        if table:
            self.pool.free(list(reversed(table[released:])))

    def check_integrity(self) -> None:
        """free + cached + in-use == total, and ref counts match the block tables."""
        pool = self.pool
        queued = pool.queued()
        assert len(queued) == pool.num_free + getattr(pool, "num_free_global", 0), \
            "free queue count drifted"
        assert len({b.block_id for b in queued}) == len(queued), "block queued twice"
        assert all(b.ref_cnt == 0 for b in queued), "in-use block in the free queue"
        refs: dict[int, int] = {}
        assert self._ids.keys() == self.tables.keys(), "block id lists out of step"
        for rid, table in self.tables.items():
            assert self._ids[rid] == [b.block_id for b in table], "block id list drifted"
            released = 0 if self.local_window else self._released.get(rid, 0)
            assert all(b is RELEASED for b in table[:released]), "released entry reused"
            for b in table[released:]:
                assert b is not RELEASED, "a block released out of order"
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        in_use = [b for b in pool.blocks if b.ref_cnt > 0]
        assert len(queued) + len(in_use) == pool.num_blocks, "blocks lost or duplicated"
        for b in pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"block {b.block_id} ref count"
        for h, b in pool.cached.items():
            assert b.block_hash == h, "cache index points at a block with another hash"
        for h, b in getattr(pool, "shadow", {}).items():
            assert b.block_hash == h and b.block_id < pool.num_full, "bad shadow"
            assert pool.cached[h].block_id >= pool.num_full, "a shadow of a full block"

from __future__ import annotations

import hashlib

import pytest

from engine.block_manager import (FreeBlockQueue, KVBlock, KVCacheManager, hash_block,
                                  root_hash)
from engine.request import Request
from engine.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], salt: bytes = b"") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), salt=salt)


def test_free_queue_is_lru_with_o1_removal() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    assert q.num_free == 4


def test_token_slice_equals_slicing_all_tokens_across_the_prompt_output_boundary() -> None:
    r = req("s", [5, 6, 7, 8, 9])
    for t in (20, 21, 22, 23):
        r.append_output(t)
    whole = r.all_token_ids
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 2):
            assert r.token_slice(start, end) == whole[start:end], (start, end)


def test_block_hashes_of_a_growing_request_equal_hashing_its_whole_sequence() -> None:
    m = KVCacheManager(num_blocks=16, block_size=4)
    r = req("g", list(range(100, 110)))  # 2 full blocks + 2 tokens
    m.update_hashes(r)
    assert len(r.block_hashes) == 2
    for t in range(200, 209):  # outputs fill blocks 3 (straddling) and 4
        r.append_output(t)
        m.update_hashes(r)
    toks, want, h = r.all_token_ids, [], root_hash(b"")
    for i in range(len(toks) // 4):
        h = hash_block(h, toks[i * 4 : (i + 1) * 4])
        want.append(h)
    assert len(want) == 4 and r.block_hashes == want


def test_hash_chain_is_stable_and_salted() -> None:
    h0 = hash_block(root_hash(b""), [1, 2, 3])
    assert h0 == hash_block(root_hash(b""), [1, 2, 3])
    # The documented encoding, computed independently: host tiers persist these keys.
    def field(b: bytes) -> bytes:
        return len(b).to_bytes(4, "little") + b

    root = hashlib.sha256(field(b"tidewire.block.v1") + field(b"")).digest()
    toks = b"".join(t.to_bytes(4, "little") for t in (1, 2, 3))
    assert h0 == hashlib.sha256(field(root) + field(b"") + field(toks)).digest()
    assert h0.hex().startswith("ef6adc9a403663cb")
    assert hash_block(root_hash(b"tenant-a"), [1, 2, 3]) != h0
    # Length prefixes: moving bytes between fields never collides.
    assert hash_block(root_hash(b""), [1, 2, 3], extra=b"\x04\x00\x00\x00") != \
        hash_block(root_hash(b""), [1, 2, 3, 4])
    assert hash_block(h0, [7]) != hash_block(root_hash(b""), [7])


def test_allocation_block_ids_and_growth() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2)  # 12 tokens still fit in 3 blocks
    assert kv.block_ids("a") == [0, 1, 2]
    r.num_computed_tokens = 12
    assert kv.allocate_slots(r, 1)
    assert kv.block_ids("a") == [0, 1, 2, 3]
    assert kv.num_free_blocks == 4
    kv.check_integrity()


def test_allocation_fails_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = req("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert kv.block_ids("a") == [] and kv.num_free_blocks == 2
    kv.check_integrity()


def test_prefix_hit_reuses_blocks_and_refcounts() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)  # blocks 0, 1 are full; block 2 holds 2 tokens
    b = req("b", list(range(8)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert kv.allocate_slots(b, 3, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.check_integrity()


def test_full_hit_leaves_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    hits, n = kv.get_computed_blocks(req("b", list(range(8))))
    assert [h.block_id for h in hits] == [0] and n == 4


def test_freed_blocks_stay_cached_and_evict_lru_with_hook() -> None:
    evicted: list[int] = []
    kv = KVCacheManager(num_blocks=4, block_size=2, on_evict=lambda bid, h: evicted.append(bid))
    a = req("a", [1, 2, 3, 4, 5, 6])
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    kv.cache_full_blocks(a)
    kv.free(a)
    # Freed tail first: queue order is 3 (never used), then 2, 1, 0 of "a".
    assert [b.block_id for b in kv.pool.free_queue] == [3, 2, 1, 0]
    b = req("b", [1, 2, 3, 4, 9])  # hits blocks 0 and 1
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 4
    assert kv.allocate_slots(b, 1, hits)
    assert kv.block_ids("b") == [0, 1, 3] and evicted == []
    c = req("c", [7, 7])
    assert kv.allocate_slots(c, 2)
    assert kv.block_ids("c") == [2] and evicted == [2]  # the LRU cached block goes
    assert kv.pool.num_evictions == 1
    kv.check_integrity()


def test_tenants_do_not_share_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = req("a", [1, 2, 3, 4, 5], salt=b"t1")
    kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5], salt=b"t2"))[1] == 0
    assert kv.get_computed_blocks(req("c", [1, 2, 3, 4, 5], salt=b"t1"))[1] == 4


def test_prefix_caching_off() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5])) == ([], 0)


def test_integrity_check_catches_corruption() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    kv.pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError):
        kv.check_integrity()


def _prefill(m: KVCacheManager, r: Request, chunk: int) -> int:
    """Run r's prompt through in chunks as the scheduler does (allocate, compute, then
    publish and release); the most blocks its table held in use at once."""
    most = 0
    hits, n = m.get_computed_blocks(r)
    while r.num_computed_tokens < r.num_prompt_tokens:
        take = min(chunk, r.num_prompt_tokens - r.num_computed_tokens - n)
        assert m.allocate_slots(r, take, hits), "the pool was short"
        r.num_computed_tokens += n + take
        hits, n = (), 0
        most = max(most, sum(b.ref_cnt > 0 for b in m.tables[r.request_id]))
        m.cache_full_blocks(r)
        m.check_integrity()
    return most


def test_a_window_releases_blocks_behind_it_and_takes_no_reference_on_hits_there() -> None:
    """Every layer windowed (128 tokens): a 1,000-token prompt in a 64-block pool holds
    about its window; the next turn of the same conversation (its prompt plus 500 tokens)
    hits 62 cached blocks, but only those inside its first window are referenced: the
    rest enter the table released, so it is admitted where taking all of them would have
    needed 78 blocks at once."""
    m = KVCacheManager(num_blocks=64, block_size=16, window=128)
    first = req("a", list(range(1000, 2000)))
    assert _prefill(m, first, 256) <= (128 + 256) // 16 + 1
    assert m.num_released > 0
    m.free(first)
    m.check_integrity()
    second = req("b", list(range(1000, 2000)) + list(range(5000, 5500)))
    assert _prefill(m, second, 256) <= (128 + 256) // 16 + 1
    released = m._released["b"]
    assert released >= 60 and all(b.block_id == 0 for b in m.tables["b"][:released])
    m.free(second)
    m.check_integrity()
    assert m.num_free_blocks == 64


def _held(m: KVCacheManager, rid: str) -> tuple[int, int]:
    """(full, global-only) blocks in the request's table."""
    nf = m.pool.num_full
    table = m.tables[rid]
    return sum(b.block_id < nf for b in table), sum(b.block_id >= nf for b in table)


def test_local_and_global_layers_hold_a_window_of_full_blocks_and_hit_the_next_turn() -> None:
    """Some layers windowed (128 tokens), the rest global: a 1,000-token prompt holds its
    window (and a chunk) in full blocks and the rest in global-only ones, each move a
    copy from a full block to a global-only one. A request sharing its first 700 tokens
    hits 43 blocks: the 8 in its first window are the full blocks left behind as
    shadows, the rest global-only; moving those shadows later costs no copy."""
    m = KVCacheManager(num_blocks=300, block_size=16, local_window=128, num_full=120)
    first = req("a", list(range(1000, 2000)))
    most = 0
    while first.num_computed_tokens < first.num_prompt_tokens:
        take = min(256, first.num_prompt_tokens - first.num_computed_tokens)
        assert m.allocate_slots(first, take)
        first.num_computed_tokens += take
        most = max(most, _held(m, "a")[0])
        m.cache_full_blocks(first)
        m.check_integrity()
    assert most <= (128 + 256) // 16 + 1
    full, moved = _held(m, "a")
    assert moved == (1000 - 128 + 1) // 16 and full + moved == -(-1000 // 16)
    moves = m.take_moves()
    assert len(moves) == moved == m.num_moved and m.moves == []
    assert all(src < 120 <= dst for src, dst in moves)
    m.free(first)
    m.check_integrity()
    second = req("b", list(range(1000, 1700)) + list(range(5000, 5300)))
    hits, n = m.get_computed_blocks(second)
    assert n == 43 * 16
    first_window = (43 * 16 - 128 + 1) // 16  # 35
    assert [b.block_id < 120 for b in hits] == [False] * first_window + [True] * 8
    assert m.allocate_slots(second, second.num_prompt_tokens - n, hits)
    second.num_computed_tokens = second.num_prompt_tokens
    m.cache_full_blocks(second)
    m.check_integrity()
    dead = (1000 - 128 + 1) // 16  # 54: entries 35..42 moved onto their global-only
    assert _held(m, "b")[1] == dead  # blocks, 43..53 copied
    assert m.num_moved == moved + (dead - first_window) and len(m.take_moves()) == dead - 43
    m.free(second)
    m.check_integrity()
    assert m.num_free_blocks == 120


def test_a_hit_needs_its_last_window_in_full_blocks() -> None:
    """Once the full blocks of a cached chain are evicted (their shadows and the last
    window's), the global-only rest cannot serve a hit: the windowed layers would read
    nothing before the first position computed. The request computes from the start."""
    m = KVCacheManager(num_blocks=200, block_size=16, local_window=64, num_full=24)
    first = req("a", list(range(1000, 1640)))  # 40 blocks
    _prefill(m, first, 128)
    m.take_moves()
    m.free(first)
    again = req("b", list(range(1000, 1640)))
    hits, n = m.get_computed_blocks(again)
    assert n == 39 * 16  # all but the last block (its last token is computed again)
    filler = req("f", list(range(9000, 9000 + 24 * 16)))
    assert m.allocate_slots(filler, 24 * 16)  # takes (evicts) every full block
    m.free(filler)
    m.check_integrity()
    hits, n = m.get_computed_blocks(req("c", list(range(1000, 1640))))
    assert (hits, n) == ([], 0)


def test_blocks_shared_with_another_request_or_without_global_room_stay_full() -> None:
    """When no global-only block is free a request's blocks behind the window stay full
    (the run resumes once one is); a block another running request also holds is not
    moved (that one may still read it through its window)."""
    m = KVCacheManager(num_blocks=36, block_size=16, local_window=32, num_full=30)
    prefix = list(range(1000, 1160))  # 10 blocks
    a = req("a", prefix + [1])
    _prefill(m, a, 64)
    # 8 blocks lie behind a's window, but only 6 global-only ones exist
    assert _held(m, "a") == (5, 6) and m.pool.num_free_global == 0  # type: ignore[attr-defined]
    assert m._released["a"] == 6
    b = req("b", prefix + [2] * 40)
    hits, n = m.get_computed_blocks(b)
    assert n == 160 and [h.block_id < 30 for h in hits] == [False] * 6 + [True] * 4
    assert m.allocate_slots(b, b.num_prompt_tokens - n, hits)
    b.num_computed_tokens = b.num_prompt_tokens
    before = m.num_moved
    m.cache_full_blocks(b)
    m.check_integrity()
    assert m.num_moved == before  # entries 6..9 are a's too
    assert [blk.ref_cnt for blk in m.tables["b"][6:10]] == [2] * 4
    m.free(a)
    m.free(b)
    m.check_integrity()
    assert m.num_free_blocks == 30

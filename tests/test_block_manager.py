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

"""Scheduler tests with fake model outputs: exact chunk sizes, block ids, victims."""

from __future__ import annotations

from engine.block_manager import KVCacheManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput


def make(num_blocks: int = 16, block_size: int = 4, budget: int = 16, max_seqs: int = 8,
         watermark: float = 0.0, prefix: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix)
    return Scheduler(SchedulerConfig(budget, max_seqs, watermark), kv)


def req(rid: str, n: int, max_tokens: int = 4, start: int = 0, eos: frozenset = frozenset()) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=eos)


def run(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """One step with a fake model that samples `token` for every row that samples."""
    out = s.schedule()
    s.update(out, {x.request.request_id: token for x in out.scheduled if x.samples})
    s.kv.check_integrity()
    return out


def chunks(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]


def test_chunked_prefill_and_decode_share_a_step() -> None:
    s = make(budget=8)
    s.add(req("a", 10))
    s.add(req("b", 5, start=100))
    o1 = run(s)
    assert chunks(o1) == [("a", 8)] and not o1.scheduled[0].samples
    o2 = run(s)
    assert chunks(o2) == [("a", 2), ("b", 5)]  # a finishes its prefill, b starts
    assert s.requests["a"].output_token_ids == [7]
    assert s.requests["b"].output_token_ids == [7]
    o3 = run(s)
    assert chunks(o3) == [("a", 1), ("b", 1)]  # both decode


def test_block_tables_are_exact() -> None:
    s = make(block_size=4, budget=32)
    s.add(req("a", 6))
    s.add(req("b", 3, start=50))
    out = run(s)
    assert [x.block_ids for x in out.scheduled] == [[0, 1], [2]]
    run(s)  # a: 7 tokens computed, b: 4
    out = run(s)  # b's 5th token needs a new block
    assert [x.block_ids for x in out.scheduled] == [[0, 1], [2, 3]]


def test_max_num_seqs_and_budget_limit_admission() -> None:
    s = make(budget=100, max_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 4, start=10 * i))
    assert chunks(run(s)) == [("r0", 4), ("r1", 4)]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_finish_on_length_and_eos_frees_blocks() -> None:
    s = make(budget=64)
    s.add(req("len", 4, max_tokens=2))
    s.add(req("eos", 4, max_tokens=10, start=20, eos=frozenset({7})))
    run(s)
    assert "eos" not in s.requests  # sampled 7 = EOS at once
    run(s)
    assert "len" not in s.requests and not s.has_unfinished()
    assert s.kv.num_free_blocks == 16


def test_preemption_evicts_newest_and_recomputes() -> None:
    s = make(num_blocks=4, block_size=4, budget=64)
    s.add(req("old", 4, max_tokens=20))
    s.add(req("new", 4, max_tokens=20, start=40))
    run(s)  # each has 4 prompt tokens + 1 sampled: 2 blocks needed soon
    out = run(s)  # both need a 2nd block: 4 blocks used
    assert chunks(out) == [("old", 1), ("new", 1)]
    out = run(s)
    assert chunks(out) == [("old", 1), ("new", 1)]
    for _ in range(3):
        out = run(s)
    # old needs a third block; the pool is full, so the newest request is preempted.
    assert out.preempted == ["new"]
    assert chunks(out) == [("old", 1)]
    new = s.requests["new"]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert s.waiting[0] is new and s.num_preemptions == 1


def test_prefix_cache_hit_at_admission() -> None:
    s = make(block_size=4, budget=64)
    s.add(req("a", 9))
    run(s)
    s.add(req("b", 10))  # shares a's first two full blocks
    out = run(s)
    assert chunks(out) == [("a", 1), ("b", 2)]
    b = s.requests["b"]
    assert b.num_cached_tokens == 8 and out.scheduled[1].block_ids[:2] == [0, 1]


def test_abort_frees_waiting_and_running() -> None:
    s = make(budget=8)
    s.add(req("a", 6))
    s.add(req("b", 6, start=30))
    run(s)  # a prefilling (6), b prefill chunk (2)
    done = s.finish_requests(["a", "b", "missing"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["a", "b"]
    assert all(r.finish_reason == "abort" for r in done)
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished()
    s.kv.check_integrity()


def test_watermark_holds_back_admission_only_while_others_run() -> None:
    s = make(num_blocks=10, block_size=4, budget=64, watermark=0.2)  # 2 blocks reserved
    s.add(req("a", 16, max_tokens=2))  # 4 blocks (+1 soon)
    s.add(req("b", 17, max_tokens=2, start=100))  # 5 blocks would leave 1 < 2 free
    assert chunks(run(s)) == [("a", 16)]
    s2 = make(num_blocks=4, block_size=4, budget=64, watermark=0.5)
    s2.add(req("solo", 16, max_tokens=1))
    assert chunks(run(s2)) == [("solo", 16)]  # nothing running: the watermark doesn't apply


def test_proposals_take_no_block_another_request_needs() -> None:
    """Speculative proposals run only where they fit: never at the cost of a
    preemption. Verified tokens advance the request; rejected slots are rolled back and
    the blocks that held only them go back to the pool."""
    s = make(num_blocks=4, block_size=4, budget=32, prefix=False)
    s.add(req("a", 3, max_tokens=20))
    s.add(req("b", 8, max_tokens=20, start=50))
    run(s)  # a: 4 tokens (1 block), b: 9 tokens (2 blocks, its next decode needs a 3rd)
    a, b = s.requests["a"], s.requests["b"]
    a.spec_token_ids = [1, 2, 3, 4]  # would need a's 2nd block: the one b needs next
    out = s.schedule()
    assert chunks(out) == [("a", 1), ("b", 1)] and not out.preempted
    s.update(out, {"a": 7, "b": 7})
    # with room, they run: a verifies 1 + 2 proposals and keeps 1 of them plus its own
    a.spec_token_ids, b.spec_token_ids = [5, 6], []
    s.kv.free(b)  # (b's blocks back: room for a's proposals)
    s.running.remove(b)
    del s.requests["b"]
    out = s.schedule()
    assert chunks(out) == [("a", 3)] and out.scheduled[0].num_spec == 2
    assert len(s.kv.block_ids("a")) == 2  # 5 known + 2 proposed positions
    before = a.num_computed_tokens
    s.update(out, {}, {"a": [5, 9]})  # 5 accepted, 6 rejected, 9 is the model's own
    assert a.output_token_ids[-2:] == [5, 9] and a.num_computed_tokens == before + 2
    assert a.num_computed_tokens == a.num_tokens - 1
    assert len(s.kv.block_ids("a")) == 2  # 7 tokens still need both
    s.kv.check_integrity()
    assert (a.spec_steps, a.spec_proposed, a.spec_accepted) == (1, 2, 1)
    # proposals into a third block, all rejected: that block goes back
    a.spec_token_ids = [1, 2, 3, 4]
    out = s.schedule()
    assert out.scheduled[0].num_spec == 4 and len(s.kv.block_ids("a")) == 3
    s.update(out, {}, {"a": [8]})
    assert a.num_tokens == 8 and len(s.kv.block_ids("a")) == 2
    assert s.kv.num_free_blocks == 2
    s.kv.check_integrity()


def test_a_hybrid_pool_admits_a_request_whose_hits_alone_fill_the_full_blocks() -> None:
    """Local and global layers (HybridPool, 7 full blocks, 1 global-only): a prompt's
    blocks stayed full when no global-only block was free, and it is cached as 6 full
    blocks. Its next admission needs those 6 plus 2 new blocks, more than the 7 full ones,
    and nothing running would ever free any: it is admitted without the hits instead of
    waiting forever."""
    kv = KVCacheManager(8, 16, local_window=32, num_full=7)
    s = Scheduler(SchedulerConfig(32, 8, 0.0), kv)
    a = req("a", 112)  # 7 blocks; only the first can move
    while a.num_computed_tokens < a.num_prompt_tokens:
        n = min(32, a.num_prompt_tokens - a.num_computed_tokens)
        assert kv.allocate_slots(a, n)
        a.num_computed_tokens += n
        kv.cache_full_blocks(a)
        kv.check_integrity()
    assert [blk.block_id < 7 for blk in kv.tables["a"]] == [False] + [True] * 6
    kv.free(a)
    again = req("a2", 112 + 20)
    hits, n = kv.get_computed_blocks(again)
    assert n == 7 * 16 and not kv.allocate_slots(again, 20, hits)  # 6 full + 2 new > 7
    s.add(again)
    out = run(s)
    assert chunks(out) == [("a2", 32)]  # admitted, from the start
    assert s.requests["a2"].num_cached_tokens == 0

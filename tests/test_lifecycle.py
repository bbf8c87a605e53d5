"""RequestLifecycle (engine/lifecycle.py) over a real torch-free scheduler and block
manager, without a model or tokenizer: n > 1 fan-out, abort, fail, and what a finished
sample releases."""

from __future__ import annotations

from engine.block_manager import KVCacheManager
from engine.config import SchedulerConfig
from engine.constraints import CompileQueue
from engine.lifecycle import RequestLifecycle
from engine.output_processor import OutputProcessor
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


class Holder:
    """Records the samples released (ModelRunner.release, Speculator.release)."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def make() -> tuple[RequestLifecycle, Holder]:
    s = Scheduler(SchedulerConfig(16, 8, 0.0), KVCacheManager(16, 4, True))
    h = Holder()
    return RequestLifecycle(s, OutputProcessor(None, s), CompileQueue(None), None, [h]), h


def test_n_samples_start_one_then_its_siblings() -> None:
    life, _ = make()
    assert life.add(Request("a", [1, 2, 3], SamplingParams(n=3, max_tokens=2))) == []
    assert life.request_ids() == ["a"]
    assert list(life.scheduler.requests) == ["a\x000"]  # the siblings wait for its prompt
    first = life.parents["a"].first
    life.start_siblings([first])
    assert list(life.scheduler.requests) == ["a\x000", "a\x001", "a\x002"]
    assert life.unfinished(["a", "unknown"]) == ["a\x000", "a\x001", "a\x002"]


def test_abort_ends_every_sample_and_releases_it() -> None:
    life, h = make()
    life.add(Request("a", [1, 2, 3], SamplingParams(n=2, max_tokens=2)))
    outs = life.abort(["a"])
    assert [(o.request_id, o.index, o.finish_reason) for o in outs] == \
        [("a", 0, "abort"), ("a", 1, "abort")]
    assert h.released == ["a\x000", "a\x001"] and life.request_ids() == []
    assert not len(life.outputs) and life.abort(["a"]) == []


def test_a_duplicate_id_is_refused_and_a_fault_fails_the_request_alone() -> None:
    life, _ = make()
    life.add(Request("a", [1, 2], SamplingParams(max_tokens=2)))
    life.add(Request("b", [1, 2], SamplingParams(max_tokens=2)))
    try:
        life.add(Request("a", [1], SamplingParams()))
    except ValueError as e:
        assert "duplicate request id" in str(e)
    else:
        raise AssertionError("a duplicate id was taken")
    outs = life.fail("a", "it broke")
    assert [(o.request_id, o.finish_reason, o.error) for o in outs] == \
        [("a", "error", "it broke")]
    assert life.request_ids() == ["b"] and list(life.scheduler.requests) == ["b"]


def test_a_request_that_continues_from_tokens_that_end_it_ends_at_once() -> None:
    life, _ = make()
    r = Request("c", [1, 2], SamplingParams(max_tokens=2))
    r.output_token_ids = [5, 6]
    outs = life.add(r)
    assert [(o.finished, o.finish_reason) for o in outs] == [(True, "length")]
    assert life.request_ids() == [] and not life.scheduler.requests

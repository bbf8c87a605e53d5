"""Request bookkeeping: dropping tokens past a request's end, and ParentRequest's
samples (n > 1 fan-out), torch-free."""

from __future__ import annotations

from engine.request import ParentRequest, Request, RequestStatus
from engine.sampling_params import SamplingParams


def test_drop_last_drops_this_steps_tail_and_a_length_end_becomes_a_stop() -> None:
    r = Request("a", [1, 2], SamplingParams(max_tokens=4))
    r.output_token_ids, r.num_new_tokens_last = [5, 6, 7, 8], 3
    r.status = RequestStatus.FINISHED_LENGTH
    r.drop_last(2)
    assert (r.output_token_ids, r.num_new_tokens_last) == ([5, 6], 1)
    assert r.status is RequestStatus.FINISHED_STOPPED
    r.drop_last(0)  # nothing to drop: nothing changes
    assert (r.output_token_ids, r.status) == ([5, 6], RequestStatus.FINISHED_STOPPED)


def test_one_sample_is_the_request_itself() -> None:
    req = Request("a", [1, 2, 3], SamplingParams(n=1))
    p = ParentRequest(req)
    assert p.samples == [req] and p.first is req and p.unfinished == ["a"]
    assert p.waiting == [] and p.take_waiting() == []
    assert p.finished("a") and p.unfinished == []


def test_n_samples_share_the_prompt_and_count_down_to_the_last() -> None:
    req = Request("a", [1, 2, 3], SamplingParams(n=3, max_tokens=2), salt=b"s")
    p = ParentRequest(req)
    assert [s.request_id for s in p.samples] == ["a\x000", "a\x001", "a\x002"]
    assert all(s.parent_id == "a" and s.index == i and s.salt == b"s"
               and s.prompt_token_ids is req.prompt_token_ids for i, s in enumerate(p.samples))
    p.waiting = p.samples[1:]
    assert p.take_waiting() == p.samples[1:] and p.take_waiting() == []
    assert not p.finished("a\x001")
    assert not p.finished("a\x001")  # counted once
    assert not p.finished("a\x000")
    assert p.finished("a\x002") and p.unfinished == []
    assert not p.finished("a\x002")  # the last one was already counted

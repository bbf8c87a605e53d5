"""OutputProcessor (engine/output_processor.py): each sample's text and stop strings,
on the real SmolLM2 tokenizer, with a stand-in scheduler."""

from __future__ import annotations

import pytest

from engine.output_processor import OutputProcessor, ended
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


class Scheduler:
    """Records finish_requests (the scheduler finishes a running sample)."""

    def __init__(self) -> None:
        self.finished: list[tuple[list[str], RequestStatus]] = []

    def finish_requests(self, ids: list[str], status: RequestStatus) -> list[Request]:
        self.finished.append((list(ids), status))
        return []


@pytest.fixture(scope="module")
def tok(smollm2_dir):  # noqa: ANN001, ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def running(tok, rid: str = "a", **params) -> Request:  # noqa: ANN001
    r = Request(rid, tok.encode("Say:", add_special_tokens=False), SamplingParams(**params),
                parent_id="p", index=1)
    r.status = RequestStatus.RUNNING
    return r


def test_text_flows_and_a_finished_sample_is_released(tok) -> None:  # noqa: ANN001
    out = OutputProcessor(tok, Scheduler())  # type: ignore[arg-type]
    r = running(tok)
    out.add(r)
    ids = tok.encode(" hello world", add_special_tokens=False)
    o = out.emit(r, ids, None, 1.5)
    assert (o.request_id, o.index, o.text_delta, o.finished, o.sampled_at) == \
        ("p", 1, " hello world", False, 1.5)
    assert "a" in out and len(out) == 1
    r.status = RequestStatus.FINISHED_LENGTH
    o = out.emit(r, [], None)
    assert o.finished and o.finish_reason == "length" and "a" not in out


def test_a_stop_string_ends_the_sample_at_its_token(tok) -> None:  # noqa: ANN001
    sched = Scheduler()
    out = OutputProcessor(tok, sched)  # type: ignore[arg-type]
    r = running(tok, stop=("world",))
    out.add(r)
    ids = tok.encode(" hello world and more", add_special_tokens=False)
    r.output_token_ids, r.num_new_tokens_last = list(ids), len(ids)
    o = out.emit(r, list(ids), None)  # several tokens at once: accepted proposals
    assert o.text_delta == " hello " and o.stop_reason == "world"
    assert sched.finished == [(["a"], RequestStatus.FINISHED_STOPPED)]
    assert o.new_token_ids == r.output_token_ids and len(o.new_token_ids) < len(ids)


def test_continuing_and_muting(tok) -> None:  # noqa: ANN001
    out = OutputProcessor(tok, Scheduler())  # type: ignore[arg-type]
    r = running(tok, stop=("world",))
    r.output_token_ids = tok.encode(" hello world", add_special_tokens=False)
    assert out.continued_text(r) == " hello "
    out.add(r)
    assert out.continue_from(r) and r.status is RequestStatus.FINISHED_STOPPED
    q = running(tok, "b")
    out.add(q)
    out.mute("a")
    out.mute("nobody")  # unknown: nothing held for it
    assert "nobody" not in out
    assert out.emit(q, tok.encode(" hi", add_special_tokens=False), None).text_delta == " hi"
    out.release("a")
    assert "a" not in out


def test_ended_and_the_byte_table() -> None:
    o = ended("p", 2)
    assert (o.request_id, o.index, o.finished, o.finish_reason) == ("p", 2, True, "error")
    assert OutputProcessor(None, Scheduler()).byte_table(True) is None  # type: ignore[arg-type]

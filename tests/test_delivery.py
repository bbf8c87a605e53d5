"""service/delivery.py without sockets: merged deltas, resume marks and replay, frames."""

from __future__ import annotations

from engine import SamplingParams
from engine.request_stream import RequestStream
from engine.outputs import StepOutput
from engine.request import Request
from service.delivery import Live, Timings, done_frame, replay, step_frames
from service.gateway import Admission, Principal


def _live(n: int = 1) -> tuple[Live, RequestStream, list]:
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=8, n=n))
    stream = RequestStream(req)
    logged: list = []
    adm = Admission(stream, 0.0, Principal(None, ""))
    return Live("c1", adm, False, Timings(0.0)), stream, logged


def _step(tokens: list[int], text: str, index: int = 0, finished: bool = False) -> StepOutput:
    return StepOutput(request_id="r", new_token_ids=tokens, text_delta=text, index=index,
                      finished=finished, finish_reason="length" if finished else None,
                      num_prompt_tokens=3)


def test_steps_that_queued_up_merge_into_one_delta_with_a_resume_mark() -> None:
    live, stream, logged = _live()
    stream._push(_step([7], "a"))
    stream._push(_step([8], "b"))  # the socket was busy: both steps wait, then go as one
    frames = step_frames(live, lambda *a: logged.append(a))
    assert [f["type"] for f in frames] == ["start", "delta"]
    assert (frames[1]["seq"], frames[1]["token_ids"], frames[1]["text"]) == (1, [7, 8], "ab")
    stream._push(_step([9], "c"))
    later = step_frames(live, lambda *a: logged.append(a))
    assert [(f["seq"], f["token_ids"], f["text"]) for f in later] == [(2, [9], "c")]
    assert live.marks == [(0, 2, 2), (0, 3, 3)] and live.seq == 2
    assert [(first, n) for first, _, n in logged] == [(True, 2), (False, 1)]
    assert step_frames(live, lambda *a: None) == []  # nothing new: nothing to send


def test_replay_after_a_seq_sends_one_merged_delta_per_sample() -> None:
    live, stream, _ = _live(n=2)
    for tokens, text, index in (([7], "a", 0), ([5], "x", 1), ([8], "b", 0), ([6], "y", 1)):
        stream._push(_step(tokens, text, index))
    sent = step_frames(live, lambda *a: None)
    assert [f["seq"] for f in sent if f["type"] == "delta"] == [1, 2, 3, 4]
    # the client saw seq 1 (sample 0's "a") only: it gets the rest, one delta a sample
    again = replay(live, 1)
    assert [(f["seq"], f["index"], f["token_ids"], f["text"]) for f in again] == [
        (2, 0, [8], "b"), (3, 1, [5, 6], "xy")]
    assert live.seq == 3 and live.marks == [(0, 1, 1), (0, 2, 2), (1, 2, 2)]
    assert replay(live, 3) == []  # everything delivered


def test_done_frame_counts_every_sample_and_maps_the_finish() -> None:
    live, stream, _ = _live()
    stream._push(_step([7, 8], "ab", finished=True))
    step_frames(live, lambda *a: None)
    done = done_frame(live, "length")
    assert done["status"] == "completed" and done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 2 and done["usage"]["prompt_tokens"] == 3
    assert set(done["timings"]) == {"queue_ms", "ttft_ms", "tokens_per_s", "total_ms"}
    aborted = done_frame(live, "abort")
    assert aborted["status"] == "cancelled" and aborted["finish_reason"] == "cancelled"

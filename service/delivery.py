"""What a WebSocket stream sends, without any socket: the per-request state a session
keeps (`Live`), the frames (start, delta, done), the merging of the steps that queued
up while the socket was busy into one delta, and the resume marks that let a new socket
replay everything after a given `seq`. Pure functions of the stream's outputs, unit
tested without sockets (tests/test_delivery.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.outputs import RequestOutput, StepOutput
from service.protocol import ProtocolError
from service.reasoning import Reasoning
from service.tools import CallStream, Tools

if TYPE_CHECKING:
    from engine.request_stream import RequestStream
    from service.gateway import Admission

FINISH = {"stop": "stop", "length": "length", "abort": "cancelled", "error": "error"}
STATUS = {"stop": "completed", "length": "completed", "abort": "cancelled", "error": "failed"}


class Timings:
    """A request's arrival, first and last token times (for done's timings and the
    token metrics)."""

    __slots__ = ("arrival", "first", "last")

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.first: float | None = None
        self.last = arrival

    def token(self, n: int, log: Callable[[bool, float, int], None]) -> None:
        """n tokens delivered now; `log(first, gap, n)` records them (Gateway.log_tokens:
        metrics are observed after the step's fan-out)."""
        if n:
            now = time.monotonic()
            if self.first is None:
                self.first = now
                log(True, now - self.arrival, n)
            else:
                log(False, now - self.last, n)
            self.last = now

    def summary(self, completion: int, queue_time: float) -> dict[str, float]:
        total = time.monotonic() - self.arrival
        ttft = (self.first - self.arrival) if self.first else total
        gen = self.last - (self.first or self.last)
        rate = (completion - 1) / gen if completion > 1 and gen > 0 else 0.0
        return {"queue_ms": round(queue_time * 1000, 3), "ttft_ms": round(ttft * 1000, 3),
                "tokens_per_s": round(rate, 3), "total_ms": round(total * 1000, 3)}


@dataclass(eq=False, slots=True)
class Live:
    """A request in flight on a socket (or parked after its socket dropped): its client
    id, its admission and the engine's stream of its outputs (`adm.stream`, carried
    here directly), and what its client has been sent."""

    rid: str
    adm: Admission
    stream: RequestStream = field(init=False)
    logprobs: bool
    track: Timings
    seq: int = 0
    started: bool = False
    queued: bool = False  # a pull marker for it is in the send queue
    failure: ProtocolError | None = None  # reported before its done (slow_consumer)
    last: RequestOutput | None = None
    # after delta seq s the client has marks[s-1] = (sample index, its tokens, its chars)
    marks: list[tuple[int, int, int]] = field(default_factory=list)
    ended: bool = False  # its done frame is built (tail holds it until it is written)
    tail: list[dict[str, Any]] = field(default_factory=list)
    tools: Tools | None = None  # a chat request with tools: its calls are parsed out
    calls: dict[int, CallStream] = field(default_factory=dict)  # by sample index
    # a chat request of a thinking model: its output split into reasoning and content;
    # after delta seq s its client has said[s-1] = (reasoning chars, content chars) of
    # marks[s-1]'s sample
    think: Reasoning | None = None
    said: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stream = self.adm.stream


def step_frames(live: Live, log_tokens: Callable[[bool, float, int], None]
                ) -> list[dict[str, Any]]:
    """Frames for every step the stream has produced since the last call: start once,
    then one delta per step that carried tokens or text, each with a resume mark.
    `log_tokens`: see Timings.token."""
    live.queued = False
    stream, frames = live.stream, []
    out = stream.output  # cumulative; each step below is already folded into it
    while (step := stream.take_step()) is not None:
        live.last = out
        if not live.started:
            live.started = True
            frames.append(start_frame(live.rid, out, stream.queue_time))
        live.track.token(len(step.new_token_ids), log_tokens)
        frame = (_delta(live, out, step.index, step.new_token_ids, step.text_delta)
                 if live.think is None else _split_delta(live, out, step))
        if frame is not None:
            frames.append(frame)
    return frames


def _delta(live: Live, out: RequestOutput, index: int, new: list[int], text: str,
           reasoning: str = "") -> dict[str, Any] | None:
    """The delta frame of one step of sample `index` (None: it carries nothing), its
    resume mark noted. `text` is the content, `reasoning` the thinking (with live.think)."""
    if not (new or text or reasoning):
        return None
    live.seq += 1
    c = out.outputs[index]
    live.marks.append((index, len(c.token_ids), c.text_len))
    calls = _tool_call_deltas(live, index, text) if live.tools is not None else None
    return delta_frame(live.rid, live.seq, index, len(out.outputs), new, text,
                       c.logprobs if live.logprobs else None, tool_calls=calls,
                       reasoning=reasoning)


def _split_delta(live: Live, out: RequestOutput, step: StepOutput) -> dict[str, Any] | None:
    """A step of a thinking model's sample: its text split into reasoning and content."""
    assert live.think is not None
    reasoning, content = live.think.push(step.index, step.text_delta, len(step.new_token_ids),
                                         step.finished)
    frame = _delta(live, out, step.index, step.new_token_ids, content, reasoning)
    if frame is not None:
        live.said.append(live.think.samples[step.index].said)
    return frame


def _tool_call_deltas(live: Live, index: int, text: str) -> list[dict[str, Any]]:
    """The tool-call deltas (OpenAI's shape) that a sample's new text completes."""
    assert live.tools is not None
    stream = live.calls.get(index)
    if stream is None:
        stream = live.calls[index] = live.tools.stream()
    return [c for d in stream.push(text) for c in d.get("tool_calls", ())]


def replay(live: Live, after_seq: int) -> list[dict[str, Any]]:
    """Deltas for everything sent after `after_seq`: one per sample, merged; the marks
    and seq are rewound to `after_seq` first, so the replay is numbered from there."""
    if live.think is not None:
        return _split_replay(live, after_seq)
    have: dict[int, tuple[int, int]] = {}
    for index, ntok, nchar in live.marks[:after_seq]:
        have[index] = (ntok, nchar)
    del live.marks[after_seq:]
    live.seq = after_seq
    frames = []
    outputs = live.stream.output.outputs
    for c in outputs:
        ntok, nchar = have.get(c.index, (0, 0))
        if len(c.token_ids) > ntok or c.text_len > nchar:
            live.seq += 1
            live.marks.append((c.index, len(c.token_ids), c.text_len))
            frames.append(delta_frame(live.rid, live.seq, c.index, len(outputs),
                                      c.token_ids[ntok:], c.text[nchar:],
                                      (c.logprobs or []) if live.logprobs else None, ntok))
    return frames


def _split_replay(live: Live, after_seq: int) -> list[dict[str, Any]]:
    """replay() for a thinking model's request: each sample's reasoning and content
    past what the client had (`said`), and its tokens up to what was split."""
    assert live.think is not None
    have: dict[int, tuple[int, int, int]] = {}
    for (index, ntok, _), (nr, nc) in zip(live.marks[:after_seq], live.said[:after_seq]):
        have[index] = (ntok, nr, nc)
    del live.marks[after_seq:], live.said[after_seq:]
    live.seq = after_seq
    frames = []
    outputs = live.stream.output.outputs
    for c in outputs:
        ntok, nr, nc = have.get(c.index, (0, 0, 0))
        s = live.think.samples[c.index]
        reasoning, content = s.reasoning[nr:], s.content[nc:]
        if s.tokens > ntok or reasoning or content:
            live.seq += 1
            live.marks.append((c.index, s.tokens, s.chars))
            live.said.append((nr + len(reasoning), nc + len(content)))
            frames.append(delta_frame(live.rid, live.seq, c.index, len(outputs),
                                      c.token_ids[ntok:s.tokens], content,
                                      (c.logprobs or []) if live.logprobs else None, ntok,
                                      reasoning=reasoning))
    return frames


def cached_tokens(out: RequestOutput | None) -> dict[str, int]:
    """Prompt tokens whose KV was reused: found on the device, or loaded from the host
    tier (memory / Redis)."""
    if out is None:
        return {"device": 0, "host": 0}
    host = out.num_host_cached_tokens
    return {"device": out.num_cached_tokens - host, "host": host}


def start_frame(rid: str, out: RequestOutput, queue_time: float) -> dict[str, Any]:
    return {"type": "start", "id": rid, "prompt_tokens": len(out.prompt_token_ids),
            "cached_tokens": cached_tokens(out), "queue_ms": round(queue_time * 1000, 3)}


def delta_frame(rid: str, seq: int, index: int, n: int, token_ids: list[int], text: str,
                logprobs: list | None, start: int | None = None,
                tool_calls: list[dict[str, Any]] | None = None,
                reasoning: str = "") -> dict[str, Any]:
    """A delta frame; `logprobs` is the sample's cumulative list, whose entries for
    `token_ids` start at `start` (default: they are its tail). `tool_calls`: the
    tool-call deltas the text completed (none: no field). `reasoning`: the thinking
    the delta adds (none: no field; `text` is then the answer only)."""
    d: dict[str, Any] = {"type": "delta", "id": rid, "seq": seq, "text": text,
                         "token_ids": token_ids}
    if reasoning:
        d["reasoning"] = reasoning
    if n > 1:
        d["index"] = index
    if tool_calls:
        d["tool_calls"] = tool_calls
    if logprobs is not None:
        at = len(logprobs) - len(token_ids) if start is None else start
        d["logprobs"] = [{"token_id": x.token_id, "logprob": x.logprob,
                          "top": [[t, v] for t, v in x.top]}
                         for x in logprobs[at:at + len(token_ids)]] if token_ids else []
    return d


def spec_timings(spec: tuple[int, int, int]) -> dict[str, float]:
    """done.timings' speculative-decoding fields, from (verifying steps, proposed,
    accepted)."""
    steps, proposed, accepted = spec
    return {"spec_steps": steps, "spec_proposed": proposed, "spec_accepted": accepted,
            "spec_acceptance": round(accepted / proposed, 4) if proposed else 0.0,
            "spec_accepted_per_step": round(accepted / steps, 4) if steps else 0.0}


def done_frame(live: Live, reason: str) -> dict[str, Any]:
    """The stream's done frame, ended for `reason` (an engine finish reason), from the
    last output it was sent (`live.last`)."""
    last, tools, calls = live.last, live.tools, live.calls
    completion = sum(len(o.token_ids) for o in last.outputs) if last else 0
    done: dict[str, Any] = {
        "type": "done", "id": live.rid, "status": STATUS.get(reason, "failed"),
        "finish_reason": FINISH.get(reason, "error"),
        "usage": {"prompt_tokens": len(live.stream.output.prompt_token_ids),
                  "completion_tokens": completion,
                  "cached_tokens": cached_tokens(last)},
        "timings": live.track.summary(completion, live.stream.queue_time),
    }
    spec = last.spec if last is not None else None
    if spec is not None:
        done["timings"].update(spec_timings(spec))
    think = live.think
    reasons = [FINISH.get(o.finish_reason or "error", "error") for o in last.outputs] if last else []
    if tools is not None and last is not None:
        # the complete calls (ids as their deltas had them) and the text around them
        # (a replay after a resume resends text, not tool-call deltas: this is the record)
        calls_out: list[dict[str, Any]] = []
        content: list[str | None] = []
        for i, o in enumerate(last.outputs):
            stream = calls.get(i)
            if stream is None:
                stream = tools.stream()
                stream.push(o.text if think is None else think.samples[i].content)
            stream.finish()
            msg = stream.message()
            for call in msg.get("tool_calls", []):
                calls_out.append({**call, "index": i} if len(last.outputs) > 1 else call)
            content.append(msg["content"])
            if stream.found_calls and reasons[i] == "stop":
                reasons[i] = "tool_calls"
        done["tool_calls"] = calls_out
        done["content"] = content[0] if len(content) == 1 else content
        done["finish_reason"] = reasons[0] if len(reasons) == 1 else done["finish_reason"]
    if last and len(last.outputs) > 1:
        done["finish_reasons"] = reasons
    return done

"""One chat turn for the APIs whose streams are typed events rather than chat-completion
chunks (OpenAI Responses, service/responses_api.py; Anthropic Messages,
service/anthropic_api.py). Each translates its request into a `Turn` (chat messages in
the form tools.check_messages gives, tools, sampling, thinking options), admits it here,
and renders the events a `TurnStream` yields: reasoning text, answer text, the start of
a tool call and fragments of its arguments. The splitting of reasoning from the answer
(service/reasoning.py) and the reading of calls out of the text (service/tool_formats.py)
are the chat endpoint's, so every API sees the same model output the same way."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine import SamplingParams
from service import tools as tool_calls
from service.completion_jobs import (Job, compile_constraint, end_all, failure, outputs,
                                     submit_all, with_tool_constraint)
from service.gateway import Gateway, Principal
from service.protocol import ProtocolError
from service.reasoning import ThinkOptions


@dataclass
class Turn:
    messages: list[dict[str, Any]]  # OpenAI chat messages (tools.check_messages' form)
    params: SamplingParams
    tools: tool_calls.Tools | None = None
    think: ThinkOptions = field(default_factory=ThinkOptions)


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int  # the call's place among this turn's calls
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    text: str  # the next fragment of the call's arguments (JSON text)


Event = ReasoningDelta | TextDelta | CallStart | CallArguments


@dataclass
class Outcome:
    """How a turn ended, once its stream is exhausted."""

    finish: str | None = None  # stop | length | abort | error (the engine's)
    stop: str | int | None = None  # the stop string (or token id) that ended it
    text: str = ""
    reasoning: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # {id, name, arguments}
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    failure: ProtocolError | None = None


async def admit(gw: Gateway, principal: Principal, turn: Turn,
                continued: list[int] | None = None) -> TurnStream:
    """Admit the turn (or raise ProtocolError): its tools' constraint and its format
    compiled first, its prompt rendered by the model's chat template. `continued`: the
    output token ids another replica had already turned into events (a tool-less turn
    continued here): the request goes on from them, and its stream yields only what
    follows."""
    if turn.params.n != 1:
        raise ProtocolError("invalid_request", "this API generates one answer a request")
    tools = tool_calls.for_model(turn.tools, gw.engine.tokenizer)
    params = gw.think.engine_params(with_tool_constraint(turn.params, tools), turn.think)
    await compile_constraint(gw, principal, params)
    if continued is not None and tools is not None:
        raise ProtocolError("invalid_request", "a turn with tools is not continued elsewhere")
    jobs = await submit_all(gw, principal, params, {"messages": turn.messages}, True, tools,
                            turn.think, continued)
    return TurnStream(gw, jobs[0], tools)


class TurnStream:
    """The admitted turn's events (iterate once), then `outcome`. Closing the iteration
    early (the client went away) or `close()` aborts the request and frees its blocks."""

    def __init__(self, gw: Gateway, job: Job, tools: tool_calls.Tools | None) -> None:
        self.gw, self.job, self.tools = gw, job, tools
        self.outcome = Outcome()
        self._calls = tools.stream() if tools is not None else None
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self.reasoning_tokens = 0  # tokens of deltas that ended inside the thinking
        self._closed = False

    @property
    def request_id(self) -> str:
        return self.job.adm.stream.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.job.adm.stream.output.prompt_token_ids)

    def close(self) -> None:
        """Abort the request if it still runs, and release it (once)."""
        if not self._closed:
            self._closed = True
            end_all(self.gw, [self.job])

    async def __aiter__(self) -> AsyncIterator[Event]:
        async for batch in self.batches():
            for event in batch:
                yield event

    @property
    def output_token_ids(self) -> Sequence[int]:
        """The output token ids so far (all of them: what was continued, too; the
        engine's own list, not a copy)."""
        last = self.job.last
        return last.outputs[0].token_ids if last is not None else ()

    async def batches(self) -> AsyncIterator[list[Event]]:
        """The events each engine output brings, as one list (maybe empty): after a
        list, `output_token_ids` are exactly the tokens those events came from."""
        job, gw = self.job, self.gw
        try:
            async for _, last in outputs([job]):
                job.timings.token(len(last.new_token_ids), gw.log_tokens)
                done = last.outputs[last.index].finish_reason
                if done and (done == "error" or job.adm.failure is not None):
                    continue  # the outcome's failure says it
                text, reasoning = last.delta_text, ""
                if job.think is not None:
                    reasoning, text = job.think.push(last.index, text, len(last.new_token_ids),
                                                     done is not None)
                    if job.think.samples[0].splitter.thinking:
                        self.reasoning_tokens += len(last.new_token_ids)
                batch: list[Event] = []
                if reasoning:
                    self._reasoning.append(reasoning)
                    batch.append(ReasoningDelta(reasoning))
                batch += self._answer(text, done is not None)
                yield batch
            self._end()
        finally:
            self.close()

    def _answer(self, text: str, done: bool) -> list[Event]:
        if self._calls is None:
            if text:
                self._text.append(text)
            return [TextDelta(text)] if text else []
        deltas = self._calls.push(text) + (self._calls.finish() if done else [])
        events: list[Event] = []
        for d in deltas:
            if "content" in d:
                self._text.append(d["content"])
                events.append(TextDelta(d["content"]))
                continue
            for c in d["tool_calls"]:
                if "id" in c:
                    events.append(CallStart(c["index"], c["id"], c["function"]["name"]))
                elif c["function"]["arguments"]:
                    events.append(CallArguments(c["index"], c["function"]["arguments"]))
        return events

    def _end(self) -> None:
        o, last = self.outcome, self.job.last
        o.failure = failure([self.job])
        o.prompt_tokens = self.prompt_tokens
        o.text, o.reasoning = "".join(self._text), "".join(self._reasoning)
        o.calls = list(self._calls.calls) if self._calls is not None else []
        if last is not None:
            out = last.outputs[0]
            o.finish, o.stop = out.finish_reason, out.stop_reason
            o.output_tokens = len(out.token_ids)
            o.cached_tokens = last.num_cached_tokens

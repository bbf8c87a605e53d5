"""One completion request's prompts as jobs: each admitted (all or none), their outputs
merged as they come, the reason the request failed if it did, its usage, and the end of
every admission however the response ends. The response shapes are the endpoint's."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine import SamplingParams
from engine.outputs import RequestOutput
from service import openai_request
from service import tools as tool_calls
from service.delivery import Timings
from service.gateway import Admission, Gateway, Principal
from service.protocol import ProtocolError
from service.reasoning import Reasoning, ThinkOptions


@dataclass(slots=True, eq=False)
class Job:
    """One prompt of a request: its admission, the choice index of its first sample
    (a list of prompts gives each prompt `n` consecutive indexes) and, with `echo`,
    the prompt text its choices start with."""

    adm: Admission
    base: int = 0
    echo: str | None = None
    logprobs: bool = False  # asked for: an echoed prompt then lists its tokens too
    timings: Timings = field(init=False)
    last: RequestOutput | None = None
    think: Reasoning | None = None  # a thinking model's chat: reasoning split from content

    def __post_init__(self) -> None:
        self.timings = Timings(self.adm.arrival)


def with_tool_constraint(params: SamplingParams,
                         tools: tool_calls.Tools | None) -> SamplingParams:
    """A required or named tool choice's constraint as the request's response_format
    (it cannot have one of its own)."""
    if tools is None or not tools.constrained:
        return params
    if params.response_format is not None:
        raise ProtocolError("invalid_request", "a required or named tool_choice cannot be "
                            "combined with response_format")
    try:
        return dataclasses.replace(params, response_format=tool_calls.constraint(tools))
    except ValueError as e:
        raise ProtocolError("invalid_request", str(e)) from None


async def compile_constraint(gw: Gateway, principal: Principal,
                             params: SamplingParams) -> None:
    """A response_format compiles (or fails) before admission, counted for its key
    meanwhile (Gateway.hold)."""
    if params.response_format is None:
        return
    hold = gw.hold(principal, None, compiling=not gw.engine.format_started(params))
    try:
        await gw.engine.prepare(params)
    except ValueError as e:
        raise ProtocolError("invalid_request", str(e)) from None
    finally:
        gw.unhold(hold)


async def submit_all(gw: Gateway, principal: Principal, params: SamplingParams,
                     body: dict[str, Any], chat: bool,
                     tools: tool_calls.Tools | None = None,
                     think: ThinkOptions | None = None,
                     continued: list[int] | None = None) -> list[Job]:
    """Admit each prompt, or none: a refusal releases the ones already admitted. A large
    prompt is tokenized off the event loop first (Gateway.prompt_ids). `think`: a chat's
    template variables and reasoning budget. `continued`: the output token ids a stream
    resumed here had sent (one prompt, one choice): the request goes on from them."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise ProtocolError("invalid_request", "echo must be a boolean")
    if chat and echo:
        raise ProtocolError("invalid_request", "echo is a /v1/completions parameter")
    prompts, messages = (([None], openai_request.inputs(body, True)[1]) if chat
                         else (openai_request.prompts(body), None))
    template_tools = None
    if messages is not None:
        messages, template_tools = tool_calls.render(messages, tools,
                                                     gw.engine.template_renders_tools)
    if continued is not None and (len(prompts) != 1 or params.n != 1 or echo):
        raise ProtocolError("invalid_request", "only a one-prompt, one-choice stream can be "
                            "continued on another replica")
    if len(prompts) * params.n > openai_request.MAX_PROMPT_SAMPLES:
        raise ProtocolError("invalid_request", f"{len(prompts)} prompts x n = {params.n} is over "
                            f"{openai_request.MAX_PROMPT_SAMPLES} samples in one request")
    constrained = params.response_format is not None
    kwargs = gw.think.template_kwargs(think, constrained) if think is not None else None
    ids: list[list[int] | None] = [None] * len(prompts)
    for i, prompt in enumerate(prompts):
        if gw.off_loop(prompt, messages):
            ids[i] = await gw.prompt_ids(prompt, messages, None, True, template_tools, kwargs)
    jobs: list[Job] = []
    try:
        for i, prompt in enumerate(prompts):
            adm = gw.submit(principal, params, None, prompt, messages, tools=template_tools,
                            prompt_ids=ids[i], template_kwargs=kwargs,
                            output_token_ids=continued or ())
            job = Job(adm, i * params.n, None, params.logprobs is not None)
            jobs.append(job)  # (ended with the others from here on, whatever comes next)
            gw.http_inflight.add(adm)
            if think is not None:
                job.think = gw.think.request(adm.stream.output.prompt_token_ids, think,
                                             params.n, constrained)
                if job.think is not None and continued:  # the split of what was sent
                    first = adm.stream.output.outputs[0]
                    job.think.samples[0].prime(first.text, len(first.token_ids))
            if echo:
                job.echo = _echo_text(gw, adm, prompt)  # type: ignore[arg-type]
    except BaseException:  # a refusal, or a fault of ours: nothing admitted may leak
        end_all(gw, jobs)
        raise
    return jobs


def _echo_text(gw: Gateway, adm: Admission, prompt: str | list[int]) -> str:
    """The prompt as text: as sent, or its token ids decoded ("" with no tokenizer,
    as the completion text itself is then)."""
    if isinstance(prompt, str):
        return prompt
    tok = gw.engine.tokenizer
    return tok.decode(adm.stream.output.prompt_token_ids) if tok is not None else ""


def end_all(gw: Gateway, jobs: list[Job]) -> None:
    """Release every prompt's admission, aborting one still running (the client went
    away, or a sibling prompt was refused)."""
    for job in jobs:
        gw.http_inflight.discard(job.adm)
        gw.end(job.adm)


def failure(jobs: list[Job]) -> ProtocolError | None:
    """Why the request failed, if it did: the server ended it (shutdown), or the engine
    failed one of its prompts (internal_error)."""
    for job in jobs:
        if job.adm.failure is not None:
            return job.adm.failure
    for job in jobs:
        last = job.last
        if last is not None and any(o.finish_reason == "error" for o in last.outputs):
            return ProtocolError("internal_error", last.error
                                 or "the engine failed the request")
    return None


async def outputs(jobs: list[Job]) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """Each prompt's deltas as they come. One prompt iterates its stream; several
    share one wake-up (the streams' listener) and are drained in turn. A delta is
    consumed before the next take(), which is what keeps its cumulative fields valid."""
    if len(jobs) == 1:
        job = jobs[0]
        async for job.last in job.adm.stream:  # noqa: B020 - each output lands on its job
            yield job, job.last
        return
    ready = asyncio.Event()
    for job in jobs:
        job.adm.stream.listener = ready.set
    live = jobs
    while live:
        ready.clear()  # no await between here and the wait unless a delta was taken
        took = False
        for job in live:
            out = job.adm.stream.take()
            if out is not None:
                took, job.last = True, out
                yield job, out
        live = [job for job in live if not job.adm.stream.finished]
        if live and not took:
            await ready.wait()


def usage(jobs: list[Job]) -> dict[str, Any]:
    prompt = sum(len(j.adm.stream.output.prompt_token_ids) for j in jobs)
    completion = sum(len(o.token_ids) for j in jobs if j.last for o in j.last.outputs)
    cached = sum(j.last.num_cached_tokens for j in jobs if j.last)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}

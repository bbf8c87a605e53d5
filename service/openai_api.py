"""OpenAI-compatible HTTP endpoints: /v1/chat/completions, /v1/completions, /v1/models,
streaming as server-sent events, and /v1/warm. Errors use OpenAI's error shape. The
request is read by service.openai_request, its prompts run as service.completion_jobs,
and the response objects are service.openai_shapes'."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.outputs import RequestOutput
from service import openai_request, sse_resume
from service.live_record import FOLLOW_POLL, LiveRecord
from service.shared_state import shared_state_of
from service import openai_shapes as shapes
from service import tools as tool_calls
from service.completion_jobs import (Job, compile_constraint, end_all, failure, outputs,
                                     submit_all, usage, with_tool_constraint)
from service.gateway import Gateway
from service.protocol import ProtocolError


HTTP_STATUS = {"invalid_request": 400, "unauthorized": 401, "model_not_found": 404,
               "context_length_exceeded": 400, "message_too_big": 413, "too_many_inflight": 429,
               "overloaded": 429, "slow_consumer": 429, "duplicate_id": 400,
               "internal_error": 500, "rate_limited": 429}


def error_response(e: ProtocolError) -> JSONResponse:
    status = HTTP_STATUS.get(e.code, 400)
    headers = None
    if status == 429:  # whole seconds, rounded up (RFC 9110)
        headers = {"Retry-After": str(max(1, math.ceil(e.retry_after or 1)))}
    return error_json(status, e.code, e.message, headers)


def error_json(status: int, code: str, message: str,
               headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error body: {"error": {message, type, param, code}}."""
    return JSONResponse(_body_of(status, code, message), status_code=status, headers=headers)


def _body_of(status: int, code: str, message: str) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            405: "invalid_request_error", 413: "invalid_request_error",
            429: "rate_limit_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _error_body(e: ProtocolError) -> dict[str, Any]:
    return _body_of(HTTP_STATUS.get(e.code, 400), e.code, e.message)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's HTTPException (no route, wrong method, no such static file) in the
    same shape, so a client sees one error format whatever the path. Keeps the
    exception's headers: a 405 carries Allow."""
    status = getattr(exc, "status_code", 500)
    headers = getattr(exc, "headers", None)
    where = f"{request.method} {request.url.path}"
    if status == 404:
        return error_json(404, "not_found", f"no such endpoint: {where}", headers)
    if status == 405:
        allow = (headers or {}).get("Allow", "")
        return error_json(405, "method_not_allowed",
                          f"method not allowed: {where} (allowed: {allow})", headers)
    return error_json(status, f"http_{status}", getattr(exc, "detail", "") or where, headers)


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def _complete(request: Request, chat: bool) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        principal = gw.authenticate(request.headers.get("authorization"))
        body = await openai_request.read_body(request)
        jobs, table, tools = await _admit(gw, principal, body, chat)
    except ProtocolError as e:
        gw.metrics.errors.labels(e.code).inc()
        return error_response(e)
    meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
            "model": gw.config.model_name}
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = _sse(gw, jobs, meta, chat, include_usage, table, tools)
        if not sse_resume.wants_resume(request.headers, request.query_params):
            return _event_stream(_with_ids(chunks, jobs))
        streams = sse_streams(request)
        cid = str(meta["id"])
        live = None
        if streams.shared is not None and len(jobs) == 1 and tools is None \
                and len(jobs[0].adm.stream.output.outputs) == 1 and jobs[0].echo is None:
            live = streams.live(cid)
            if not await live.open({"tenant": principal.tenant, "chat": chat, "body": body,
                                    "created": meta["created"]}):
                live = None
        s = streams.start(cid, principal.tenant, _numbered(chunks, jobs), live,
                          _token_ids(jobs[0]))
        return _event_stream(streams.follow(s, -1))
    return await _whole(gw, jobs, meta, chat, table, tools)


async def _admit(gw: Gateway, principal: Any, body: dict[str, Any], chat: bool,
                 continued: list[int] | None = None
                 ) -> tuple[list[Job], list[bytes] | None, tool_calls.Tools | None]:
    """Check a completion body and admit its prompts (or raise ProtocolError): the
    jobs, the byte table its logprobs need, its tools. `continued`: the output token ids
    a stream resumed here had already sent (one prompt, one choice)."""
    openai_request.check_types(body, chat)
    openai_request.check_served(gw, body)
    tools = tool_calls.for_model(openai_request.tools_of(body, chat), gw.engine.tokenizer)
    think = openai_request.think_of(body, chat)
    params = with_tool_constraint(openai_request.sampling_params(body, chat,
                                                                 gw.sampling_defaults), tools)
    params = gw.think.engine_params(params, think)  # max_reasoning_tokens, for the engine
    await compile_constraint(gw, principal, params)
    # chat logprobs carry each token's bytes (the table was built when the model loaded)
    table = gw.engine.byte_table(False) if chat and params.logprobs is not None else None
    jobs = await submit_all(gw, principal, params, body, chat, tools, think, continued)
    return jobs, table, tools


def _token_ids(job: Job) -> Callable[[], Sequence[int]]:
    """The job's output token ids so far (one prompt, one choice; not a copy)."""
    return lambda: job.last.outputs[0].token_ids if job.last is not None else ()


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _numbered(events: AsyncIterator[str], jobs: list[Job]
                    ) -> AsyncIterator[tuple[str, int]]:
    """Each event with the output tokens sent up to it (all choices)."""
    try:
        async for event in events:
            yield event, sum(len(o.token_ids) for job in jobs if job.last
                             for o in job.last.outputs)
    finally:
        await events.aclose()  # type: ignore[attr-defined]  # (an async generator)


async def _with_ids(events: AsyncIterator[str], jobs: list[Job], seq: int = 0
                    ) -> AsyncIterator[str]:
    """A stream that is not resumable: its events with their ids all the same (a client
    sees where it was), numbered from `seq`."""
    try:
        async for event in events:
            tokens = sum(len(o.token_ids) for job in jobs if job.last for o in job.last.outputs)
            yield f"{event[:-1]}id: {seq}:{tokens}\n\n"  # (after data: old readers see it first)
            seq += 1
    finally:
        await events.aclose()  # type: ignore[attr-defined]  # (an async generator)


def sse_streams(request: Request) -> sse_resume.SseStreams:
    state = request.app.state
    if getattr(state, "sse_streams", None) is None:
        limits = state.gateway.config.limits
        shared = shared_state_of(request.app) if limits.resume_grace > 0 else None
        state.sse_streams = sse_resume.SseStreams(limits, shared)
    return state.sse_streams  # type: ignore[no-any-return]


async def cancel_stream(request: Request) -> Response:
    """DELETE /v1/chat/completions/{id}/events (and /v1/completions/...): stop a
    resumable stream held here (a client that is done with it: no grace to wait out)."""
    gw: Gateway = request.app.state.gateway
    sid = request.path_params["id"]
    try:
        principal = gw.authenticate(request.headers.get("authorization"))
    except ProtocolError as e:
        return error_response(e)
    streams = sse_streams(request)
    s = streams.streams.get(sid)
    if s is None or s.tenant != principal.tenant:
        return error_json(404, "not_found", f"no resumable stream {sid!r} here")
    streams.cancel(s)
    return JSONResponse({"id": sid, "cancelled": True})


async def stream_events(request: Request) -> Response:
    """GET /v1/chat/completions/{id}/events (and /v1/completions/...): a resumable
    stream's events after Last-Event-ID (or ?after=), then the rest as they come; a
    stream this replica does not hold is continued from its record (shared_state)."""
    gw: Gateway = request.app.state.gateway
    sid = request.path_params["id"]
    try:
        principal = gw.authenticate(request.headers.get("authorization"))
        after, tokens = sse_resume.parse_position(request.headers.get("last-event-id"),
                                                  request.query_params.get("after"))
        streams = sse_streams(request)
        s = streams.streams.get(sid)
        # held here, and the client's last event is this replica's own (not one another
        # replica numbered while continuing it)
        if s is not None and s.tenant == principal.tenant and (
                tokens is None or after < 0 or after >= len(s.events)
                or f"id: {after}:{tokens}\n" in s.events[after]):
            return _event_stream(streams.follow(s, after))
        return await _continue(request, gw, streams, principal, sid, after, tokens)
    except ProtocolError as e:
        gw.metrics.errors.labels(e.code).inc()
        return error_response(e)


async def _continue(request: Request, gw: Gateway, streams: sse_resume.SseStreams,
                    principal: Any, sid: str, after: int, tokens: int | None) -> Response:
    """A stream another replica runs (or ran), from its live record: its events after
    `after` as that replica records them, and, once its heartbeat has lapsed (the
    replica is gone), the stream taken over and continued here from the recorded tokens
    (service/live_record.py). A `Last-Event-ID` whose TOKENS the recorded event at SEQ
    does not carry is refused: the client holds another continuation than the record."""
    live = streams.live(sid) if streams.shared is not None else None
    got = await live.read(0) if live is not None else None
    if live is None or got is None or not isinstance(got[0], dict) \
            or got[0].get("tenant") != principal.tenant:
        return error_json(404, "not_found", f"no resumable stream {sid!r} here: unknown, "
                          "not resumable, or past its grace period")
    record, steps, alive = got
    events = [e for step in steps if step is not None for e in step[0]]
    if after >= len(events):
        raise ProtocolError("invalid_request", "Last-Event-ID (or after) is past what the "
                            "stream's record holds")
    if tokens is not None and after >= 0 and f"id: {after}:{tokens}\n" not in events[after]:
        raise ProtocolError("invalid_request", "Last-Event-ID names an event the stream's "
                            "record holds otherwise (another continuation of it)")
    return _event_stream(_follow_live(gw, streams, principal, live, record, steps, alive,
                                      after))


async def _follow_live(gw: Gateway, streams: sse_resume.SseStreams, principal: Any,
                       live: LiveRecord, record: dict[str, Any], steps: list[Any], alive: bool,
                       after: int) -> AsyncIterator[str]:
    events = [e for step in steps if step is not None for e in step[0]]
    ended, read, at = None in steps, len(steps), after + 1
    while True:
        while at < len(events):
            at += 1
            yield events[at - 1]
        if ended:
            return
        if not alive:
            try:
                s = await _take_over(gw, streams, principal, live, record)
            except ProtocolError as e:  # (the 200 went out: the error is the last event)
                gw.metrics.errors.labels(e.code).inc()
                yield f"data: {json.dumps(_error_body(e))}\n\n"
                return
            if s is not None:
                async for event in streams.follow(s, at - 1):
                    yield event
                return
        await asyncio.sleep(FOLLOW_POLL)
        got = await live.read(read)
        if got is None or got[0] is None:
            return  # Redis is down, or the record expired: what was sent is all
        _, new, alive = got
        read += len(new)
        ended = None in new
        events += [e for step in new if step is not None for e in step[0]]


async def _take_over(gw: Gateway, streams: sse_resume.SseStreams, principal: Any,
                     live: LiveRecord, record: dict[str, Any]) -> sse_resume.SseStream | None:
    """Own a stream whose replica's heartbeat lapsed and continue it here from every
    token recorded, recording on (None: another replica took it, or it ended)."""
    if not await live.take():
        return None
    got = await live.read(0)
    if got is None:
        live.release()  # (Redis is failing: another try may take it later)
        return None
    steps = [step for step in got[1] if step is not None]
    events = [e for step in steps for e in step[0]]
    tokens = [t for step in steps for t in step[1]]
    live.events, live.tokens = len(events), len(tokens)
    body, chat = record["body"], bool(record["chat"])
    try:
        jobs, table, tools = await _admit(gw, principal, body, chat, tokens)
    except BaseException:
        live.release()  # (another try may take it)
        raise
    gw.metrics.resumes.labels("continued").inc()
    meta = {"id": live.rid, "created": record["created"], "model": gw.config.model_name}
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    chunks = _sse(gw, jobs, meta, chat, include_usage, table, tools, continued=True)
    return streams.start(live.rid, principal.tenant, _numbered(chunks, jobs), live,
                         _token_ids(jobs[0]), events)


async def models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        gw.authenticate(request.headers.get("authorization"))
    except ProtocolError as e:
        return error_response(e)
    return JSONResponse({"object": "list", "data": [model_card(gw)]})


def model_card(gw: Gateway) -> dict[str, Any]:
    """The served model's object, as /v1/models lists it and /v1/models/{id} returns it."""
    return {"id": gw.config.model_name, "object": "model", "created": 0, "owned_by": "tidewire",
            "max_model_len": gw.engine.max_model_len,
            # what a request that leaves a sampling field unset gets
            "sampling_defaults": gw.sampling_defaults}


async def model(request: Request) -> Response:
    """GET /v1/models/{id}: the model object, or 404 model_not_found."""
    gw: Gateway = request.app.state.gateway
    try:
        gw.authenticate(request.headers.get("authorization"))
        wanted = request.path_params["model"]
        if wanted != gw.config.model_name:
            raise ProtocolError("model_not_found", f"model {wanted!r} is not served here")
    except ProtocolError as e:
        return error_response(e)
    return JSONResponse(model_card(gw))


async def warm(request: Request) -> Response:
    """POST /v1/warm {messages | prompt}: prefill that prefix into the cache without
    generating; answers {prompt_tokens, cached_tokens, reused_tokens{device, host}}."""
    gw: Gateway = request.app.state.gateway
    try:
        principal = gw.authenticate(request.headers.get("authorization"))
        body = await openai_request.read_body(request)
        extra = sorted(set(body) - {"messages", "prompt", "model"})
        if extra:
            raise ProtocolError("invalid_request", f"unknown parameter(s): {', '.join(extra)}")
        openai_request.check_served(gw, body)
        prompt, messages = openai_request.inputs(body, chat="messages" in body)
        if messages is not None:  # earlier calls and results, as a tool-less template takes them
            messages = tool_calls.render(messages, None, gw.engine.template_renders_tools)[0]
        return JSONResponse(await gw.warm(principal, None, prompt, messages))
    except ProtocolError as e:
        gw.metrics.errors.labels(e.code).inc()
        return error_response(e)


async def _whole(gw: Gateway, jobs: list[Job], meta: dict[str, Any], chat: bool,
                 table: list[bytes] | None, tools: tool_calls.Tools | None = None) -> Response:
    try:
        async for job, last in outputs(jobs):
            job.timings.token(len(last.new_token_ids), gw.log_tokens)
            if job.think is not None:
                _split(job, last)
    finally:
        end_all(gw, jobs)
    failed = failure(jobs)
    if failed is not None:
        gw.metrics.errors.labels(failed.code).inc()
        return error_response(failed)
    tok = gw.engine.tokenizer
    choices = [shapes.choice(job, o, chat, tok, table, tools) for job in jobs
               for o in job.last.outputs]  # type: ignore[union-attr]  # every job has ended
    obj = "chat.completion" if chat else "text_completion"
    return JSONResponse({**meta, "object": obj, "choices": choices, "usage": usage(jobs)})


async def _sse(gw: Gateway, jobs: list[Job], meta: dict[str, Any], chat: bool,
               include_usage: bool, table: list[bytes] | None,
               tools: tool_calls.Tools | None = None,
               continued: bool = False) -> AsyncIterator[str]:
    """Role first (chat), then content deltas, finish_reason on each choice's last
    chunk, optionally a usage chunk, then [DONE]. A client that disconnects closes this
    generator, which aborts the request. With tools, a choice's text goes through its
    CallStream: content and tool-call deltas. `continued`: a stream resumed here, whose
    client has its start (no role chunk, no echo)."""
    tok = gw.engine.tokenizer
    streams: dict[tuple[int, int], tool_calls.CallStream] = {}
    try:
        if chat and not continued:
            n = len(jobs[0].adm.stream.output.outputs)
            yield shapes.chunk(meta, chat, [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for i in range(n)])
        for chunk in shapes.echo_chunks(meta, [] if continued else jobs, tok):
            yield chunk
        async for job, last in outputs(jobs):
            job.timings.token(len(last.new_token_ids), gw.log_tokens)
            done = last.outputs[last.index].finish_reason
            if done and (done == "error" or job.adm.failure is not None):
                continue  # the error event below ends the stream instead
            text, reasoning = last.delta_text, ""
            if job.think is not None:
                reasoning, text = _split(job, last)
            if not (text or reasoning or last.new_token_ids or done):
                continue
            c: dict[str, Any] = {"index": job.base + last.index,
                                 "finish_reason": shapes.finish_of(done)}
            if chat and tools is not None:
                if reasoning:  # (it comes before the answer's text and calls)
                    yield shapes.chunk(meta, chat, [{"index": c["index"], "finish_reason": None,
                                                     "delta": {"reasoning_content": reasoning}}])
                for chunk in shapes.tool_chunks(meta, streams, job, last.index, text,
                                                bool(done), tools):
                    yield chunk
                calls = streams[(job.base, last.index)]
                c["delta"] = {}  # the text went out as the chunks above
                if done == "stop" and calls.found_calls:
                    c["finish_reason"] = "tool_calls"
                if not done and job.logprobs is False:
                    continue  # this chunk would carry nothing
            elif chat:
                c["delta"] = shapes.chat_delta(text, reasoning)
            else:
                c["text"] = text
            c["logprobs"] = shapes.logprobs_of(last, last.index, len(last.new_token_ids), chat,
                                               tok, table)
            sampled = job.adm.stream.sampled_at
            yield shapes.chunk(meta, chat, [c])
            # the response asks for the next chunk once this one's send has returned
            if sampled:
                gw.log_sse_delivery(time.monotonic() - sampled)
        failed = failure(jobs)
        if failed is not None:
            # OpenAI's mid-stream error: an event whose data is the error body (the
            # openai SDKs raise it as APIError), and no [DONE]
            gw.metrics.errors.labels(failed.code).inc()
            yield f"data: {json.dumps(_error_body(failed))}\n\n"
            return
        if include_usage:
            yield shapes.chunk(meta, chat, [], usage(jobs))
        yield "data: [DONE]\n\n"
    finally:
        end_all(gw, jobs)


def _split(job: Job, last: RequestOutput) -> tuple[str, str]:
    """A thinking model's delta as (reasoning, content)."""
    assert job.think is not None
    done = last.outputs[last.index].finish_reason is not None
    return job.think.push(last.index, last.delta_text, len(last.new_token_ids), done)

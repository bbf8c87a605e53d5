"""OpenAI-compatible HTTP endpoints: /v1/chat/completions, /v1/completions, /v1/models,
streaming as server-sent events. Errors use OpenAI's error shape."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine import SamplingParams
from engine.structured import from_structured_outputs
from engine.outputs import CompletionOutput, RequestOutput
from service.gateway import Admission, Gateway, Principal
from service.protocol import MAX_MESSAGES, ProtocolError, check_depth
from service.delivery import Timings
from service import tools as tool_calls

HTTP_STATUS = {"invalid_request": 400, "unauthorized": 401, "model_not_found": 404,
               "context_length_exceeded": 400, "message_too_big": 413, "too_many_inflight": 429,
               "overloaded": 429, "slow_consumer": 429, "duplicate_id": 400,
               "internal_error": 500, "rate_limited": 429}
# OpenAI request fields -> SamplingParams fields (None: accepted and handled elsewhere).
FIELDS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
          "temperature": "temperature", "top_p": "top_p", "n": "n", "stop": "stop",
          "seed": "seed", "presence_penalty": "presence_penalty",
          "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias",
          "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
          "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
          "stop_token_ids": "stop_token_ids", "skip_special_tokens": "skip_special_tokens",
          "speculative": "speculative",
          "response_format": "response_format", "structured_outputs": None,
          "model": None, "stream": None, "stream_options": None, "user": None,
          "logprobs": None, "top_logprobs": None, "messages": None, "prompt": None,
          "echo": None, "tools": None, "tool_choice": None, "parallel_tool_calls": None}


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


def sampling_params(body: dict[str, Any], chat: bool,
                    defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The body's sampling fields; `defaults` fill the ones it leaves unset (or null)."""
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ProtocolError("invalid_request", f"unknown parameter(s): {', '.join(unknown)}")
    kw: dict[str, Any] = {FIELDS[k]: v for k, v in body.items()  # type: ignore[misc]
                          if FIELDS.get(k) and v is not None}
    lp = body.get("logprobs")
    if chat and lp:
        kw["logprobs"] = body.get("top_logprobs") or 0
    elif not chat and isinstance(lp, int) and not isinstance(lp, bool):
        kw["logprobs"] = lp
    kw.setdefault("max_tokens", 16 if not chat else 512)
    if body.get("structured_outputs") is not None:
        if body.get("response_format") is not None:
            raise ProtocolError("invalid_request",
                                "give response_format or structured_outputs, not both")
        try:
            kw["response_format"] = from_structured_outputs(body["structured_outputs"])
        except ValueError as e:
            raise ProtocolError("invalid_request", str(e)) from None
    try:
        merged: dict[str, Any] = {**(defaults or {}), **kw}
        return SamplingParams(**merged)
    except (TypeError, ValueError) as e:
        raise ProtocolError("invalid_request", str(e)) from None


async def _body(request: Request) -> dict[str, Any]:
    """The request's JSON object, read up to the limit on a socket message
    (`--max-message-bytes`): a larger body is refused with 413 message_too_big before it
    is read whole."""
    limit = request.app.state.gateway.config.limits.max_message_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ProtocolError("message_too_big", f"the body ({declared} bytes) is over "
                            f"{limit} bytes (--max-message-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ProtocolError("message_too_big", f"the body is over {limit} bytes "
                                "(--max-message-bytes)")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError is one
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise ProtocolError("invalid_request", f"the body is not valid JSON ({reason})") from None
    check_depth(body, what="body")
    if not isinstance(body, dict):
        raise ProtocolError("invalid_request", "the body must be a JSON object")
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise ProtocolError("invalid_request", f"messages holds at most {MAX_MESSAGES} messages, "
                            f"got {len(messages)}")
    return body


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


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


def _check_types(body: dict[str, Any], chat: bool) -> None:
    """The request fields the handlers read directly (not through SamplingParams): the
    right JSON type or null."""
    def kind(name: str, types: tuple[type, ...], what: str) -> None:
        value = body.get(name)
        if value is not None and (not isinstance(value, types) or (
                bool not in types and isinstance(value, bool))):
            raise ProtocolError("invalid_request", f"{name} must be {what}")

    kind("stream", (bool,), "a boolean")
    kind("stream_options", (dict,), "an object")
    kind("user", (str,), "a string")
    kind("model", (str,), "a string")
    if chat:
        kind("logprobs", (bool,), "a boolean")
        kind("top_logprobs", (int,), "an integer")
    opts = body.get("stream_options") or {}
    if not isinstance(opts.get("include_usage", False), bool):
        raise ProtocolError("invalid_request", "stream_options.include_usage must be a boolean")


def _served(gw: Gateway, body: dict[str, Any]) -> None:
    """A request that names a model must name the served one (404 model_not_found)."""
    model = body.get("model", gw.config.model_name)
    if model != gw.config.model_name:
        raise ProtocolError("model_not_found", f"model {model!r} is not served here")


async def _complete(request: Request, chat: bool) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        principal = gw.authenticate(request.headers.get("authorization"))
        body = await _body(request)
        _check_types(body, chat)
        _served(gw, body)
        tools = _tools(body, chat)
        params = sampling_params(body, chat, gw.sampling_defaults)
        if tools is not None and tools.constrained:
            if params.response_format is not None:
                raise ProtocolError("invalid_request", "a required or named tool_choice cannot "
                                    "be combined with response_format")
            try:
                params = dataclasses.replace(params,
                                             response_format=tool_calls.constraint(tools))
            except ValueError as e:
                raise ProtocolError("invalid_request", str(e)) from None
        if params.response_format is not None:  # it compiles (or fails) before admission,
            hold = gw.hold(principal, None,  # counted for its key meanwhile
                           compiling=not gw.engine.format_started(params))
            try:
                await gw.engine.prepare(params)
            except ValueError as e:
                raise ProtocolError("invalid_request", str(e)) from None
            finally:
                gw.unhold(hold)
        # chat logprobs carry each token's bytes (the table was built when the model loaded)
        table = (gw.engine.byte_table(False)
                 if chat and params.logprobs is not None else None)
        jobs = await _submit_all(gw, principal, params, body, chat, tools)
    except ProtocolError as e:
        gw.metrics.errors.labels(e.code).inc()
        return error_response(e)
    meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
            "model": gw.config.model_name}
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_sse(gw, jobs, meta, chat, include_usage, table, tools),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _whole(gw, jobs, meta, chat, table, tools)


@dataclass(slots=True, eq=False)
class _Job:
    """One prompt of a request: its admission, the choice index of its first sample
    (a list of prompts gives each prompt `n` consecutive indexes) and, with `echo`,
    the prompt text its choices start with."""

    adm: Admission
    base: int = 0
    echo: str | None = None
    logprobs: bool = False  # asked for: an echoed prompt then lists its tokens too
    timings: Timings = field(init=False)
    last: RequestOutput | None = None

    def __post_init__(self) -> None:
        self.timings = Timings(self.adm.arrival)


def _tools(body: dict[str, Any], chat: bool) -> tool_calls.Tools | None:
    if not chat:
        extra = [k for k in ("tools", "tool_choice", "parallel_tool_calls") if k in body]
        if extra:
            raise ProtocolError("invalid_request", f"{extra[0]} is a /v1/chat/completions "
                                "parameter")
        return None
    return tool_calls.parse(body)


async def _submit_all(gw: Gateway, principal: Principal, params: SamplingParams,
                      body: dict[str, Any], chat: bool,
                      tools: tool_calls.Tools | None = None) -> list[_Job]:
    """Admit each prompt, or none: a refusal releases the ones already admitted. A large
    prompt is tokenized off the event loop first (Gateway.prompt_ids)."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise ProtocolError("invalid_request", "echo must be a boolean")
    if chat and echo:
        raise ProtocolError("invalid_request", "echo is a /v1/completions parameter")
    prompts, messages = ([None], _inputs(body, True)[1]) if chat else (_prompts(body), None)
    template_tools = None
    if messages is not None:
        messages, template_tools = tool_calls.render(messages, tools,
                                                     gw.engine.template_renders_tools)
    if len(prompts) * params.n > MAX_PROMPT_SAMPLES:
        raise ProtocolError("invalid_request", f"{len(prompts)} prompts x n = {params.n} is over "
                            f"{MAX_PROMPT_SAMPLES} samples in one request")
    ids: list[list[int] | None] = [None] * len(prompts)
    for i, prompt in enumerate(prompts):
        if gw.off_loop(prompt, messages):
            ids[i] = await gw.prompt_ids(prompt, messages, None, True, template_tools)
    jobs: list[_Job] = []
    try:
        for i, prompt in enumerate(prompts):
            adm = gw.submit(principal, params, None, prompt, messages, tools=template_tools,
                            prompt_ids=ids[i])
            job = _Job(adm, i * params.n, None, params.logprobs is not None)
            jobs.append(job)  # (ended with the others from here on, whatever comes next)
            gw.http_inflight.add(adm)
            if echo:
                job.echo = _echo_text(gw, adm, prompt)  # type: ignore[arg-type]
    except BaseException:  # a refusal, or a fault of ours: nothing admitted may leak
        _end(gw, jobs)
        raise
    return jobs


# prompts x n of one /v1/completions request (each sample is a request in flight)
MAX_PROMPT_SAMPLES = 256


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """`prompt` as OpenAI takes it: a string, a list of token ids, or a list of either
    (each its own prompt, with `n` choices of its own)."""
    prompt = body.get("prompt")
    if _one_prompt(prompt):
        return [prompt]  # type: ignore[list-item]  # _one_prompt checked it
    if isinstance(prompt, list) and prompt and all(_one_prompt(p) for p in prompt):
        return list(prompt)
    raise ProtocolError("invalid_request", "prompt must be a string, a list of token ids, "
                        "or a non-empty list of either")


def _one_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return bool(prompt)
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def _echo_text(gw: Gateway, adm: Admission, prompt: str | list[int]) -> str:
    """The prompt as text: as sent, or its token ids decoded ("" with no tokenizer,
    as the completion text itself is then)."""
    if isinstance(prompt, str):
        return prompt
    tok = gw.engine.tokenizer
    return tok.decode(adm.stream.output.prompt_token_ids) if tok is not None else ""


def _end(gw: Gateway, jobs: list[_Job]) -> None:
    """Release every prompt's admission, aborting one still running (the client went
    away, or a sibling prompt was refused)."""
    for job in jobs:
        gw.http_inflight.discard(job.adm)
        gw.end(job.adm)


def _failure(jobs: list[_Job]) -> ProtocolError | None:
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


async def _outputs(jobs: list[_Job]) -> AsyncIterator[tuple[_Job, RequestOutput]]:
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


async def warm(request: Request) -> Response:
    """POST /v1/warm {messages | prompt}: prefill that prefix into the cache without
    generating; answers {prompt_tokens, cached_tokens, reused_tokens{device, host}}."""
    gw: Gateway = request.app.state.gateway
    try:
        principal = gw.authenticate(request.headers.get("authorization"))
        body = await _body(request)
        extra = sorted(set(body) - {"messages", "prompt", "model"})
        if extra:
            raise ProtocolError("invalid_request", f"unknown parameter(s): {', '.join(extra)}")
        _served(gw, body)
        prompt, messages = _inputs(body, chat="messages" in body)
        if messages is not None:  # earlier calls and results, as a tool-less template takes them
            messages = tool_calls.render(messages, None, gw.engine.template_renders_tools)[0]
        return JSONResponse(await gw.warm(principal, None, prompt, messages))
    except ProtocolError as e:
        gw.metrics.errors.labels(e.code).inc()
        return error_response(e)


def _inputs(body: dict[str, Any], chat: bool) -> tuple[Any, Any]:
    if chat:
        return None, tool_calls.check_messages(body.get("messages"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if not (isinstance(prompt, str) and prompt) and not (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        raise ProtocolError("invalid_request", "prompt must be a string or a list of token ids")
    return prompt, None


def _usage(jobs: list[_Job]) -> dict[str, Any]:
    prompt = sum(len(j.adm.stream.output.prompt_token_ids) for j in jobs)
    completion = sum(len(o.token_ids) for j in jobs if j.last for o in j.last.outputs)
    cached = sum(j.last.num_cached_tokens for j in jobs if j.last)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finish(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "stop", "error": "error"}.get(reason or "")


def _text(tok: Any, token_id: int) -> str:
    """A token's text ("" for a model without a tokenizer, whose outputs have none)."""
    return tok.decode([token_id]) if tok is not None else ""


def _token_lp(tok: Any, table: list[bytes] | None, token_id: int, logprob: float) -> dict[str, Any]:
    text = _text(tok, token_id)
    raw = table[token_id] if table is not None and token_id < len(table) else text.encode()
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def _logprobs(out: RequestOutput, index: int, new: int, chat: bool, tok: Any,
              table: list[bytes] | None = None) -> Any:
    lps = out.outputs[index].logprobs
    if lps is None:
        return None
    lps = lps[-new:] if new else []
    if chat:
        return {"content": [{**_token_lp(tok, table, x.token_id, x.logprob),
                             "top_logprobs": [_token_lp(tok, table, t, v) for t, v in x.top]}
                            for x in lps]}
    return {"tokens": [_text(tok, x.token_id) for x in lps],
            "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{_text(tok, t): v for t, v in x.top} for x in lps]}


def _prompt_logprobs(job: _Job, tok: Any) -> dict[str, list[Any]]:
    """Legacy logprobs of an echoed prompt: its tokens' text; the engine computes no
    prompt logprobs, so their values are null (OpenAI's first prompt token's are too)."""
    ids = job.adm.stream.output.prompt_token_ids
    return {"tokens": [_text(tok, t) for t in ids], "token_logprobs": [None] * len(ids),
            "top_logprobs": [None] * len(ids)}


def _choice(job: _Job, o: CompletionOutput, chat: bool, tok: Any,
            table: list[bytes] | None, tools: tool_calls.Tools | None = None) -> dict[str, Any]:
    """One sample of a finished request, in the non-streaming response."""
    assert job.last is not None
    c: dict[str, Any] = {"index": job.base + o.index, "finish_reason": _finish(o.finish_reason)}
    lp = _logprobs(job.last, o.index, len(o.token_ids), chat, tok, table)
    if chat and tools is not None:
        calls = tool_calls.CallStream(tools.constrained)
        calls.push(o.text)
        calls.finish()
        c["message"] = calls.message()
        if calls.found_calls and o.finish_reason == "stop":
            c["finish_reason"] = "tool_calls"
    elif chat:
        c["message"] = {"role": "assistant", "content": o.text}
    elif job.echo is not None:
        c["text"] = job.echo + o.text
        if lp is not None:
            lp = {k: v + lp[k] for k, v in _prompt_logprobs(job, tok).items()}
    else:
        c["text"] = o.text
    c["logprobs"] = lp
    return c


async def _whole(gw: Gateway, jobs: list[_Job], meta: dict[str, Any], chat: bool,
                 table: list[bytes] | None, tools: tool_calls.Tools | None = None) -> Response:
    try:
        async for job, last in _outputs(jobs):
            job.timings.token(len(last.new_token_ids), gw.log_tokens)
    finally:
        _end(gw, jobs)
    failed = _failure(jobs)
    if failed is not None:
        gw.metrics.errors.labels(failed.code).inc()
        return error_response(failed)
    tok = gw.engine.tokenizer
    choices = [_choice(job, o, chat, tok, table, tools) for job in jobs
               for o in job.last.outputs]  # type: ignore[union-attr]  # every job has ended
    obj = "chat.completion" if chat else "text_completion"
    return JSONResponse({**meta, "object": obj, "choices": choices, "usage": _usage(jobs)})


def _chunk(meta: dict[str, Any], chat: bool, choices: list[dict[str, Any]],
           usage: dict[str, Any] | None = None) -> str:
    obj = {**meta, "object": "chat.completion.chunk" if chat else "text_completion",
           "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _tool_chunks(meta: dict[str, Any], streams: dict[tuple[int, int], tool_calls.CallStream],
                 job: _Job, last: RequestOutput, tools: tool_calls.Tools) -> Iterator[str]:
    """A delta's text as content and tool-call chunks (its CallStream's), the stream's
    remainder too once the choice is done."""
    key = (job.base, last.index)
    calls = streams.get(key)
    if calls is None:
        calls = streams[key] = tool_calls.CallStream(tools.constrained)
    deltas = calls.push(last.delta_text)
    if last.outputs[last.index].finish_reason:
        deltas += calls.finish()
    for d in deltas:
        yield _chunk(meta, True, [{"index": job.base + last.index, "delta": d,
                                   "finish_reason": None}])


def _echo_chunks(meta: dict[str, Any], jobs: list[_Job], tok: Any) -> Iterator[str]:
    """Streaming `echo`: each choice's prompt text comes first, in a chunk of its own."""
    for job in jobs:
        if job.echo is None:
            continue
        lp = _prompt_logprobs(job, tok) if job.logprobs else None
        for i in range(len(job.adm.stream.output.outputs)):
            yield _chunk(meta, False, [{"index": job.base + i, "text": job.echo,
                                        "logprobs": lp, "finish_reason": None}])


async def _sse(gw: Gateway, jobs: list[_Job], meta: dict[str, Any], chat: bool,
               include_usage: bool, table: list[bytes] | None,
               tools: tool_calls.Tools | None = None) -> AsyncIterator[str]:
    """Role first (chat), then content deltas, finish_reason on each choice's last
    chunk, optionally a usage chunk, then [DONE]. A client that disconnects closes this
    generator, which aborts the request. With tools, a choice's text goes through its
    CallStream: content and tool-call deltas."""
    tok = gw.engine.tokenizer
    streams: dict[tuple[int, int], tool_calls.CallStream] = {}
    try:
        if chat:
            yield _chunk(meta, chat, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                       "finish_reason": None}
                                      for i in range(len(jobs[0].adm.stream.output.outputs))])
        for chunk in _echo_chunks(meta, jobs, tok):
            yield chunk
        async for job, last in _outputs(jobs):
            job.timings.token(len(last.new_token_ids), gw.log_tokens)
            done = last.outputs[last.index].finish_reason
            if done and (done == "error" or job.adm.failure is not None):
                continue  # the error event below ends the stream instead
            if not (last.delta_text or last.new_token_ids or done):
                continue
            c: dict[str, Any] = {"index": job.base + last.index, "finish_reason": _finish(done)}
            if chat and tools is not None:
                for chunk in _tool_chunks(meta, streams, job, last, tools):
                    yield chunk
                calls = streams[(job.base, last.index)]
                c["delta"] = {}  # the text went out as the chunks above
                if done == "stop" and calls.found_calls:
                    c["finish_reason"] = "tool_calls"
                if not done and job.logprobs is False:
                    continue  # this chunk would carry nothing
            elif chat:
                c["delta"] = {"content": last.delta_text}
            else:
                c["text"] = last.delta_text
            c["logprobs"] = _logprobs(last, last.index, len(last.new_token_ids), chat, tok, table)
            sampled = job.adm.stream.sampled_at
            yield _chunk(meta, chat, [c])
            # the response asks for the next chunk once this one's send has returned
            if sampled:
                gw.log_sse_delivery(time.monotonic() - sampled)
        failed = _failure(jobs)
        if failed is not None:
            # OpenAI's mid-stream error: an event whose data is the error body (the
            # openai SDKs raise it as APIError), and no [DONE]
            gw.metrics.errors.labels(failed.code).inc()
            yield f"data: {json.dumps(_error_body(failed))}\n\n"
            return
        if include_usage:
            yield _chunk(meta, chat, [], _usage(jobs))
        yield "data: [DONE]\n\n"
    finally:
        _end(gw, jobs)

"""OpenAI-compatible HTTP endpoints: /v1/chat/completions, /v1/completions, /v1/models,
streaming as server-sent events. Errors use OpenAI's error shape."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine import SamplingParams
from engine.outputs import RequestOutput
from service.gateway import Admission, Gateway
from service.protocol import ProtocolError
from service.ws import Timings

HTTP_STATUS = {"invalid_request": 400, "unauthorized": 401, "model_not_found": 404,
               "context_length_exceeded": 400, "message_too_big": 413, "too_many_inflight": 429,
               "overloaded": 429, "slow_consumer": 429, "duplicate_id": 400,
               "internal_error": 500}
# OpenAI request fields -> SamplingParams fields (None: accepted and handled elsewhere).
FIELDS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
          "temperature": "temperature", "top_p": "top_p", "n": "n", "stop": "stop",
          "seed": "seed", "presence_penalty": "presence_penalty",
          "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias",
          "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
          "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
          "stop_token_ids": "stop_token_ids", "skip_special_tokens": "skip_special_tokens",
          "model": None, "stream": None, "stream_options": None, "user": None,
          "logprobs": None, "top_logprobs": None, "messages": None, "prompt": None}


def error_response(e: ProtocolError) -> JSONResponse:
    status = HTTP_STATUS.get(e.code, 400)
    headers = {"Retry-After": "1"} if status == 429 else None
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": e.message, "type": kind, "param": None,
                                   "code": e.code}}, status_code=status, headers=headers)


def sampling_params(body: dict[str, Any], chat: bool) -> SamplingParams:
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ProtocolError("invalid_request", f"unknown parameter(s): {', '.join(unknown)}")
    kw = {FIELDS[k]: v for k, v in body.items() if FIELDS.get(k) and v is not None}
    lp = body.get("logprobs")
    if chat and lp:
        kw["logprobs"] = body.get("top_logprobs") or 0
    elif not chat and isinstance(lp, int) and not isinstance(lp, bool):
        kw["logprobs"] = lp
    kw.setdefault("max_tokens", 16 if not chat else 512)
    try:
        return SamplingParams(**kw)
    except (TypeError, ValueError) as e:
        raise ProtocolError("invalid_request", str(e)) from None


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ProtocolError("invalid_request", "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ProtocolError("invalid_request", "the body must be a JSON object")
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
    return JSONResponse({"object": "list", "data": [
        {"id": gw.config.model_name, "object": "model", "created": 0, "owned_by": "tidewire",
         "max_model_len": gw.engine.engine.max_model_len}]})


async def _complete(request: Request, chat: bool) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        principal = gw.authenticate(request.headers.get("authorization"))
        body = await _body(request)
        model = body.get("model", gw.config.model_name)
        if model != gw.config.model_name:
            raise ProtocolError("model_not_found", f"model {model!r} is not served here")
        params = sampling_params(body, chat)
        prompt, messages = _inputs(body, chat)
        adm = gw.submit(principal, params, None, prompt, messages)
    except ProtocolError as e:
        gw.metrics.errors.labels(e.code).inc()
        return error_response(e)
    meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
            "model": gw.config.model_name}
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_sse(gw, adm, meta, chat, include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _whole(gw, adm, meta, chat)


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
        prompt, messages = _inputs(body, chat="messages" in body)
        return JSONResponse(await gw.warm(principal, None, prompt, messages))
    except ProtocolError as e:
        gw.metrics.errors.labels(e.code).inc()
        return error_response(e)


def _inputs(body: dict[str, Any], chat: bool) -> tuple[Any, Any]:
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ProtocolError("invalid_request", "messages must be a non-empty list")
        out = []
        for m in msgs:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str) or not isinstance(m.get("role"), str):
                raise ProtocolError("invalid_request", "each message needs a role and content")
            out.append({"role": m["role"], "content": content})
        return None, out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if not (isinstance(prompt, str) and prompt) and not (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        raise ProtocolError("invalid_request", "prompt must be a string or a list of token ids")
    return prompt, None


def _usage(adm: Admission, last: RequestOutput | None) -> dict[str, Any]:
    prompt = len(adm.stream.output.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in last.outputs) if last else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens if last else 0}}


def _finish(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "stop", "error": "error"}.get(reason or "")


def _logprobs(out: RequestOutput, index: int, new: int, chat: bool, tok: Any) -> Any:
    lps = out.outputs[index].logprobs
    if lps is None:
        return None
    lps = lps[-new:] if new else []
    if chat:
        return {"content": [{"token": tok.decode([x.token_id]), "logprob": x.logprob,
                             "top_logprobs": [{"token": tok.decode([t]), "logprob": v}
                                              for t, v in x.top]} for x in lps]}
    return {"tokens": [tok.decode([x.token_id]) for x in lps],
            "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{tok.decode([t]): v for t, v in x.top} for x in lps]}


async def _whole(gw: Gateway, adm: Admission, meta: dict[str, Any], chat: bool) -> Response:
    last, reason = None, "error"
    track = Timings(adm.arrival)
    try:
        async for last in adm.stream:
            track.token(len(last.new_token_ids), gw)
        reason = last.finish_reason if last else "error"
    finally:
        if not adm.stream.finished:
            gw.engine.abort(adm.stream.request_id)
        gw.release(adm, reason)
    assert last is not None
    tok = gw.engine.tokenizer
    choices = []
    for o in last.outputs:
        c: dict[str, Any] = {"index": o.index, "finish_reason": _finish(o.finish_reason)}
        if chat:
            c["message"] = {"role": "assistant", "content": o.text}
        else:
            c["text"] = o.text
        c["logprobs"] = _logprobs(last, o.index, len(o.token_ids), chat, tok)
        choices.append(c)
    obj = "chat.completion" if chat else "text_completion"
    return JSONResponse({**meta, "object": obj, "choices": choices, "usage": _usage(adm, last)})


def _chunk(meta: dict[str, Any], chat: bool, choices: list[dict[str, Any]],
           usage: dict[str, Any] | None = None) -> str:
    obj = {**meta, "object": "chat.completion.chunk" if chat else "text_completion",
           "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(gw: Gateway, adm: Admission, meta: dict[str, Any], chat: bool,
               include_usage: bool) -> AsyncIterator[str]:
    """Role first (chat), then content deltas, finish_reason on each choice's last
    chunk, optionally a usage chunk, then [DONE]. A client that disconnects closes this
    generator, which aborts the request."""
    last, reason = None, "error"
    track = Timings(adm.arrival)
    tok = gw.engine.tokenizer
    try:
        if chat:
            yield _chunk(meta, chat, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                       "finish_reason": None}
                                      for i in range(len(adm.stream.output.outputs))])
        async for last in adm.stream:
            track.token(len(last.new_token_ids), gw)
            done = last.outputs[last.index].finish_reason
            if not (last.delta_text or last.new_token_ids or done):
                continue
            c: dict[str, Any] = {"index": last.index, "finish_reason": _finish(done)}
            if chat:
                c["delta"] = {"content": last.delta_text}
            else:
                c["text"] = last.delta_text
            c["logprobs"] = _logprobs(last, last.index, len(last.new_token_ids), chat, tok)
            sampled = adm.stream.sampled_at
            yield _chunk(meta, chat, [c])
            # the response asks for the next chunk once this one's send has returned
            if sampled:
                gw.log_sse_delivery(time.monotonic() - sampled)
        reason = last.finish_reason if last else "error"
        if include_usage:
            yield _chunk(meta, chat, [], _usage(adm, last))
        yield "data: [DONE]\n\n"
    finally:
        if not adm.stream.finished:
            gw.engine.abort(adm.stream.request_id)
            reason = "abort"
        gw.release(adm, reason)

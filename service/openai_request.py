"""Reading an OpenAI-shaped request: its body (JSON, up to --max-message-bytes), the
types of the fields the handlers read, the model it names, its sampling fields, its
tools and its prompt or messages. Shared by the completion endpoints, /v1/warm and the
vLLM utility endpoints."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from engine import SamplingParams
from engine.structured import from_structured_outputs
from service import reasoning
from service import tools as tool_calls
from service.gateway import Gateway
from service.protocol import MAX_MESSAGES, ProtocolError, check_depth

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
          "echo": None, "tools": None, "tool_choice": None, "parallel_tool_calls": None,
          **{name: None for name in reasoning.FIELDS}}


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


async def read_body(request: Request) -> dict[str, Any]:
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


def check_types(body: dict[str, Any], chat: bool) -> None:
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


def check_served(gw: Gateway, body: dict[str, Any]) -> None:
    """A request that names a model must name the served one (404 model_not_found)."""
    model = body.get("model", gw.config.model_name)
    if model != gw.config.model_name:
        raise ProtocolError("model_not_found", f"model {model!r} is not served here")


def tools_of(body: dict[str, Any], chat: bool) -> tool_calls.Tools | None:
    if not chat:
        extra = [k for k in ("tools", "tool_choice", "parallel_tool_calls") if k in body]
        if extra:
            raise ProtocolError("invalid_request", f"{extra[0]} is a /v1/chat/completions "
                                "parameter")
        return None
    return tool_calls.parse(body)


def think_of(body: dict[str, Any], chat: bool) -> reasoning.ThinkOptions | None:
    """A chat request's template variables and reasoning budget (service.reasoning)."""
    if not chat:
        extra = [k for k in reasoning.FIELDS if k in body]
        if extra:
            raise ProtocolError("invalid_request", f"{extra[0]} is a /v1/chat/completions "
                                "parameter")
        return None
    return reasoning.think_options(body)


def inputs(body: dict[str, Any], chat: bool) -> tuple[Any, Any]:
    if chat:
        return None, tool_calls.check_messages(body.get("messages"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if not (isinstance(prompt, str) and prompt) and not (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        raise ProtocolError("invalid_request", "prompt must be a string or a list of token ids")
    return prompt, None


# prompts x n of one /v1/completions request (each sample is a request in flight)
MAX_PROMPT_SAMPLES = 256


def prompts(body: dict[str, Any]) -> list[str | list[int]]:
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

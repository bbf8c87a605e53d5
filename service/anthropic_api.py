"""The Anthropic Messages API: `POST /v1/messages`, whole or streamed as Anthropic's
server-sent events (message_start, content_block_start / _delta / _stop, message_delta,
message_stop), for the clients written against it (the `anthropic` SDKs, Claude Code and
the agents built on them). The request becomes a chat turn (service/chat_turn.py):

- `system` (a string or text blocks) is the system message; `messages` are user and
  assistant turns whose content is a string or blocks: `text`, `tool_use` (an assistant's
  call: id, name, input) and `tool_result` (a user's answer to one: tool_use_id, content,
  is_error); `thinking` blocks of earlier turns are dropped (the template does not
  replay them), images are refused (the served model reads text).
- `tools` ({name, description, input_schema}) and `tool_choice` ({type: auto | any |
  tool | none}, disable_parallel_tool_use) are the chat endpoint's tools and choices
  (auto, required, a named function, none).
- `thinking` ({type: enabled, budget_tokens}, adaptive, between_tools, or disabled)
  switches a thinking model's template (and with a budget sets its reasoning budget);
  its reasoning comes back as a `thinking` block.
- `output_config.format` ({type: json_schema, schema}) constrains the answer to the
  schema, as the chat endpoint's response_format; `output_config.effort` is accepted.
- `max_tokens` (required), `stop_sequences`, `temperature`, `top_p`, `top_k` (which
  current SDKs send only as extra body fields), and Tidewire's `ignore_eos`; `metadata`, `service_tier`,
  `cache_control` (the prefix cache is automatic), `container`, `diagnostics`,
  `inference_geo`, `speed`, `user_profile_id` and `workspace_id` are accepted and left
  alone.

The key may come as `x-api-key` (Anthropic's header) or as a Bearer token. Errors are
Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from service import chat_turn, openai_request
from service import tools as tool_calls
from service.chat_turn import CallArguments, CallStart, ReasoningDelta, TextDelta, Turn
from service.gateway import Gateway
from service.openai_api import HTTP_STATUS
from service.protocol import ProtocolError
from service.reasoning import MAX_BUDGET, ThinkOptions

# request fields: those read below, and those accepted and left alone
FIELDS = {"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p",
          "top_k", "stream", "tools", "tool_choice", "thinking", "output_config",
          "metadata", "service_tier", "cache_control", "container", "diagnostics",
          "inference_geo", "speed", "user_profile_id", "workspace_id", "ignore_eos"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def error_response(e: ProtocolError) -> JSONResponse:
    status = HTTP_STATUS.get(e.code, 400)
    headers = {"retry-after": str(max(1, round(e.retry_after or 1)))} if status == 429 else None
    return JSONResponse(error_body(status, e.message), status_code=status, headers=headers)


def authorization(request: Request) -> str | None:
    """The request's key as a Bearer header: Anthropic's x-api-key, or Authorization."""
    key = request.headers.get("x-api-key")
    return f"Bearer {key}" if key else request.headers.get("authorization")


def _bad(message: str) -> ProtocolError:
    return ProtocolError("invalid_request", message)


def _text_of(blocks: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(f"{where} must be a string or a list of text blocks")
    texts = []
    for b in blocks:
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise _bad(f"{where} must be a string or a list of text blocks")
        texts.append(b["text"])
    return "".join(texts)


def messages_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`system` and `messages` as OpenAI chat messages (tool_use -> an assistant's
    tool_calls, tool_result -> a tool message)."""
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text_of(body["system"], "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where}.role must be user or assistant")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content must be a string or a list of content blocks")
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind in ("thinking", "redacted_thinking"):
                continue
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise _bad(f"{at}: a tool_use block needs a name and an input object")
                calls.append({"id": str(b.get("id", "")), "type": "function",
                              "function": {"name": b["name"],
                                           "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result" and m["role"] == "user":
                result = b.get("content", "")
                result = _text_of(result, f"{at}.content") if result is not None else ""
                if b.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                            "content": result})
            elif kind in ("image", "document"):
                raise _bad(f"{at}: {kind} blocks are not supported (the served model reads "
                           "text)")
            else:
                raise _bad(f"{at}: unsupported content block {str(kind)[:40]!r} for the "
                           f"{m['role']} role")
        if text or calls:
            msg: dict[str, Any] = {"role": m["role"], "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return tool_calls.check_messages(out)


def tools_of(body: dict[str, Any]) -> tool_calls.Tools | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None and choice is None:
        return None
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools must be a list")
    functions = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise _bad(f"tools[{i}] must be {{name, description, input_schema}}")
        if t.get("type") not in (None, "custom"):
            raise _bad(f"tools[{i}]: server tools ({str(t.get('type'))[:40]}) are not supported")
        functions.append({"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""),
            "parameters": t.get("input_schema", {"type": "object", "properties": {}})}})
    openai_choice: Any = None
    parallel = True
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise _bad('tool_choice must be {"type": "auto" | "any" | "tool" | "none"}')
        parallel = not choice.get("disable_parallel_tool_use", False)
        openai_choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            openai_choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tool_calls.parse({"tools": functions or None, "tool_choice": openai_choice,
                             "parallel_tool_calls": parallel})


def think_of(body: dict[str, Any]) -> ThinkOptions:
    thinking = body.get("thinking")
    if thinking is None:
        return ThinkOptions()
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return ThinkOptions({"enable_thinking": False})
    if kind in ("adaptive", "between_tools"):
        return ThinkOptions({"enable_thinking": True})
    budget = thinking.get("budget_tokens") if kind == "enabled" else None
    if kind != "enabled" or not isinstance(budget, int) or isinstance(budget, bool) \
            or not 1 <= budget <= MAX_BUDGET:
        raise _bad(f'thinking must be {{"type": "enabled", "budget_tokens": 1..{MAX_BUDGET}}}, '
                   '{"type": "adaptive"}, {"type": "between_tools"} or {"type": "disabled"}')
    return ThinkOptions({"enable_thinking": True}, budget)


def format_of(body: dict[str, Any]) -> dict[str, Any] | None:
    """output_config.format as the chat endpoint's response_format."""
    config = body.get("output_config")
    if config is None:
        return None
    if not isinstance(config, dict) or set(config) - {"format", "effort"}:
        raise _bad("output_config takes format and effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), dict):
        raise _bad('output_config.format must be {"type": "json_schema", "schema": {...}}')
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def turn_of(gw: Gateway, body: dict[str, Any]) -> Turn:
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise _bad(f"unknown parameter(s): {', '.join(unknown)}")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise _bad("max_tokens is required: a positive integer")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list)
                              or not all(isinstance(s, str) for s in stops)):
        raise _bad("stop_sequences must be a list of strings")
    if not isinstance(body.get("stream", False), bool):
        raise _bad("stream must be a boolean")
    sampling = {"max_tokens": max_tokens, "stop": stops or None,
                "response_format": format_of(body),
                **{k: body.get(k) for k in ("temperature", "top_p", "top_k", "ignore_eos")}}
    params = openai_request.sampling_params(sampling, True, gw.sampling_defaults)
    return Turn(messages_of(body), params, tools_of(body), think_of(body))


async def messages(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        principal = gw.authenticate(authorization(request))
        body = await openai_request.read_body(request)
        openai_request.check_served(gw, body)
        if not isinstance(body.get("model"), str):
            raise _bad("model is required")
        turn = turn_of(gw, body)
        stream = await chat_turn.admit(gw, principal, turn)
    except ProtocolError as e:
        gw.metrics.errors.labels(e.code).inc()
        return error_response(e)
    message_id = "msg_" + uuid.uuid4().hex
    if body.get("stream"):
        return StreamingResponse(_events(gw, stream, message_id), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    blocks = Blocks()
    async for event in stream:
        blocks.add(event)
    o = stream.outcome
    if o.failure is not None:
        gw.metrics.errors.labels(o.failure.code).inc()
        return error_response(o.failure)
    return JSONResponse({**_message(gw, message_id),
                         "content": blocks.content(), **_stop(o),
                         "usage": _usage(o.prompt_tokens, o.output_tokens, o.cached_tokens)})


class Blocks:
    """A message's content blocks, built from a turn's events."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._args: dict[int, list[str]] = {}  # each call's arguments text, by call index
        self._calls: dict[int, int] = {}  # block position -> call index

    def add(self, event: chat_turn.Event) -> None:
        last = self.blocks[-1] if self.blocks else None
        if isinstance(event, ReasoningDelta):
            if last is None or last["type"] != "thinking":
                self.blocks.append({"type": "thinking", "thinking": "", "signature": ""})
            self.blocks[-1]["thinking"] += event.text
        elif isinstance(event, TextDelta):
            if last is None or last["type"] != "text":
                self.blocks.append({"type": "text", "text": ""})
            self.blocks[-1]["text"] += event.text
        elif isinstance(event, CallStart):
            self._args[event.index] = []
            self._calls[len(self.blocks)] = event.index
            self.blocks.append({"type": "tool_use", "id": event.id, "name": event.name,
                                "input": {}})
        else:
            self._args[event.index].append(event.text)

    def content(self) -> list[dict[str, Any]]:
        for at, call in self._calls.items():
            self.blocks[at]["input"] = _input(self._args[call])
        return self.blocks


def _input(pieces: list[str]) -> Any:
    """A call's input object from its arguments' text ({} where it is not one)."""
    try:
        value = json.loads("".join(pieces) or "{}")
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _message(gw: Gateway, message_id: str) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant",
            "model": gw.config.model_name}


def _stop(o: chat_turn.Outcome) -> dict[str, Any]:
    """stop_reason and stop_sequence from how the turn ended."""
    if o.calls and o.finish == "stop":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if o.finish == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(o.stop, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": o.stop}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt - cached, "output_tokens": output,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _events(gw: Gateway, stream: chat_turn.TurnStream, message_id: str
                  ) -> AsyncIterator[str]:
    """Anthropic's event sequence. A block opens at its first delta and closes when a
    block of another kind (or another call) begins, or at the end. A client that goes
    away closes this generator, which aborts the request."""
    index, open_kind = -1, None  # the block open now: its index and what it holds
    try:
        yield _sse("message_start", {"message": {
            **_message(gw, message_id), "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": _usage(stream.prompt_tokens, 0, 0)}})
        async for event in stream:
            kind = {ReasoningDelta: "thinking", TextDelta: "text"}.get(type(event), "tool_use")
            if isinstance(event, CallStart) or kind != open_kind:
                if open_kind is not None:
                    yield _sse("content_block_stop", {"index": index})
                index, open_kind = index + 1, kind
                block: dict[str, Any] = (
                    {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                    else {"type": "text", "text": ""} if kind == "text"
                    else {"type": "tool_use", "id": event.id, "name": event.name,  # type: ignore[union-attr]
                          "input": {}})
                yield _sse("content_block_start", {"index": index, "content_block": block})
            if isinstance(event, ReasoningDelta):
                delta = {"type": "thinking_delta", "thinking": event.text}
            elif isinstance(event, TextDelta):
                delta = {"type": "text_delta", "text": event.text}
            elif isinstance(event, CallArguments):
                delta = {"type": "input_json_delta", "partial_json": event.text}
            else:
                continue
            yield _sse("content_block_delta", {"index": index, "delta": delta})
        o = stream.outcome
        if o.failure is not None:
            gw.metrics.errors.labels(o.failure.code).inc()
            status = HTTP_STATUS.get(o.failure.code, 500)
            yield _sse("error", {"error": error_body(status, o.failure.message)["error"]})
            return
        if open_kind is not None:
            yield _sse("content_block_stop", {"index": index})
        yield _sse("message_delta", {"delta": _stop(o), "usage": {
            **_usage(o.prompt_tokens, o.output_tokens, o.cached_tokens)}})
        yield _sse("message_stop", {})
    finally:
        stream.close()

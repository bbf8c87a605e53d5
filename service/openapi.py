"""`GET /openapi.json`: an OpenAPI 3.1 description of the HTTP API (the OpenAI-compatible
endpoints, the utility ones, health), what clients generate code from and what the
test suite fuzzes the live server with (schemathesis, tests/test_openapi.py).

The request schemas say what the server accepts: a field outside them is refused with
400 (`additionalProperties: false`), as the handlers do. Ranges that depend on the
model (the context window, the vocabulary) are not in the schema; the server answers
400 for a value past them."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.sampling_params import (MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                                    MAX_STOP_TOKEN_IDS, MAX_TOKEN_ID, MAX_TOKENS, MAX_TOP_K)
from service.openai_request import MAX_PROMPT_SAMPLES
from service.protocol import MAX_MESSAGES
from service.reasoning import EFFORTS, MAX_BUDGET, MAX_KWARG_CHARS, MAX_TEMPLATE_KWARGS
from service.vllm_api import _version


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _number(lo: float, hi: float, lo_open: bool = False) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "number", "maximum": hi}
    s["exclusiveMinimum" if lo_open else "minimum"] = lo
    return _nullable(s)


def _integer(lo: int, hi: int | None = None) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer", "minimum": lo}
    if hi is not None:
        s["maximum"] = hi
    return _nullable(s)


_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
_STOP = _nullable({"anyOf": [_STOP_STRING, {"type": "array", "items": _STOP_STRING,
                                            "maxItems": MAX_STOP_STRINGS}]})

# The sampling fields both completion endpoints take (docs/protocol.md has the ranges).
SAMPLING: dict[str, Any] = {
    "max_tokens": _integer(1, MAX_TOKENS), "max_completion_tokens": _integer(1, MAX_TOKENS),
    "temperature": _number(0, 100), "top_p": _number(0, 1, lo_open=True),
    "n": _integer(1, 16), "stop": _STOP,
    "seed": _integer(-(2**63), 2**63 - 1),
    "presence_penalty": _number(-2, 2), "frequency_penalty": _number(-2, 2),
    "logit_bias": _nullable({"type": "object", "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                             "maxProperties": MAX_LOGIT_BIAS,
                             "additionalProperties": {"type": "number", "minimum": -100,
                                                      "maximum": 100}}),
    "top_k": _integer(0, MAX_TOP_K), "min_p": _number(0, 1),
    "repetition_penalty": _number(0, 10, lo_open=True), "min_tokens": _integer(0),
    "ignore_eos": _nullable({"type": "boolean"}),
    "stop_token_ids": _nullable({"type": "array", "maxItems": MAX_STOP_TOKEN_IDS,
                                 "items": {"type": "integer", "minimum": 0,
                                           "maximum": MAX_TOKEN_ID}}),
    "skip_special_tokens": _nullable({"type": "boolean"}),
    "speculative": _nullable({"type": "boolean"}),
    "model": {"type": "string"}, "user": {"type": "string"},
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable({"type": "object",
                                 "properties": {"include_usage": {"type": "boolean"}}}),
    "response_format": _nullable({"$ref": "#/components/schemas/ResponseFormat"}),
    "structured_outputs": _nullable({"type": "object"}),
}

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
              "minItems": 1}
_PROMPT = {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS,
                     {"type": "array", "minItems": 1, "maxItems": MAX_PROMPT_SAMPLES,
                      "items": {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]}}]}

_FUNCTION = {"type": "object", "required": ["name"],
             "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                            "description": {"type": "string"},
                            "parameters": {"type": "object"}}}

SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}}},
    "ResponseFormat": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema", "regex", "choice", "grammar"]},
        "json_schema": {"type": "object", "required": ["schema"],
                        "properties": {"name": {"type": "string"}, "schema": {},
                                       "strict": {"type": "boolean"},
                                       "description": {"type": "string"}}},
        "regex": {"type": "string"}, "grammar": {"type": "string"},
        "choice": {"type": "array", "items": {"type": "string"}}}},
    "Message": {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string"},
        "content": {"anyOf": [{"type": "string"}, {"type": "null"},
                              {"type": "array", "items": {"type": "object"}}]},
        "tool_calls": {"type": "array", "items": {"$ref": "#/components/schemas/ToolCall"}},
        "tool_call_id": {"type": "string"}, "name": {"type": "string"}}},
    "ToolCall": {"type": "object", "required": ["id", "type", "function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "required": ["name", "arguments"],
                     "properties": {"name": {"type": "string"},
                                    "arguments": {"type": "string"}}}}},
    "Tool": {"type": "object", "required": ["type", "function"],
             "properties": {"type": {"const": "function"}, "function": _FUNCTION}},
    "ChatCompletionRequest": {
        "type": "object", "required": ["messages"], "additionalProperties": False,
        "properties": {
            **SAMPLING,
            "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
                         "items": {"$ref": "#/components/schemas/Message"}},
            "logprobs": _nullable({"type": "boolean"}), "top_logprobs": _integer(0, 20),
            "tools": _nullable({"type": "array", "minItems": 1, "maxItems": 128,
                                "items": {"$ref": "#/components/schemas/Tool"}}),
            "tool_choice": _nullable({"anyOf": [
                {"enum": ["none", "auto", "required"]},
                {"type": "object", "required": ["type", "function"],
                 "properties": {"type": {"const": "function"},
                                "function": {"type": "object", "required": ["name"],
                                             "properties": {"name": {"type": "string"}}}}}]}),
            "parallel_tool_calls": _nullable({"type": "boolean"}),
            # the chat template's variables and reasoning (docs/http.md, "Reasoning")
            "chat_template_kwargs": _nullable({
                "type": "object", "maxProperties": MAX_TEMPLATE_KWARGS,
                "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]{0,63}$"},
                "additionalProperties": {"anyOf": [
                    {"type": "string", "maxLength": MAX_KWARG_CHARS},
                    {"type": ["number", "boolean", "null"]}]}}),
            "enable_thinking": _nullable({"type": "boolean"}),
            "reasoning_effort": _nullable({"enum": list(EFFORTS)}),
            "max_reasoning_tokens": _integer(1, MAX_BUDGET),
        }},
    "CompletionRequest": {
        "type": "object", "required": ["prompt"], "additionalProperties": False,
        "properties": {**SAMPLING, "prompt": _PROMPT, "echo": _nullable({"type": "boolean"}),
                       "logprobs": _integer(0, 20)}},
    "Usage": {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
              "properties": {"prompt_tokens": {"type": "integer"},
                             "completion_tokens": {"type": "integer"},
                             "total_tokens": {"type": "integer"},
                             "prompt_tokens_details": {"type": "object"}}},
    "ChatCompletion": {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "chat.completion"},
            "created": {"type": "integer"}, "model": {"type": "string"},
            "usage": {"$ref": "#/components/schemas/Usage"},
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "message", "finish_reason"],
                "properties": {
                    "index": {"type": "integer"},
                    "finish_reason": {"enum": ["stop", "length", "tool_calls", "error", None]},
                    "message": {"type": "object", "required": ["role", "content"],
                                "properties": {"role": {"const": "assistant"},
                                               "content": {"type": ["string", "null"]},
                                               "reasoning_content": {
                                                   "type": ["string", "null"]},
                                               "tool_calls": {"type": "array", "items": {
                                                   "$ref": "#/components/schemas/ToolCall"}}}},
                    "logprobs": {"type": ["object", "null"]}}}}}},
    "Completion": {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "text_completion"},
            "created": {"type": "integer"}, "model": {"type": "string"},
            "usage": {"$ref": "#/components/schemas/Usage"},
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "text", "finish_reason"],
                "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                               "finish_reason": {"enum": ["stop", "length", "error", None]},
                               "logprobs": {"type": ["object", "null"]}}}}}},
    "Model": {"type": "object", "required": ["id", "object", "owned_by"],
              "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                             "created": {"type": "integer"}, "owned_by": {"type": "string"},
                             "max_model_len": {"type": "integer"},
                             "sampling_defaults": {"type": "object"}}},
    "WarmRequest": {"type": "object", "additionalProperties": False, "properties": {
        "model": {"type": "string"},
        "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
                     "items": {"$ref": "#/components/schemas/Message"}},
        "prompt": {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]}}},
    "Warmed": {"type": "object", "required": ["prompt_tokens", "cached_tokens", "reused_tokens"],
               "properties": {"prompt_tokens": {"type": "integer"},
                              "cached_tokens": {"type": "integer"},
                              "reused_tokens": {"type": "object"}}},
}


_OPEN = {"type": "object"}  # an object whose fields the handler checks (400 where bad)
_RESPONSE_SAMPLING = {k: SAMPLING[k] for k in (
    "temperature", "top_p", "seed", "top_k", "min_p", "stop", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens")}
# OpenAI Responses (service/responses_api.py) and Anthropic Messages (anthropic_api.py)
SCHEMAS.update({
    "ResponseRequest": {
        "type": "object", "required": ["input"], "additionalProperties": False,
        "properties": {
            **_RESPONSE_SAMPLING, "model": {"type": "string"},
            "input": {"anyOf": [{"type": "string"},
                                {"type": "array", "minItems": 1, "items": _OPEN}]},
            "instructions": _nullable({"type": "string"}),
            "tools": _nullable({"type": "array", "items": _OPEN}),
            "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]},
                                                _OPEN]}),
            "parallel_tool_calls": _nullable({"type": "boolean"}),
            "text": _nullable(_OPEN), "max_output_tokens": _integer(1, MAX_TOKENS),
            "reasoning": _nullable(_OPEN), "store": _nullable({"type": "boolean"}),
            "background": _nullable({"type": "boolean"}),
            "previous_response_id": _nullable({"type": "string"}),
            "stream": _nullable({"type": "boolean"}),
            "metadata": _nullable({"type": "object", "maxProperties": 16,
                                   "additionalProperties": {"type": "string",
                                                            "maxLength": 512}}),
            # accepted and left alone
            **{k: {} for k in ("user", "safety_identifier", "prompt_cache_key",
                               "prompt_cache_retention", "service_tier", "include",
                               "stream_options", "max_tool_calls", "truncation",
                               "context_management", "prompt_cache_options")},
            "top_logprobs": _integer(0, 0)}},
    "Response": {"type": "object",
                 "required": ["id", "object", "created_at", "status", "model", "output"],
                 "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                                "created_at": {"type": "integer"},
                                "status": {"enum": ["queued", "in_progress", "completed",
                                                    "incomplete", "failed", "cancelled"]},
                                "model": {"type": "string"},
                                "output": {"type": "array", "items": _OPEN},
                                "usage": {"type": ["object", "null"]},
                                "error": {"type": ["object", "null"]}}},
    "ResponseDeleted": {"type": "object", "required": ["id", "object", "deleted"],
                        "properties": {"id": {"type": "string"},
                                       "object": {"const": "response"},
                                       "deleted": {"const": True}}},
    "MessagesRequest": {
        "type": "object", "required": ["model", "max_tokens", "messages"],
        "additionalProperties": False,
        "properties": {
            "model": {"type": "string"}, "max_tokens": {"type": "integer", "minimum": 1,
                                                        "maximum": MAX_TOKENS},
            "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
                         "items": {"type": "object", "required": ["role", "content"],
                                   "properties": {
                                       "role": {"enum": ["user", "assistant"]},
                                       "content": {"anyOf": [{"type": "string"},
                                                             {"type": "array",
                                                              "items": _OPEN}]}}}},
            "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": _OPEN}]},
            "stop_sequences": {"type": "array", "items": _STOP_STRING,
                               "maxItems": MAX_STOP_STRINGS},
            "temperature": _number(0, 100), "top_p": _number(0, 1, lo_open=True),
            "top_k": _integer(0, MAX_TOP_K), "stream": {"type": "boolean"},
            "ignore_eos": _nullable({"type": "boolean"}),
            "tools": {"type": "array", "items": _OPEN}, "tool_choice": _OPEN,
            "thinking": _OPEN, "output_config": _OPEN,
            # accepted and left alone
            **{k: {} for k in ("metadata", "service_tier", "cache_control", "container",
                               "diagnostics", "inference_geo", "speed", "user_profile_id",
                               "workspace_id")}}},
    "AnthropicMessage": {"type": "object", "required": ["id", "type", "role", "content",
                                                        "model", "stop_reason", "usage"],
                         "properties": {"id": {"type": "string"}, "type": {"const": "message"},
                                        "role": {"const": "assistant"},
                                        "content": {"type": "array", "items": _OPEN},
                                        "model": {"type": "string"},
                                        "stop_reason": {"enum": ["end_turn", "max_tokens",
                                                                 "stop_sequence", "tool_use"]},
                                        "stop_sequence": {"type": ["string", "null"]},
                                        "usage": _OPEN}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"],
                  "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}},
})


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}


def _errors(*codes: int) -> dict[str, Any]:
    why = {400: "invalid request", 401: "missing or invalid API key", 404: "not found",
           405: "method not allowed", 413: "body too large", 429: "over a limit",
           500: "internal error", 503: "loading, or not ready"}
    return {str(c): {"description": why[c], "content": _json("Error")} for c in codes}


def _completion_op(summary: str, request: str, response: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {"description": "the whole response, or server-sent events with stream",
                    "content": {**_json(response), "text/event-stream": {"schema": {
                        # each event's data: a chunk (with the choices' deltas, or the
                        # usage), then the literal [DONE]
                        "anyOf": [{"type": "object",
                                   "required": ["id", "object", "created", "model", "choices"]},
                                  {"const": "[DONE]"}]}}}},
            **_errors(400, 401, 404, 413, 429, 500, 503)}}}


def _response_ops() -> dict[str, Any]:
    """/v1/responses and /v1/responses/{id} (and its cancel)."""
    events = {"text/event-stream": {"schema": {  # each event's data: a typed event
        "type": "object", "required": ["type", "sequence_number"]}}}
    path_id = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "/v1/responses": {"post": {
            "summary": "A response (OpenAI Responses API)",
            "requestBody": {"required": True, "content": _json("ResponseRequest")},
            "responses": {"200": {"description": "the response (a background one as it "
                                                 "starts), or its events with stream",
                                  "content": {**_json("Response"), **events}},
                          **_errors(400, 401, 404, 413, 429, 500, 503)}}},
        "/v1/responses/{id}": {
            "get": {"summary": "A stored response; with stream=true its events after "
                               "starting_after", "parameters": [
                *path_id,
                {"name": "stream", "in": "query", "schema": {"type": "boolean"}},
                {"name": "starting_after", "in": "query", "schema": {"type": "integer"}}],
                "responses": {"200": {"description": "the response, or its events",
                                      "content": {**_json("Response"), **events}},
                              **_errors(400, 401, 404, 503)}},
            "delete": {"summary": "Delete a stored response (stopping it if it runs)",
                       "parameters": path_id,
                       "responses": {"200": {"description": "deleted",
                                             "content": _json("ResponseDeleted")},
                                     **_errors(401, 404, 503)}}},
        "/v1/responses/{id}/cancel": {"post": {
            "summary": "Stop a background response", "parameters": path_id,
            "responses": {"200": {"description": "the response as it ended",
                                  "content": _json("Response")},
                          **_errors(400, 401, 404, 503)}}},
    }


def _messages_op() -> dict[str, Any]:
    anthropic = {"application/json": {"schema": {
        "$ref": "#/components/schemas/AnthropicError"}}}
    return {"post": {
        "summary": "A message (Anthropic Messages API); the key may come as x-api-key",
        "requestBody": {"required": True, "content": _json("MessagesRequest")},
        "responses": {
            "200": {"description": "the message, or Anthropic's events with stream",
                    "content": {**_json("AnthropicMessage"), "text/event-stream": {
                        "schema": {"type": "object", "required": ["type"]}}}},
            **{str(c): {"description": why, "content": anthropic} for c, why in (
                (400, "invalid request"), (401, "missing or invalid API key"),
                (404, "model not served"), (413, "body too large"), (429, "over a limit"),
                (500, "internal error"))},
            **_errors(503)}}}


def document(model: str | None = None) -> dict[str, Any]:
    """The document; `model`, the served model's id, is the one `model` value that the
    request bodies accept (another answers 404 model_not_found)."""
    ok = {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}}
    schemas = SCHEMAS
    if model is not None:
        schemas = {k: v for k, v in SCHEMAS.items()}
        for name in ("ChatCompletionRequest", "CompletionRequest", "WarmRequest",
                     "ResponseRequest", "MessagesRequest"):
            props = {**schemas[name]["properties"], "model": {"enum": [model]}}
            schemas[name] = {**schemas[name], "properties": props}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Tidewire", "version": _version(),
                 "description": "OpenAI-compatible HTTP API of a Tidewire server, with "
                                "OpenAI's Responses and Anthropic's Messages (docs/http.md); "
                                "the WebSocket protocol is docs/protocol.md."},
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}, {}],  # a key where the server has --api-keys
        "paths": {
            "/v1/chat/completions": _completion_op("A chat completion", "ChatCompletionRequest",
                                                   "ChatCompletion"),
            "/v1/completions": _completion_op("A text completion", "CompletionRequest",
                                              "Completion"),
            "/v1/models": {"get": {"summary": "The served model", "responses": {
                "200": {"description": "a list of one model", "content": {
                    "application/json": {"schema": {
                        "type": "object", "required": ["object", "data"],
                        "properties": {"object": {"const": "list"}, "data": {
                            "type": "array",
                            "items": {"$ref": "#/components/schemas/Model"}}}}}}},
                **_errors(401, 503)}}},
            "/v1/models/{model}": {"get": {
                "summary": "One model", "parameters": [
                    {"name": "model", "in": "path", "required": True,
                     "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the model", "content": _json("Model")},
                              **_errors(401, 404, 503)}}},
            "/v1/warm": {"post": {
                "summary": "Prefill a prefix into the cache without generating",
                "requestBody": {"required": True, "content": _json("WarmRequest")},
                "responses": {"200": {"description": "what was cached",
                                      "content": _json("Warmed")},
                              **_errors(400, 401, 404, 413, 429, 500, 503)}}},
            **_response_ops(),
            "/v1/messages": _messages_op(),
            "/health": {"get": {"summary": "Liveness (docs/http.md)", "security": [{}],
                                "responses": {"200": ok, "503": ok}}},
            "/ready": {"get": {"summary": "Readiness (docs/http.md)", "security": [{}],
                               "responses": {"200": ok, "503": ok}}},
        },
    }


async def openapi(request: Request) -> JSONResponse:
    gw = getattr(request.app.state, "gateway", None)
    return JSONResponse(document(gw.config.model_name if gw is not None else None))

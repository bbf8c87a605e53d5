"""vLLM's utility endpoints, same request and response shapes: POST /tokenize,
POST /detokenize, GET /version. Errors use OpenAI's error shape, as everywhere."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service.gateway import Gateway
from service.openai_api import error_response
from service.openai_request import inputs, read_body
from service.protocol import ProtocolError
from service.reasoning import think_options

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "return_token_strs", "chat_template_kwargs"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def _version() -> str:
    try:
        return importlib.metadata.version("tidewire")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


async def version(request: Request) -> Response:
    """GET /version: the package version and what is served (no auth, like /health)."""
    gw: Gateway = request.app.state.gateway
    return JSONResponse({"version": _version(), "model": gw.config.model_name,
                         "max_model_len": gw.engine.max_model_len})


async def tokenize(request: Request) -> Response:
    """POST /tokenize {prompt} or {messages, add_generation_prompt?, chat_template_kwargs?}:
    the token ids the completion or chat endpoint would feed the model, {count,
    max_model_len, tokens, token_strs}."""
    gw: Gateway = request.app.state.gateway
    try:
        body = await _request(gw, request, TOKENIZE_FIELDS)
        prompt, messages = body.get("prompt"), body.get("messages")
        big = gw.off_loop(prompt if isinstance(prompt, str) else None,
                          messages if isinstance(messages, list) and all(
                              isinstance(m, dict) for m in messages) else None)
        # a large text is tokenized on the tokenizing thread, off the event loop
        ids = await gw.off_the_loop(_tokenize, gw, body, True) if big else _tokenize(gw, body)
        strs = None
        if _flag(body, "return_token_strs", False):
            strs = _tokenizer(gw).convert_ids_to_tokens(ids)
    except ProtocolError as e:
        gw.metrics.errors.labels(e.code).inc()
        return error_response(e)
    return JSONResponse({"count": len(ids), "max_model_len": gw.engine.max_model_len,
                         "tokens": ids, "token_strs": strs})


async def detokenize(request: Request) -> Response:
    """POST /detokenize {tokens}: {prompt}, the ids decoded (special tokens kept)."""
    gw: Gateway = request.app.state.gateway
    try:
        body = await _request(gw, request, DETOKENIZE_FIELDS)
        ids = body.get("tokens")
        vocab = gw.engine.vocab_size
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ProtocolError("invalid_request", f"tokens must be a list of integers in "
                                f"[0, {vocab})")
        text = _tokenizer(gw).decode(ids)
    except ProtocolError as e:
        gw.metrics.errors.labels(e.code).inc()
        return error_response(e)
    return JSONResponse({"prompt": text})


async def _request(gw: Gateway, request: Request, fields: set[str]) -> dict[str, Any]:
    """Authenticated, a JSON object with known fields only, for the served model."""
    gw.authenticate(request.headers.get("authorization"))
    body = await read_body(request)
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ProtocolError("invalid_request", f"unknown parameter(s): {', '.join(unknown)}")
    model = body.get("model") or gw.config.model_name
    if model != gw.config.model_name:
        raise ProtocolError("model_not_found", f"model {model!r} is not served here")
    return body


def _tokenize(gw: Gateway, body: dict[str, Any], any_thread: bool = False) -> list[int]:
    """Through the engine, as the endpoints do: a prompt without special tokens (what
    /v1/completions feeds the model), messages through the chat template. With
    add_special_tokens the tokenizer adds its own (BOS...) around the text, as vLLM.
    `any_thread`: only what is safe beside the event loop (LLMEngine.tokenize)."""
    eng = gw.engine
    if ("prompt" in body) == ("messages" in body):
        raise ProtocolError("invalid_request", "send either prompt or messages")
    special = _flag(body, "add_special_tokens", False)
    try:
        if "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise ProtocolError("invalid_request", "prompt must be a string")
            if special:
                return _encode_special(gw, prompt, any_thread)
            return eng.tokenize(prompt, any_thread)
        messages = inputs(body, chat=True)[1]
        generation = _flag(body, "add_generation_prompt", True)
        kwargs = dict(think_options({"chat_template_kwargs": body.get("chat_template_kwargs")})
                      .template_kwargs)
        if special:  # the rendered conversation, encoded as a prompt is
            text = _tokenizer(gw).apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation, **kwargs)
            return _encode_special(gw, text, any_thread)
        if kwargs:  # rendered by the service, as the chat endpoint renders them
            return gw.prompts.ids(None, messages, "", generation, None, any_thread, kwargs)
        return eng.apply_chat_template(messages, generation, any_thread=any_thread)
    except ProtocolError:
        raise
    except ValueError as e:
        raise ProtocolError("invalid_request", str(e)) from None
    except Exception as e:  # noqa: BLE001 - a template error is the client's input
        raise ProtocolError("invalid_request", f"cannot apply the chat template: {e}") from None


def _encode_special(gw: Gateway, text: str, any_thread: bool) -> list[int]:
    tok = _tokenizer(gw)
    backend = getattr(tok, "backend_tokenizer", None)
    if any_thread and backend is not None:  # (the Rust encode mutates nothing)
        return list(backend.encode_batch([text], add_special_tokens=True)[0].ids)
    return list(tok.encode(text, add_special_tokens=True))


def _tokenizer(gw: Gateway) -> Any:
    tok = gw.engine.tokenizer
    if tok is None:
        raise ProtocolError("invalid_request", "this model has no tokenizer")
    return tok


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError("invalid_request", f"{name} must be a boolean")
    return value

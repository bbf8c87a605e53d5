"""The tidewire.v1 WebSocket protocol: codecs, message validation, error codes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgpack

from engine import SamplingParams

SUBPROTOCOL_JSON = "tidewire.v1.json"
SUBPROTOCOL_MSGPACK = "tidewire.v1.msgpack"
AUTH_PREFIX = "tidewire.auth."

ERROR_CODES = frozenset({
    "invalid_request", "unauthorized", "model_not_found", "duplicate_id", "too_many_inflight",
    "overloaded", "context_length_exceeded", "message_too_big", "slow_consumer",
    "internal_error", "unknown_id", "rate_limited",
})
RETRYABLE = frozenset({"too_many_inflight", "overloaded", "slow_consumer", "internal_error",
                       "rate_limited"})
MAX_ID_LEN = 128
# nesting of a client message's maps and lists: room for a JSON schema at its own bound
# (engine/json_bounds.py, 64) inside a generate, and for the tool wrapping around it
MAX_DEPTH = 96
MAX_MESSAGES = 1024  # chat messages in one request
MAX_SEQ = (1 << 31) - 1  # resume.after_seq
MAX_RESUME_TOKENS = 1 << 20  # resume.token_ids (SamplingParams.MAX_TOKENS)


class ProtocolError(Exception):
    """A client error that becomes an `error` frame; the socket stays open."""

    def __init__(self, code: str, message: str, request_id: str | None = None,
                 retry_after: float | None = None) -> None:
        assert code in ERROR_CODES, code
        super().__init__(message)
        self.code, self.message, self.request_id = code, message, request_id
        self.retry_after = retry_after  # seconds until the same request may succeed

    def frame(self) -> dict[str, Any]:
        f: dict[str, Any] = {"type": "error", "code": self.code, "message": self.message,
                             "retryable": self.code in RETRYABLE}
        if self.request_id is not None:
            f["id"] = self.request_id
        if self.retry_after is not None:
            f["retry_after"] = round(self.retry_after, 3)
        return f


class Codec:
    """One per socket, used on the event loop thread only. The encoder is built once:
    `msgpack.packb` makes a Packer per call and `json.dumps` with options a JSONEncoder
    per call, both on the per-delta path. The Packer starts with a 4 KiB buffer (it grows
    for a bigger frame): msgpack's default, 256 KiB, was a quarter of a megabyte held per
    msgpack socket, 256 MB at a thousand sockets."""

    def __init__(self, subprotocol: str) -> None:
        self.subprotocol = subprotocol
        self.binary = subprotocol == SUBPROTOCOL_MSGPACK
        self.encode: Any = (msgpack.Packer(use_bin_type=True, buf_size=4096).pack
                            if self.binary else
                            json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode)

    def decode(self, data: bytes | str) -> dict[str, Any]:
        """One message, or an `invalid_request` ProtocolError whose message says what was
        wrong in the terms of the subprotocol the client chose (a client author reads it)."""
        msg = _unpack_msgpack(data) if self.binary else _load_json(data)
        check_depth(msg)
        if not isinstance(msg, dict):
            want, names = ("a map", _MSGPACK_KINDS) if self.binary else ("an object", _JSON_KINDS)
            got = names.get(type(msg), type(msg).__name__)
            raise ProtocolError("invalid_request", f"a message must be {want}, got {got}")
        return msg


def check_depth(value: Any, most: int = MAX_DEPTH, what: str = "message") -> None:
    """Refuse a value nested deeper than `most` maps and lists (walked without recursion:
    everything that reads a request later may recurse)."""
    level: list[Any] = [value]
    for _ in range(most + 1):
        level = [v for x in level
                 for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list) else ())
                 if isinstance(v, (dict, list))]
        if not level:
            return
    raise ProtocolError("invalid_request", f"the {what} is nested more than {most} levels deep")


# what a client author calls the value a message decoded to, in each subprotocol
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}
_MSGPACK_KINDS = {list: "an array", str: "a string", bytes: "binary data", int: "an integer",
                  float: "a float", bool: "a boolean", type(None): "nil",
                  msgpack.ExtType: "an ext value"}


def _unpack_msgpack(data: bytes | str) -> Any:
    if isinstance(data, str):  # the socket's frame type, not the payload, is wrong
        raise ProtocolError("invalid_request",
                            "the msgpack subprotocol expects binary frames; got a text frame")
    try:
        return msgpack.unpackb(data, raw=False)
    except Exception as e:  # noqa: BLE001 - any parse failure is the client's
        raise ProtocolError("invalid_request",
                            f"message is not valid msgpack: {_msgpack_reason(e)}") from None


def _msgpack_reason(e: Exception) -> str:
    """msgpack's own messages are terse or empty (FormatError has none)."""
    if isinstance(e, msgpack.ExtraData):
        return "bytes left over after the first value (send one value per frame)"
    if isinstance(e, msgpack.FormatError):
        return "a byte that starts no msgpack type"
    if isinstance(e, msgpack.StackError):
        return "nested too deeply"
    if isinstance(e, UnicodeDecodeError):
        return f"a string is not valid UTF-8 ({e.reason} at byte {e.start} of it)"
    text = str(e).removeprefix("Unpack failed: ")  # e.g. "incomplete input"
    if "for map key" in text:  # "int is not allowed for map key when strict_map_key=True"
        return f"map keys must be strings, got a key of type {text.split()[0]}"
    return text or type(e).__name__


def _load_json(data: bytes | str) -> Any:
    """JSON from a text frame (or a binary one holding UTF-8 JSON, which is accepted)."""
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        reason = f"{e.msg} at line {e.lineno} column {e.colno}"
    except UnicodeDecodeError as e:
        reason = f"not UTF-8 text ({e.reason} at byte {e.start})"
    except RecursionError:
        reason = "nested too deeply"
    except ValueError as e:  # e.g. an integer literal past Python's digit limit
        reason = str(e)
    raise ProtocolError("invalid_request", f"message is not valid JSON: {reason}")


@dataclass
class Generate:
    id: str
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    tools: Any = None  # service.tools.Tools, for a chat request with tools
    # service.reasoning.ThinkOptions: template variables and the reasoning budget
    think: Any = None


def request_id(msg: dict[str, Any]) -> str:
    rid = msg.get("id")
    if not isinstance(rid, str) or not rid or len(rid) > MAX_ID_LEN or not rid.isprintable():
        raise ProtocolError("invalid_request",
                            f"id must be a printable string of 1-{MAX_ID_LEN} characters")
    return rid


def parse_generate(msg: dict[str, Any], defaults: dict[str, Any] | None = None) -> Generate:
    """A `generate` message; `defaults` fill the sampling fields `params` leaves unset."""
    rid = request_id(msg)
    unknown = set(msg) - {"type", "id", "messages", "prompt", "prompt_token_ids", "params",
                          "priority"}
    if unknown:
        raise ProtocolError("invalid_request", f"unknown field(s): {', '.join(sorted(unknown))}", rid)
    given = [k for k in ("messages", "prompt", "prompt_token_ids") if k in msg]
    if len(given) != 1:
        raise ProtocolError("invalid_request",
                            "give exactly one of messages, prompt, prompt_token_ids", rid)
    params = msg.get("params", {})
    if not isinstance(params, dict):
        raise ProtocolError("invalid_request", "params must be an object", rid)
    from service import reasoning
    from service import tools as tool_calls  # (they import this module)

    # null means "unset", as over HTTP: the default (or the field's own) applies
    set_fields = {k: v for k, v in params.items() if v is not None}
    tool_fields = {k: set_fields.pop(k) for k in ("tools", "tool_choice", "parallel_tool_calls")
                   if k in set_fields}
    think = reasoning.think_options({k: set_fields.pop(k) for k in reasoning.FIELDS
                                     if k in set_fields}, rid)
    tools = None
    if tool_fields:
        if "messages" not in msg:
            raise ProtocolError("invalid_request", "tools need messages", rid)
        try:
            tools = tool_calls.parse(tool_fields)
        except ProtocolError as e:
            raise ProtocolError(e.code, e.message, rid) from None
        if tools is not None and tools.constrained:
            if "response_format" in set_fields:
                raise ProtocolError("invalid_request", "a required or named tool_choice cannot "
                                    "be combined with response_format", rid)
            set_fields["response_format"] = tool_calls.constraint(tools)
    try:
        sp = SamplingParams.from_dict({**(defaults or {}), **set_fields})
    except (TypeError, ValueError) as e:
        raise ProtocolError("invalid_request", str(e), rid) from None
    return Generate(rid, _prompt(msg, rid), _messages(msg, rid), sp, tools, think)


@dataclass
class Warm:
    id: str | None
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None


def parse_warm(msg: dict[str, Any]) -> Warm:
    """`warm {id?, messages | prompt | prompt_token_ids}`."""
    rid = request_id(msg) if "id" in msg else None
    unknown = set(msg) - {"type", "id", "messages", "prompt", "prompt_token_ids"}
    if unknown:
        raise ProtocolError("invalid_request", f"unknown field(s): {', '.join(sorted(unknown))}", rid)
    if len([k for k in ("messages", "prompt", "prompt_token_ids") if k in msg]) != 1:
        raise ProtocolError("invalid_request",
                            "give exactly one of messages, prompt, prompt_token_ids", rid)
    return Warm(rid, _prompt(msg, rid or ""), _messages(msg, rid or ""))


@dataclass
class Resume:
    id: str
    after_seq: int
    session_id: str
    # the request itself, to continue it here when this server does not hold it (it ran
    # on another replica, or before a restart): the generate's fields and the token ids
    # the client received
    request: dict[str, Any] | None = None
    token_ids: list[int] = field(default_factory=list)


def parse_resume(msg: dict[str, Any]) -> Resume:
    """`resume {id, after_seq, session_id, request?, token_ids?}`: session_id is the one
    the dropped socket's `ready` frame gave; after_seq the last delta seq the client
    received (0: none); `request` the generate's fields (without type and id) and
    `token_ids` every token id received, for a server that does not hold the request."""
    rid = request_id(msg)
    unknown = set(msg) - {"type", "id", "after_seq", "session_id", "request", "token_ids"}
    if unknown:
        raise ProtocolError("invalid_request", f"unknown field(s): {', '.join(sorted(unknown))}", rid)
    seq, sid = msg.get("after_seq", 0), msg.get("session_id")
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq <= MAX_SEQ:
        raise ProtocolError("invalid_request", f"after_seq must be an integer in [0, {MAX_SEQ}]",
                            rid)
    if not isinstance(sid, str) or not sid or len(sid) > MAX_ID_LEN:
        raise ProtocolError("invalid_request",
                            "session_id (from the dropped socket's ready frame) is required", rid)
    req, toks = msg.get("request"), msg.get("token_ids", [])
    if req is not None and (not isinstance(req, dict) or {"type", "id"} & set(req)):
        raise ProtocolError("invalid_request", "request must be the generate's fields, without "
                            "type and id", rid)
    if not isinstance(toks, list) or len(toks) > MAX_RESUME_TOKENS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_SEQ for t in toks):
        raise ProtocolError("invalid_request", "token_ids must be a list of at most "
                            f"{MAX_RESUME_TOKENS} token ids", rid)
    if toks and req is None:
        raise ProtocolError("invalid_request", "token_ids come with request", rid)
    return Resume(rid, seq, sid, req, toks)


def _prompt(msg: dict[str, Any], rid: str) -> str | list[int] | None:
    if "prompt" in msg:
        if not isinstance(msg["prompt"], str) or not msg["prompt"]:
            raise ProtocolError("invalid_request", "prompt must be a non-empty string", rid)
        return msg["prompt"]
    if "prompt_token_ids" in msg:
        ids = msg["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ProtocolError("invalid_request", "prompt_token_ids must be a list of integers",
                                rid)
        return ids
    return None


def _messages(msg: dict[str, Any], rid: str) -> list[dict[str, Any]] | None:
    """{role, content} strings each; an assistant turn may carry `tool_calls` (content
    then null) and a `tool` turn a `tool_call_id` (service/tools.py)."""
    from service import tools as tool_calls  # (it imports this module)

    if "messages" not in msg:
        return None
    if isinstance(msg["messages"], list) and len(msg["messages"]) > MAX_MESSAGES:
        raise ProtocolError("invalid_request", f"messages holds at most {MAX_MESSAGES} messages, "
                            f"got {len(msg['messages'])}", rid)
    try:
        return tool_calls.check_messages(msg["messages"])
    except ProtocolError:
        raise ProtocolError("invalid_request", "messages must be a non-empty list of "
                            "{role, content} strings (and tool turns)", rid) from None

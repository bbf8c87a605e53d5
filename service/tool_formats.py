"""A chat answer's tool calls, read back out of its text in the format the model's chat
template taught it, and turned into OpenAI chat deltas as the text grows (`CallStream`).

The formats (`call_format` picks one from the template's text):
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in
  the answer: Hermes, Qwen2.5/Qwen3 and SmolLM3 templates, and what Tidewire asks of a
  model whose template does not render tools (service/tools.py).
- "llama3" (Llama 3.1-3.3): an answer that starts with `{"name": ..., "parameters":
  {...}}`, or such an object after `<|python_tag|>`; several calls are separated by `;`.
- "mistral": `[TOOL_CALLS]` and a JSON array of `{"name", "arguments"}` objects (older
  templates), or `[TOOL_CALLS]name[ARGS]{...}` for each call (v11+ tokenizers). Its call
  ids are 9 letters and digits, as Mistral's templates require of the history.

The markers are special tokens, which the detokenizer leaves out by default
(`skip_special_tokens`): a llama3 call is then the bare object, and a mistral answer that
starts with the array, or with one of the request's function names and its arguments
object, is read as calls as well.

Each call goes out once its text is complete: a delta with its index, id, type and name
(arguments ""), then one with its arguments. Text around the calls is content, streamed
as it comes, except what may still turn out to be a call (a marker split between two
pieces, or the start of an answer that may be one). A call whose text is not JSON of a
call stays content, exactly as the model wrote it, markers included (as vLLM's parsers
hand it back): a client sees what the model said rather than an error."""

from __future__ import annotations

import functools
import json
import re
import string
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, CALL_ID, ARGS = "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"
# Llama's templates ask for "parameters" in a Jinja string, its quotes escaped or not
_PARAMETERS = re.compile(r'\\?"parameters\\?"')
_ARRAY = re.compile(r"\[\s*[{\]]")  # a JSON array of objects (or an empty one) starts
_ARRAY_OPENING = re.compile(r"\[\s*")  # ... or may be starting
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def call_format(template: Any) -> str:
    """The tool-call format a chat template teaches its model: hermes for one that does
    not render tools (Tidewire's own prompt asks for <tool_call> blocks then), and for
    one whose format is none of the others."""
    return _format_of(template) if isinstance(template, str) else HERMES


@functools.lru_cache(maxsize=16)  # (once per model: a template is a few KB to scan)
def _format_of(template: str) -> str:
    if "tools" not in template:  # as InputProcessor.template_renders_tools decides
        return HERMES
    if TOOL_CALLS in template:
        return MISTRAL
    if OPEN in template:
        return HERMES
    if PYTHON_TAG in template or _PARAMETERS.search(template):
        return LLAMA3
    return HERMES


def mistral_id(call_id: str) -> str:
    """A history's call id as Mistral's templates take it (9 letters and digits): kept
    if it is one, else a digest of it (the same for a call and its result)."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    return uuid.uuid5(uuid.NAMESPACE_OID, call_id).hex[:9]


@dataclass(frozen=True, slots=True)
class Call:
    """A call read out of the text: its function's name, its arguments as JSON text, and
    its id where the model wrote a usable one."""

    name: str
    arguments: str
    id: str | None = None


Piece = str | Call  # what a format's reader hands on: content, or a complete call


def _call(name: str, args: Any, call_id: str | None = None) -> Call:
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return Call(name, text, call_id)


def _loads(text: str) -> Any:
    """The JSON value of a call's text, or None if it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # (a model may nest deeper than json recurses)
        return None


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of `text` may begin `marker` (held back)."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1)
                 if marker.startswith(text[-k:])), 0)


# -- hermes: <tool_call> blocks ---------------------------------------------------------------

def _hermes_call(body: str) -> Call | None:
    obj = _loads(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return _call(obj["name"], obj.get("arguments", {}))


class _Tagged:
    """hermes: each <tool_call> block's JSON is a call, wherever it stands."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._buf = ""  # text held back: a tag may be starting, or a block is open
        self._in_block = False

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def end(self) -> list[Piece]:
        """The rest: an unterminated block, or a partial tag, is plain text."""
        rest, self._buf = (OPEN if self._in_block else "") + self._buf, ""
        return [rest]

    def _step(self, out: list[Piece]) -> bool:
        if self._in_block:
            end = self._buf.find(CLOSE)
            if end < 0:
                return False
            body, self._buf = self._buf[:end], self._buf[end + len(CLOSE):]
            self._in_block = False
            out.append(_hermes_call(body) or OPEN + body + CLOSE)
            return True
        start = self._buf.find(OPEN)
        if start < 0:
            cut = len(self._buf) - _partial(self._buf, OPEN)
            out.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        out.append(self._buf[:start])
        self._buf, self._in_block = self._buf[start + len(OPEN):], True
        return True


# -- llama3 and mistral: JSON values at the answer's start or after a marker ------------------

class _Brackets:
    """The nesting depth of a JSON text read one character at a time: brackets counted
    outside strings (whether it is valid JSON is for json.loads to say)."""

    def __init__(self) -> None:
        self.depth = 0
        self._in_str = self._escape = False

    def step(self, ch: str) -> bool:
        """Take one character; whether it closed a bracket."""
        if self._in_str:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_str = False
        elif ch == '"':
            self._in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return True
        return False


class _Span:
    """One JSON object or array, read a piece at a time to where it closes."""

    def __init__(self) -> None:
        self.text = ""
        self.done = False
        self._scan = _Brackets()

    def feed(self, text: str) -> int:
        """How much of `text` belongs to the value: all of it until the value closes."""
        for i, ch in enumerate(text):
            if self._scan.step(ch) and self._scan.depth <= 0:
                self.text, self.done = self.text + text[:i + 1], True
                return i + 1
        self.text += text
        return len(text)


class _JsonCalls:
    """The formats whose calls are JSON values: at the answer's start or right after
    another call ("start"), or after the format's marker anywhere in the text ("text").
    A subclass says what opens a call (`_opening`), what may stand between the opening
    and the value (`header`), and what the value means (`_decode`).

    `_raw` is the text of the call being read (its opening too): content again if the
    value turns out not to be a call."""

    marker = ""
    header = re.compile(r"\s*")
    header_tags: tuple[str, ...] = ()  # tags a header may hold (held back while partial)
    separator = ""  # what may stand between two calls, beside whitespace

    def __init__(self, names: Iterable[str] = ()) -> None:
        self.names = tuple(names)
        self._buf = self._raw = ""
        self._mode = "start"  # start | text | value
        self._called = False
        self._span: _Span | None = None
        self._head: re.Match[str] | None = None

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._buf and self._step(out):
            pass
        return out

    def end(self) -> list[Piece]:
        """The rest, as content (whitespace after the last call is dropped)."""
        rest = self._raw + self._buf
        self._raw = self._buf = ""
        if self._mode == "start" and self._called and not rest.strip():
            return []
        return [rest]

    def _opening(self, s: str) -> int | None:
        """How many characters of `s` (the text at a call's place, whitespace stripped)
        open a call; -1: it is no call; None: too early to tell."""
        raise NotImplementedError

    def _decode(self, head: re.Match[str], value: Any) -> list[Call] | None:
        """The calls a complete value makes after its header (None: none, it is text)."""
        raise NotImplementedError

    def _step(self, out: list[Piece]) -> bool:
        """One move on the held text; False when it needs more."""
        if self._mode == "start":
            return self._start()
        if self._mode == "text":
            return self._text(out)
        return self._value(out)

    def _start(self) -> bool:
        gap = string.whitespace + (self.separator if self._called else "")
        s = self._buf.lstrip(gap)
        opening = self._opening(s) if s else None
        if opening is None:
            return False
        if opening < 0:
            self._mode = "text"  # (the gap goes out with the text)
            return True
        cut = len(self._buf) - len(s) + opening
        self._raw, self._buf, self._mode = self._buf[:cut], self._buf[cut:], "value"
        return True

    def _text(self, out: list[Piece]) -> bool:
        at = self._buf.find(self.marker)
        if at < 0:
            cut = len(self._buf) - _partial(self._buf, self.marker)
            out.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        out.append(self._buf[:at])
        self._raw, self._buf = self.marker, self._buf[at + len(self.marker):]
        self._mode = "value"
        return True

    def _value(self, out: list[Piece]) -> bool:
        if self._span is None:
            start = self._value_start()
            if start is None:
                return False
            if start < 0:
                return self._not_a_call(out)
            self._raw, self._buf = self._raw + self._buf[:start], self._buf[start:]
            self._span = _Span()
        n = self._span.feed(self._buf)
        self._raw, self._buf = self._raw + self._buf[:n], self._buf[n:]
        if not self._span.done:
            return False
        assert self._head is not None
        calls = self._decode(self._head, _loads(self._span.text))
        if calls is None:
            return self._not_a_call(out)
        out.extend(calls)
        self._raw, self._span, self._mode, self._called = "", None, "start", True
        return True

    def _value_start(self) -> int | None:
        """Where the value starts in the held text, past its header (-1: what follows
        the opening is no call; None: too early to tell)."""
        self._head = self.header.match(self._buf)
        assert self._head is not None  # (every part of a header may be empty)
        rest = self._buf[self._head.end():]
        if rest.startswith("{") or _ARRAY.match(rest):
            return self._head.end()
        if (not rest or _ARRAY_OPENING.fullmatch(rest)
                or any(tag.startswith(rest) for tag in self.header_tags)):
            return None
        return -1

    def _not_a_call(self, out: list[Piece]) -> bool:
        out.append(self._raw)
        self._raw, self._span, self._mode = "", None, "text"
        return True


def _llama_call(obj: Any) -> Call | None:
    """{"name": ..., "parameters": {...}} ("arguments" is taken too, and a "type" beside
    them): an object with other keys is an answer in JSON, not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    keys = set(obj) - {"name", "type"}
    if len(keys) != 1 or not keys <= {"parameters", "arguments"}:
        return None
    args = obj[keys.pop()]
    return _call(obj["name"], args) if isinstance(args, dict) else None


class _Llama3(_JsonCalls):
    marker = PYTHON_TAG
    separator = ";"

    def _opening(self, s: str) -> int | None:
        if s.startswith(PYTHON_TAG):
            return len(PYTHON_TAG)
        if s.startswith("{"):
            return 0
        return None if PYTHON_TAG.startswith(s) else -1

    def _decode(self, head: re.Match[str], value: Any) -> list[Call] | None:
        call = _llama_call(value)
        return [call] if call is not None else None


def _mistral_call(obj: Any) -> Call | None:
    """One element of the older form's array: {"name", "arguments"} (and its "id")."""
    if (not isinstance(obj, dict) or not isinstance(obj.get("name"), str)
            or not isinstance(obj.get("arguments", {}), dict | str)
            or not set(obj) <= {"name", "arguments", "id"}):
        return None
    call_id = obj.get("id")
    usable = isinstance(call_id, str) and _MISTRAL_ID.fullmatch(call_id)
    return _call(obj["name"], obj.get("arguments", {}), call_id if usable else None)


class _Mistral(_JsonCalls):
    marker = TOOL_CALLS
    # v11+: a call's name, maybe its id, then [ARGS] (either tag left out as a special token)
    header = re.compile(r"\s*(?:(?P<name>[A-Za-z0-9_.-]{1,64})"
                        r"(?:\[CALL_ID\](?P<id>[A-Za-z0-9]{1,64}))?(?:\[ARGS\])?)?\s*")
    header_tags = (CALL_ID, ARGS)

    def _opening(self, s: str) -> int | None:
        if s.startswith(TOOL_CALLS):
            return len(TOOL_CALLS)
        # the marker left out: the array, or a function's name then its arguments
        if _ARRAY.match(s) or any(s.startswith(n + "{") for n in self.names):
            return 0
        if (TOOL_CALLS.startswith(s) or _ARRAY_OPENING.fullmatch(s)
                or any((n + "{").startswith(s) for n in self.names)):
            return None
        return -1

    def _decode(self, head: re.Match[str], value: Any) -> list[Call] | None:
        name, call_id = head.group("name"), head.group("id")
        if name is not None:
            if not isinstance(value, dict):
                return None
            usable = call_id is not None and _MISTRAL_ID.fullmatch(call_id)
            return [_call(name, value, call_id if usable else None)]
        if not isinstance(value, list) or not value:
            return None
        calls = [c for c in map(_mistral_call, value) if c is not None]
        return calls if len(calls) == len(value) else None  # (all of them, or it is text)


_READERS: dict[str, type[_Tagged] | type[_JsonCalls]] = {
    HERMES: _Tagged, LLAMA3: _Llama3, MISTRAL: _Mistral}


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _nine() -> str:
    return uuid.uuid4().hex[:9]  # (Mistral's: 9 letters and digits)


class CallStream:
    """One choice's text, turned into OpenAI chat deltas as it grows: `push` takes the
    next piece of text and returns deltas ({"content": ...} or {"tool_calls": [...]});
    `finish` returns the rest. A call goes out as OpenAI streams it: a delta with its
    index, id, type and name (arguments ""), then fragments of its arguments.

    `constrained` (tool_choice "required" or a named function): the whole text is a
    JSON array of {"name", "arguments"} objects, the name first (the constraint's order),
    whatever the format; its arguments stream as they are written. Otherwise ("auto")
    the text is read in `fmt` (see the module docstring); `names` are the request's
    functions (a mistral answer may start with one, its marker left out)."""

    def __init__(self, constrained: bool, fmt: str = HERMES, names: Iterable[str] = ()) -> None:
        if fmt not in _READERS:
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.constrained = constrained
        self.calls: list[dict[str, Any]] = []  # {id, name, arguments} as they complete
        self.content: list[str] = []
        self._reader = _READERS[fmt](names)
        self._new_id = _nine if fmt == MISTRAL else _call_id
        self._scan = _Brackets()  # constrained: a scan of the JSON array
        self._obj = ""  # the current call object's text so far
        self._args_from = -1  # where its arguments start in _obj, once its name is known
        self._args_sent = 0

    @property
    def found_calls(self) -> bool:
        return bool(self.calls)

    def push(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        return self._push_json(text) if self.constrained else self._deltas(self._reader.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return [] if self.constrained else self._deltas(self._reader.end())

    def _deltas(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        text = ""  # consecutive content pieces go out as one delta
        for p in pieces:
            if isinstance(p, str):
                text += p
                continue
            out += self._content(text)
            text = ""
            self.calls.append({"id": p.id or self._new_id(), "name": p.name,
                               "arguments": p.arguments})
            i = len(self.calls) - 1
            out += [self._start_delta(i),
                    {"tool_calls": [{"index": i, "function": {"arguments": p.arguments}}]}]
        return out + self._content(text)

    # -- constrained: a JSON array of calls --------------------------------------------

    def _push_json(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ch in text:
            depth0 = self._scan.depth
            self._scan.step(ch)
            if depth0 >= 2 or (depth0 == 1 and ch == "{"):
                self._obj += ch
            if depth0 == 2 and self._scan.depth == 1:  # a call object closed
                out += self._flush_args(final=True)
                self._obj, self._args_from, self._args_sent = "", -1, 0
            elif self._scan.depth >= 2 and self._args_from < 0:
                m = re.match(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*',
                             self._obj)
                if m and m.end() == len(self._obj):
                    self._args_from = m.end()
                    self.calls.append({"id": self._new_id(), "name": json.loads(m.group(1)),
                                       "arguments": ""})
                    out.append(self._start_delta(len(self.calls) - 1))
        return out + self._flush_args(final=False)

    def _flush_args(self, final: bool) -> list[dict[str, Any]]:
        if self._args_from < 0:
            return []
        # the arguments run to the call object's closing brace (not included)
        end = len(self._obj) - 1 if final else len(self._obj)
        piece = self._obj[self._args_from + self._args_sent:end]
        if not self.calls[-1]["arguments"]:  # whitespace before the value is not sent
            self._args_sent += len(piece) - len(piece.lstrip())
            piece = piece.lstrip()
        if not piece:
            return []
        self._args_sent += len(piece)
        self.calls[-1]["arguments"] += piece
        return [{"tool_calls": [{"index": len(self.calls) - 1,
                                 "function": {"arguments": piece}}]}]

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.content.append(text)
        return [{"content": text}]

    def _start_delta(self, i: int) -> dict[str, Any]:
        c = self.calls[i]
        return {"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                "function": {"name": c["name"], "arguments": ""}}]}

    def message(self) -> dict[str, Any]:
        """The whole message (non-streaming), after every push and the finish."""
        content = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant", "content": content or None}
        if self.calls:
            msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in self.calls]
        elif msg["content"] is None:
            msg["content"] = ""
        return msg

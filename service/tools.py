"""Tool calling for chat requests: OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls`, and the conversation's tool turns. The model's calls are read back
out of its text by service/tool_formats.py (`Tools.stream()`).

How the model learns of the tools: a chat template that renders `tools` itself gets
them (and the history's structured calls), and teaches the model its family's call
format, which `for_model` picks from the template (hermes, llama3 or mistral: see
tool_formats); for one that does not, such as the default model's, Tidewire prepends a
system message (`system_prompt`) that lists the functions as JSON and asks for calls as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, and writes earlier
calls and tool results into the history in that form.

`tool_choice`:
- "none": the tools are left out of the prompt; the answer is plain text.
- "auto" (the default with tools): the answer is free; the calls in it, in the model's
  format, become `tool_calls` (finish_reason "tool_calls"), the rest stays `content`.
- "required", or {"type": "function", "function": {"name": ...}}: the answer is
  constrained (engine/structured.py) to a JSON array of calls `[{"name": ..., "arguments":
  {...}}]` whose arguments match the function's parameters schema: at least one call,
  at most one without `parallel_tool_calls` and for a named function.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from engine.json_bounds import MAX_SCHEMA_DEPTH, json_depth
from service.protocol import ProtocolError
from service.tool_formats import CLOSE, HERMES, MISTRAL, OPEN, CallStream, call_format, mistral_id

MAX_TOOLS = 128
# A function's parameters schema, as canonical JSON: a large API's stays well under it,
# and 128 of them stay within what a request body carries
MAX_PARAMETERS_BYTES = 64 * 1024
# the constraint for "required" puts a call's parameters 5 levels under its root
# (array, items, anyOf, call object, properties: constraint()): the schema bound, less those
MAX_PARAMETERS_DEPTH = MAX_SCHEMA_DEPTH - 5
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Tools:
    functions: tuple[dict[str, Any], ...]  # {name, description, parameters}
    choice: str  # "none" | "auto" | "required" | "function"
    name: str | None = None  # the function tool_choice names
    parallel: bool = True
    format: str = HERMES  # how the model writes its calls (tool_formats; set by for_model)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")

    def stream(self) -> CallStream:
        """A reader of one choice's calls, in this request's form and the model's format."""
        return CallStream(self.constrained, self.format, (f["name"] for f in self.functions))


def for_model(t: Tools | None, tokenizer: Any) -> Tools | None:
    """The request's tools with the call format the model's chat template teaches it
    (hermes where the template does not render tools: Tidewire's prompt asks for it)."""
    if t is None:
        return None
    fmt = call_format(getattr(tokenizer, "chat_template", None))
    return t if fmt == t.format else dataclasses.replace(t, format=fmt)


def parse(body: dict[str, Any]) -> Tools | None:
    """The request's tools (None without any, or with tool_choice "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ProtocolError("invalid_request", "parallel_tool_calls must be a boolean")
    if tools is None:
        if choice not in (None, "none"):
            raise ProtocolError("invalid_request", "tool_choice needs tools")
        return None
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise ProtocolError("invalid_request", f"tools must be a list of 1-{MAX_TOOLS} tools")
    functions = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ProtocolError("invalid_request",
                                f"tools[{i}] must be {{type: function, function: {{name, ...}}}}")
        if not _NAME.match(fn["name"]):
            raise ProtocolError("invalid_request", f"tools[{i}].function.name must be 1-64 "
                                "letters, digits, '_', '.' or '-'")
        params = _parameters(fn, i)
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise ProtocolError("invalid_request", f"tools[{i}].function.description must be "
                                "a string")
        functions.append({"name": fn["name"], "description": desc, "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ProtocolError("invalid_request", "tools must have distinct names")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None
    if choice in ("auto", "required"):
        return Tools(tuple(functions), choice, None, parallel)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if (not isinstance(choice, dict) or not isinstance(fn, dict)
            or choice.get("type") != "function" or not isinstance(fn.get("name"), str)):
        raise ProtocolError("invalid_request", 'tool_choice must be "none", "auto", '
                            '"required" or {"type": "function", "function": {"name": ...}}')
    if fn["name"] not in names:
        raise ProtocolError("invalid_request", f"tool_choice names {fn['name']!r}, which is "
                            "not in tools")
    return Tools(tuple(functions), "function", fn["name"], parallel)


def _parameters(fn: dict[str, Any], i: int) -> dict[str, Any]:
    params = fn.get("parameters", {"type": "object", "properties": {}})
    where = f"tools[{i}].function.parameters"
    if not isinstance(params, dict):
        raise ProtocolError("invalid_request", f"{where} must be a JSON schema object")
    depth = json_depth(params, MAX_PARAMETERS_DEPTH)  # (before json.dumps, which recurses)
    if depth > MAX_PARAMETERS_DEPTH:
        raise ProtocolError("invalid_request", f"{where} is nested more than "
                            f"{MAX_PARAMETERS_DEPTH} levels deep (objects and arrays)")
    size = len(json.dumps(params, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_PARAMETERS_BYTES:
        raise ProtocolError("invalid_request", f"{where} is {size} bytes as JSON (the most "
                            f"is {MAX_PARAMETERS_BYTES})")
    return params


def constraint(t: Tools) -> dict[str, Any] | None:
    """The response_format that holds a "required" or named-function answer to a JSON
    array of valid calls (None for "auto")."""
    if not t.constrained:
        return None
    fns = [f for f in t.functions if t.choice == "required" or f["name"] == t.name]
    calls = [{"type": "object",
              "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"]} for f in fns]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not t.parallel or t.choice == "function":
        schema["maxItems"] = 1
    return {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": schema}}


def system_prompt(t: Tools) -> str:
    """What a model whose chat template has no tool support is told of the tools."""
    listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in t.functions)
    if t.constrained:
        which = f"the function {t.name}" if t.choice == "function" else "one of these functions"
        how = (f"You must call {which}. Answer with nothing but a JSON array of calls, each "
               '{"name": <function name>, "arguments": <an object matching its parameters>}.')
    else:
        how = ("To call a function, answer with one block per call: "
               f'{OPEN}{{"name": <function name>, "arguments": <an object matching its '
               f"parameters>}}{CLOSE}. Call one only when it helps answer; otherwise "
               "answer normally.")
    return f"You can use these functions (JSON schemas):\n{listing}\n\n{how}"


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The chat messages: {role, content} each, plus an assistant's `tool_calls` (its
    content may then be null) and a tool result's `tool_call_id`; content parts are
    joined into text."""
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("invalid_request", "messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ProtocolError("invalid_request", "each message needs a role and content")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = _part_texts(content)
        calls = m.get("tool_calls")
        if content is None and m["role"] == "assistant" and calls:
            content = ""
        if not isinstance(content, str):
            raise ProtocolError("invalid_request", "each message needs a role and content")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        if calls is not None:
            if m["role"] != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str)
                    and isinstance(c["function"].get("arguments", "{}"), str) for c in calls):
                raise ProtocolError("invalid_request", "tool_calls belong to assistant messages:"
                                    " [{id, type, function: {name, arguments (a JSON string)}}]")
            msg["tool_calls"] = [{"id": c.get("id", ""), "type": "function",
                                  "function": {"name": c["function"]["name"],
                                               "arguments": c["function"].get("arguments", "{}")}}
                                 for c in calls]
        if m["role"] == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        out.append(msg)
    return out


def _part_texts(parts: list[Any]) -> str:
    """A message's content parts joined: the text of each that has one (an image part
    adds nothing); a `text` that is not a string is refused."""
    texts = [p.get("text", "") for p in parts if isinstance(p, dict)]
    if not all(isinstance(t, str) for t in texts):
        raise ProtocolError("invalid_request", "a content part's text must be a string")
    return "".join(texts)


def render(messages: list[dict[str, Any]], t: Tools | None,
           template_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages to give the chat template, and the `tools` argument to give it
    (None: none). A template that renders tools gets them and the structured history as
    it is; otherwise the tools go into a system message and the history's calls and
    results are written out as text."""
    plain = not any("tool_calls" in m or m["role"] == "tool" for m in messages)
    if template_tools:
        tools = ([{"type": "function", "function": f} for f in t.functions]
                 if t is not None else None)
        return (messages if plain else _structured(messages, t)), tools
    out = []
    for m in messages:
        if "tool_calls" in m:
            blocks = "".join(f'{OPEN}{{"name": {json.dumps(c["function"]["name"])}, '
                             f'"arguments": {c["function"]["arguments"]}}}{CLOSE}'
                             for c in m["tool_calls"])
            out.append({"role": "assistant", "content": m["content"] + blocks})
        elif m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if t is not None:
        prompt = system_prompt(t)
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    elif plain:
        return messages, None
    return out, None


def _structured(messages: list[dict[str, Any]], t: Tools | None) -> list[dict[str, Any]]:
    """The history for a template that renders tools: each call's arguments as an object
    (transformers' convention: Llama's templates write them out with `tojson`), and for
    a mistral model each call id as its templates demand (9 letters and digits)."""
    ids = mistral_id if t is not None and t.format == MISTRAL else str
    out = []
    for m in messages:
        msg = dict(m)
        if "tool_calls" in m:
            msg["tool_calls"] = [{**c, "id": ids(c["id"]),
                                  "function": {**c["function"],
                                               "arguments": _object(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]
        if "tool_call_id" in m:
            msg["tool_call_id"] = ids(m["tool_call_id"])
        out.append(msg)
    return out


def _object(arguments: str) -> Any:
    """A call's arguments (JSON text) as the object they hold; text that is not a JSON
    object stays as it is."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return value if isinstance(value, dict) else arguments

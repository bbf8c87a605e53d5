"""OpenAI's Responses API over HTTP: `POST /v1/responses` (whole, or streamed as the
Responses events, each with its `sequence_number`), `GET /v1/responses/{id}` (the
object; with `stream=true&starting_after=N`, its events after N replayed and then
followed live), `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`.

A request becomes a chat turn (service/chat_turn.py):
- `input`: a string (one user message) or items: messages (`role` user, assistant,
  system or developer; content a string or `input_text` / `output_text` parts),
  `function_call` items (an assistant's calls) and `function_call_output` items (their
  results); `reasoning` items are dropped, images and files are refused.
- `instructions`: a system message before everything (not carried on by a later
  `previous_response_id`, as OpenAI does).
- `tools` (function tools: name, description, parameters), `tool_choice` (auto, none,
  required, {type: function, name}), `parallel_tool_calls`: the chat endpoint's tools.
- `text.format`: `json_schema` (name, schema) or `json_object` constrain the answer
  (engine/structured.py); `text` is free text.
- `max_output_tokens`, `temperature`, `top_p`, and as extra fields the chat endpoint's
  `seed`, `top_k`, `min_p`, `stop`, penalties; `reasoning.effort` "none" turns a
  thinking model's thinking off (other efforts are accepted).

Stored responses (`store`, true by default) are kept per tenant (the API key's) in this
process, RESPONSE_TTL seconds after they end and MAX_STORED at most, the oldest going
first: `previous_response_id` continues the conversation from one (its input and
output before the new input), and `background: true` (with `store`) answers at once
while the response runs on; GET polls it or follows its events, and cancel stops it.
A response that is not background stops when its streaming client goes away.

With the Redis host tier, stored responses are shared there when they end, and while
they run (tool-less ones) a live record lets another replica follow them, and take them
over when their replica dies (LiveRecord; docs/http.md)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from service import chat_turn, openai_request
from service import tools as tool_calls
from service.chat_turn import CallArguments, CallStart, ReasoningDelta, TextDelta, Turn
from service.gateway import Gateway, Principal
from service.live_record import FOLLOW_POLL, WATCHED_TTL, LiveRecord
from service.openai_api import HTTP_STATUS, error_json, error_response
from service.origins import origin_allowed
from service.protocol import MAX_MESSAGES, ProtocolError
from service.reasoning import ThinkOptions
from service.shared_state import SharedState, shared_state_of
from service.sse_resume import follow_events

RECORD_PREFIX = "tidewire:resp:"  # a stored response in the shared state
log = logging.getLogger("tidewire.service")
MAX_STORED = 1000  # stored responses, all tenants together: the oldest ended one goes first
MAX_STORED_BYTES = 256 << 20  # and their events and conversations, at most this many bytes
TENANT_SHARE = 4  # one tenant holds at most 1/4 of each: its own oldest go first past it
RESPONSE_TTL = 3600.0  # seconds a stored response is kept once it has ended
MAX_METADATA = 16

# sampling fields passed on to the chat endpoint's reader as they are
SAMPLING = ("temperature", "top_p", "seed", "top_k", "min_p", "stop", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens")
# accepted and left alone (or echoed)
IGNORED = ("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
           "service_tier", "include", "stream_options", "max_tool_calls", "truncation",
           "top_logprobs", "context_management", "prompt_cache_options")
FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice",
                    "parallel_tool_calls", "text", "max_output_tokens", "reasoning", "store",
                    "background", "previous_response_id", "stream", "metadata",
                    *SAMPLING, *IGNORED})
# WebSocket mode's response.create: the same, less stream and background, plus these
SOCKET_FIELDS = (FIELDS - {"stream", "background"}) | {"type", "generate", "stream_id"}


def _bad(message: str) -> ProtocolError:
    return ProtocolError("invalid_request", message)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- the request ------------------------------------------------------------------------------

def _parts_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content parts")
    texts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
            texts.append(p["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _bad(f"{where}[{j}]: {kind} is not supported (the served model reads text)")
        elif kind == "refusal":
            continue
        else:
            raise _bad(f"{where}[{j}]: unsupported content part {str(kind)[:40]!r}")
    return "".join(texts)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages (function_call items -> an assistant's tool_calls,
    function_call_output -> tool messages)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value or len(value) > MAX_MESSAGES:
        raise _bad(f"input must be a string or a list of 1-{MAX_MESSAGES} items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item, dict):
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}.role must be user, assistant, system or developer")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _parts_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(args, str):
                raise _bad(f"{where}: a function_call needs a name and arguments (a JSON string)")
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and (
                    "tool_calls" in last or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": _parts_text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise _bad(f"{where}: unsupported input item {str(kind)[:40]!r}")
    return out


def tools_of(body: dict[str, Any]) -> tool_calls.Tools | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools must be a list")
    functions = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools[{i}]: only function tools are supported, not {str(kind)[:40]!r}")
        functions.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters") if k in t}})
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise _bad('tool_choice must be "auto", "none", "required" or '
                       '{"type": "function", "name": ...}')
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tool_calls.parse({"tools": functions or None, "tool_choice": choice,
                             "parallel_tool_calls": body.get("parallel_tool_calls", True)})


def format_of(text: Any) -> dict[str, Any] | None:
    """text.format as the chat endpoint's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise _bad("text takes format and verbosity")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt["schema"],
            **({"strict": fmt["strict"]} if "strict" in fmt else {})}}
    raise _bad('text.format must be {"type": "text"}, {"type": "json_object"} or '
               '{"type": "json_schema", "name": ..., "schema": {...}}')


def think_of(body: dict[str, Any]) -> ThinkOptions:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return ThinkOptions()
    if not isinstance(reasoning, dict):
        raise _bad("reasoning must be an object")
    return ThinkOptions({"enable_thinking": False}) if reasoning.get("effort") == "none" \
        else ThinkOptions()


def check_request(body: dict[str, Any], fields: frozenset[str] = FIELDS) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise _bad(f"unknown parameter(s): {', '.join(unknown)}")
    for name in ("stream", "store", "background", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise _bad(f"{name} must be a boolean")
    for name in ("instructions", "previous_response_id"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _bad(f"{name} must be a string")
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or len(meta) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in meta.items())):
        raise _bad(f"metadata must be at most {MAX_METADATA} string pairs (keys up to 64 "
                   "characters, values up to 512)")
    if body.get("background") and body.get("store") is False:
        raise _bad("background responses must be stored (store: true)")
    if body.get("top_logprobs"):
        raise _bad("top_logprobs is not supported on /v1/responses")


# -- a response as it runs --------------------------------------------------------------------

@dataclass(eq=False)
class Run:
    """One response: its object (kept current), its events as sent (the index is the
    sequence number), and the conversation a later previous_response_id continues."""

    response: dict[str, Any]
    tenant: str
    history: list[dict[str, Any]]  # input messages (instructions left out)
    events: list[str] = field(default_factory=list)  # each event's JSON
    conversation: list[dict[str, Any]] = field(default_factory=list)  # history + the output
    ended_at: float | None = None
    stream: chat_turn.TurnStream | None = None
    task: asyncio.Task | None = None
    cancelled: bool = False
    followers: int = 0
    store: ResponseStore | None = None  # where it is stored (None: nowhere)
    size: int = 0  # bytes of its events and conversation, once ended
    live: LiveRecord | None = None  # its record in the shared state while it runs
    shown: int = -1  # events its followers may have yet (-1: all; else the recorded ones)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def id(self) -> str:
        return self.response["id"]

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    def event(self, kind: str, data: dict[str, Any]) -> str:
        """The next event's JSON (its sequence number the next one)."""
        return json.dumps({"type": kind, "sequence_number": len(self.events), **data},
                          ensure_ascii=False)

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        self.emit_last(self.event(kind, data))

    def emit_last(self, event: str) -> None:
        self.events.append(event)
        if self.shown < 0:
            self._wake.set()

    def show(self, upto: int | None = None) -> None:
        """Its events up to `upto` are recorded: its followers may have them (None: all
        of them may go out as they come, recorded or not)."""
        if self.shown >= 0:  # (-1: all of them already)
            if upto is None:
                self.shown = -1  # (from now on, each as it comes)
            else:
                self.shown = max(self.shown, upto)
            self._wake.set()

    def finish(self, last: str) -> None:
        """The last event in; the run is ended (and its size known)."""
        self.events.append(last)
        self.shown = -1
        self.size = sum(map(len, self.events)) + len(json.dumps(self.conversation))
        self.ended_at = time.monotonic()
        self._wake.set()

    async def follow(self, after: int) -> AsyncIterator[str]:
        """The events (JSON) after sequence number `after`, then each new one, to the
        end."""
        self.followers += 1
        try:
            async for event in follow_events(
                    self.events, lambda: self.ended, self._wake, after,
                    lambda: len(self.events) if self.shown < 0 else self.shown):
                yield event
        finally:
            self.followers -= 1

    def linger(self, grace: float) -> None:
        """Its client went away: stop it after `grace` seconds unless someone follows it
        by then (a resume), at once when it is not stored (nobody can)."""
        if self.ended:
            return
        if grace <= 0 or not self.response["store"]:
            self.cancel()
            return
        asyncio.get_running_loop().call_later(grace, self._stop_unfollowed, grace)

    def _stop_unfollowed(self, grace: float) -> None:
        if self.ended or self.followers:
            return
        live = self.live
        if live is None or not live.owned:
            self.cancel()
            return

        async def unless_watched() -> None:  # (followed on another replica, maybe)
            assert live is not None
            if await live.watched():
                asyncio.get_running_loop().call_later(grace, self._stop_unfollowed, grace)
            elif not self.followers:
                self.cancel()
        _keep(asyncio.get_running_loop().create_task(unless_watched()))

    def cancel(self) -> None:
        if not self.ended and self.stream is not None:
            self.cancelled = True
            self.stream.close()  # the engine aborts it; the run ends as cancelled


class Writer:
    """A turn's events as Responses output items and events."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.output: list[dict[str, Any]] = run.response["output"]
        self.item: dict[str, Any] | None = None  # the item open now
        self.args: dict[int, dict[str, Any]] = {}  # call index -> its function_call item

    def add(self, event: chat_turn.Event) -> None:
        run = self.run
        if isinstance(event, ReasoningDelta):
            item = self._open("reasoning", {"type": "reasoning", "id": _new_id("rs"),
                                            "summary": [], "content": [], "status": "in_progress"},
                              {"type": "reasoning_text", "text": ""})
            item["content"][0]["text"] += event.text
            run.emit("response.reasoning_text.delta", {**self._at(item), "content_index": 0,
                                                       "delta": event.text})
        elif isinstance(event, TextDelta):
            item = self._open("message", {"type": "message", "id": _new_id("msg"),
                                          "status": "in_progress", "role": "assistant",
                                          "content": []},
                              {"type": "output_text", "text": "", "annotations": [],
                               "logprobs": []})
            item["content"][0]["text"] += event.text
            run.emit("response.output_text.delta", {**self._at(item), "content_index": 0,
                                                    "delta": event.text, "logprobs": []})
        elif isinstance(event, CallStart):
            self.close()
            item = {"type": "function_call", "id": _new_id("fc"), "call_id": event.id,
                    "name": event.name, "arguments": "", "status": "in_progress"}
            self._add(item)
            self.args[event.index] = item
        elif isinstance(event, CallArguments):
            item = self.args[event.index]
            item["arguments"] += event.text
            run.emit("response.function_call_arguments.delta", {**self._at(item),
                                                                "delta": event.text})

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    @classmethod
    def replayed(cls, run: Run) -> Writer:
        """A Writer that carries on where `run`'s events (recorded on another replica)
        stop: its response's status and output rebuilt from them, the open item open."""
        r, out = run.response, run.response["output"]
        for raw in run.events:
            e = json.loads(raw)
            kind, at = e["type"], e.get("output_index")
            if kind == "response.in_progress":
                r["status"] = "in_progress"
            elif kind == "response.output_item.added":
                out.append(e["item"])
            elif kind == "response.output_item.done":
                out[at] = e["item"]
            elif kind == "response.content_part.added":
                out[at]["content"].append(e["part"])
            elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
                out[at]["content"][e["content_index"]]["text"] += e["delta"]
            elif kind == "response.function_call_arguments.delta":
                out[at]["arguments"] += e["delta"]
        writer = cls(run)
        if out and out[-1]["status"] == "in_progress":
            writer.item = out[-1]
        return writer

    def _add(self, item: dict[str, Any]) -> None:
        self.output.append(item)
        self.item = item
        self.run.emit("response.output_item.added", {"output_index": len(self.output) - 1,
                                                     "item": item})

    def _open(self, kind: str, item: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
        if self.item is not None and self.item["type"] == kind:
            return self.item
        self.close()
        self._add(item)
        item["content"].append(part)
        self.run.emit("response.content_part.added", {**self._at(item), "content_index": 0,
                                                      "part": part})
        return item

    def close(self, status: str = "completed") -> None:
        """The open item is done: its done events."""
        item, self.item = self.item, None
        if item is None:
            return
        run, at = self.run, self._at(item)
        if item["type"] == "function_call":
            run.emit("response.function_call_arguments.done", {
                **at, "name": item["name"], "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            kind = ("response.output_text.done" if item["type"] == "message"
                    else "response.reasoning_text.done")
            run.emit(kind, {**at, "content_index": 0, "text": part["text"],
                            **({"logprobs": []} if item["type"] == "message" else {})})
            run.emit("response.content_part.done", {**at, "content_index": 0, "part": part})
        item["status"] = status
        run.emit("response.output_item.done", {"output_index": at["output_index"],
                                               "item": item})


async def produce(gw: Gateway, run: Run, writer: Writer | None = None) -> None:
    """Run the turn to its end (a task: background, whole and WebSocket responses, and
    those taken over from another replica, `writer` then carrying on its output)."""
    async for _ in steps(gw, run, writer):
        pass


async def steps(gw: Gateway, run: Run, writer: Writer | None = None
                ) -> AsyncGenerator[None, None]:
    """Run the turn, writing the response's events and object, yielding after each
    engine output's events (recorded first, when the run has a live record); end the
    run. A streamed HTTP response drives this itself (no task between the engine's
    outputs and its connection); closing it early stops the response (status
    cancelled). `writer`: a run taken over, its start already written."""
    stream = run.stream
    assert stream is not None
    r = run.response
    if writer is None:
        run.emit("response.created", {"response": _snapshot(r)})
        r["status"] = "in_progress"
        run.emit("response.in_progress", {"response": _snapshot(r)})
        writer = Writer(run)
    try:
        async for batch in stream.batches():
            for event in batch:
                writer.add(event)
            if run.live is not None:  # (its followers get what is recorded)
                run.live.record(run.events, stream.output_token_ids, stream.reasoning_tokens,
                                run.show)
            yield
        o = stream.outcome
        if run.cancelled:
            writer.close("incomplete")
            r["status"] = "cancelled"
        elif o.failure is not None:
            gw.metrics.errors.labels(o.failure.code).inc()
            writer.close("incomplete")
            r["status"], r["error"] = "failed", {"code": o.failure.code,
                                                 "message": o.failure.message}
        elif o.finish == "length":
            writer.close("incomplete")
            r["status"], r["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        else:
            writer.close()
            r["status"] = "completed"
        r["usage"] = {"input_tokens": o.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": o.cached_tokens},
                      "output_tokens": o.output_tokens,
                      "output_tokens_details": {"reasoning_tokens": stream.reasoning_tokens},
                      "total_tokens": o.prompt_tokens + o.output_tokens}
    except Exception as e:  # noqa: BLE001 - a fault of ours fails the response, not the server
        writer.close("incomplete")
        r["status"], r["error"] = "failed", {"code": "internal_error", "message": str(e)[:200]}
    except BaseException:  # closed early (its client went away) or cancelled
        stream.close()
        writer.close("incomplete")
        r["status"] = "cancelled"
        run.finish(_end(run))
        if run.store is not None:  # (no await here: shared when it can be)
            _keep(asyncio.get_running_loop().create_task(_published(run)))
        raise
    stream.close()
    last = _end(run)
    # shared before anyone can see the end: a next turn may go to another replica
    if run.store is not None:
        await run.store.publish(run, last)
    run.finish(last)
    if run.live is not None:
        await run.live.close()


async def _published(run: Run) -> None:
    assert run.store is not None
    await run.store.publish(run)
    if run.live is not None:
        await run.live.close()


_BACKGROUND: set[asyncio.Task[None]] = set()  # fire-and-forget tasks, referenced till done


def _keep(task: asyncio.Task[None]) -> None:
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


def _end(run: Run) -> str:
    """The run's last event (not yet appended: `finish` does, and only then is the run
    ended, so no follower stops before it has the last event)."""
    r = run.response
    r["completed_at"] = int(time.time()) if r["status"] == "completed" else None
    run.conversation = run.history + output_messages(r["output"])
    kind = {"completed": "response.completed", "failed": "response.failed"}.get(
        r["status"], "response.incomplete")
    return run.event(kind, {"response": _snapshot(r)})


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as chat messages (its text; its calls as tool_calls)."""
    text = "".join(p["text"] for item in output if item["type"] == "message"
                   for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return [msg] if text or calls else []


def _snapshot(response: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(response))  # (an event carries the object as it was then)


LIVE_PREFIX = "tidewire:resp-live:"  # a stored response's live record while it runs
LIVE_TTL = 600  # seconds a live record outlasts its last write


class ResponseStore:
    """Stored responses of this process, by id, each with its tenant; with `shared`
    (the Redis of --kv-tier redis), also those another replica stored, written there
    when they end (service/shared_state.py)."""

    def __init__(self, max_stored: int = MAX_STORED, ttl: float = RESPONSE_TTL,
                 shared: SharedState | None = None, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_stored, self.ttl, self.shared, self.max_bytes = max_stored, ttl, shared, max_bytes
        self._runs: OrderedDict[str, Run] = OrderedDict()
        self.me = uuid.uuid4().hex  # this store's name as the owner of live records

    async def publish(self, run: Run, last: str | None = None) -> None:
        """Share an ended run (`last`: its final event, if not appended yet); not one
        another replica took over (its end is that one's to share)."""
        if self.shared is None or (run.live is not None and not run.live.owned):
            return
        events = run.events + ([last] if last is not None else [])
        await self.shared.put(RECORD_PREFIX + run.id, {
            "tenant": run.tenant, "response": run.response, "events": events,
            "conversation": run.conversation}, self.ttl)

    async def fetch(self, response_id: str, tenant: str) -> Run:
        """A stored response: this process's, else one another replica shared. (An
        ended one of this process's that another replica deleted is gone here too.)"""
        try:
            run = self.get(response_id, tenant)
            if not run.ended or self.shared is None or \
                    await self.shared.exists(RECORD_PREFIX + response_id) is not False:
                return run
            self._runs.pop(response_id, None)
            raise ProtocolError("model_not_found", f"no response {response_id!r} is stored "
                                "here")
        except ProtocolError:
            if self.shared is None:
                raise
            found = await self.shared.get(RECORD_PREFIX + response_id)
            if not isinstance(found, dict) or found.get("tenant") != tenant:
                raise
        return Run(found["response"], tenant, [], events=found["events"],
                   conversation=found["conversation"], ended_at=time.monotonic(), store=self)

    async def live_record(self, rid: str, tenant: str
                          ) -> tuple[dict[str, Any], list[str]] | None:
        """A response running on another replica (or that replica's last word on it):
        its request and the events recorded so far; None if there is no such record
        for this key's tenant."""
        if self.shared is None:
            return None
        live = self._live(rid)
        found = await self.shared.get_with_list(live.key(), live.key(":steps"))
        if found is None or found[0].get("tenant") != tenant:
            return None
        return found[0], [e for step in found[1] if step is not None for e in step[0]]

    async def take_over(self, gw: Gateway, principal: Principal, rid: str) -> Run | None:
        """Continue here a response whose owner's heartbeat stopped, from its live
        record (None: another replica holds it, or it is gone). The run carries on its
        events and output, from the recorded tokens, and records on as the new owner."""
        assert self.shared is not None
        live = self._live(rid)
        if not await live.take():
            return None
        found = await self.shared.get_with_list(live.key(), live.key(":steps"))
        if found is None or found[0].get("tenant") != principal.tenant:
            live.release()  # (another try may take it)
            return None
        request, recorded = found
        body, history = request["body"], request["history"]
        recorded = [step for step in recorded if step is not None]
        events = [e for step in recorded for e in step[0]]
        tokens = [t for step in recorded for t in step[1]]
        live.events, live.tokens = len(events), len(tokens)
        try:
            stream = await chat_turn.admit(gw, principal, _turn(gw, body,
                                                                _messages(body, history)),
                                           continued=tokens)
        except BaseException:
            live.release()  # (another try may take it)
            raise
        stream.reasoning_tokens = recorded[-1][2] if recorded else 0
        run = Run(request["response"], principal.tenant, history, events=events,
                  stream=stream, live=live, shown=len(events))
        self.add(run)
        self._watch(run)
        run.task = asyncio.get_running_loop().create_task(
            produce(gw, run, Writer.replayed(run) if events else None))
        gw.metrics.resumes.labels("continued").inc()
        return run

    async def follow_live(self, gw: Gateway, principal: Principal, rid: str, after: int
                          ) -> AsyncIterator[str]:
        """The events after `after` of a response another replica runs, read from its
        live record as they are recorded; when that replica's heartbeat stops, the
        response is taken over here (take_over) and followed to its end."""
        assert self.shared is not None
        live = self._live(rid)
        events: list[str] = []
        steps_read, at, gone = 0, after + 1, False
        while True:
            got = await self.shared.read_from(RECORD_PREFIX + rid, live.key(":steps"),
                                              steps_read, live.key(":alive"),
                                              live.key(":watched"), WATCHED_TTL)
            if got is None:
                return  # Redis is down: what was read is all this follower gets
            ended, recorded, alive = got
            if ended is not None:  # (its end is shared before its live record goes)
                for event in ended["events"][at:]:
                    yield event
                return
            steps_read += len(recorded)
            events += [e for step in recorded if step is not None for e in step[0]]
            while at < len(events):
                at += 1
                yield events[at - 1]
            if gone:
                return  # (and its end was not shared either)
            if not alive:
                try:
                    run = await self.take_over(gw, principal, rid)
                except ProtocolError as e:  # (the 200 went out: the error is the last event)
                    gw.metrics.errors.labels(e.code).inc()
                    yield json.dumps({"type": "error", "code": e.code, "message": e.message,
                                      "param": None, "sequence_number": at})
                    return
                if run is not None:
                    try:
                        async for event in run.follow(at - 1):
                            yield event
                    finally:
                        if not run.response["background"]:
                            run.linger(gw.config.limits.resume_grace)
                    return
                # gone: ended and shared (read once more), or expired
                gone = await self.shared.exists(live.key()) is False
                if gone:
                    continue
            await asyncio.sleep(FOLLOW_POLL)

    def _watch(self, run: Run) -> None:
        """When another replica takes `run` over (this one stalled past its heartbeat),
        it stops here and is that one's."""
        assert run.live is not None

        def lost() -> None:
            if self._runs.get(run.id) is run:
                del self._runs[run.id]
            run.cancel()
        run.live.on_lost = lost

    def _live(self, rid: str) -> LiveRecord:
        assert self.shared is not None
        return LiveRecord(self.shared, LIVE_PREFIX, rid, self.me, LIVE_TTL)

    async def forget(self, response_id: str, tenant: str) -> Run:
        """Remove a stored response, here and where it is shared."""
        run = await self.fetch(response_id, tenant)
        self._runs.pop(response_id, None)
        if self.shared is not None:
            await self.shared.delete(RECORD_PREFIX + response_id)
        return run

    def add(self, run: Run) -> None:
        """Store `run`. Past the limits the oldest ended responses go: the tenant's own
        first while it holds over its share (TENANT_SHARE), so that one key cannot push
        out another's, then anyone's."""
        self._expire()
        run.store = self
        self._runs[run.id] = run
        mine = [r for r in self._runs.values() if r.tenant == run.tenant]
        self._drop(mine, max(self.max_stored // TENANT_SHARE, 1),
                   self.max_bytes // TENANT_SHARE)
        self._drop(list(self._runs.values()), self.max_stored, self.max_bytes)

    def _drop(self, runs: list[Run], count: int, size: int) -> None:
        """Remove the oldest ended of `runs` (oldest first) until at most `count` and
        `size` bytes of them are left, or only running ones."""
        held, left = sum(r.size for r in runs), len(runs)
        for r in runs:
            if left <= count and held <= size:
                return
            if r.ended:
                held -= r.size
                left -= 1
                del self._runs[r.id]

    def get(self, response_id: str, tenant: str) -> Run:
        self._expire()
        run = self._runs.get(response_id)
        if run is None or run.tenant != tenant:
            raise ProtocolError("model_not_found", f"no response {response_id!r} is stored "
                                "here") from None
        return run

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, r in self._runs.items()
                    if r.ended_at is not None and now - r.ended_at > self.ttl]:
            del self._runs[rid]


def store_of(request: Request) -> ResponseStore:
    return store_of_app(request.app)


def store_of_app(app: Any) -> ResponseStore:
    state = app.state
    if getattr(state, "responses", None) is None:
        state.responses = ResponseStore(shared=shared_state_of(app))
    return state.responses  # type: ignore[no-any-return]


def _not_found(e: ProtocolError) -> JSONResponse:
    return error_json(404, "not_found", e.message)


# -- the endpoints ----------------------------------------------------------------------------

async def start(gw: Gateway, store: ResponseStore, principal: Principal, body: dict[str, Any],
                local: ResponseStore | None = None, fields: frozenset[str] = FIELDS,
                driven: bool = False) -> Run:
    """Check a create body, admit its turn and start its run (or raise ProtocolError).
    `local`: a socket's own store (WebSocket mode), where previous_response_id is looked
    up too and its store=false responses are kept while it is open. `driven`: the
    caller drives `steps(gw, run)` itself (no task is started)."""
    check_request(body, fields)
    openai_request.check_served(gw, body)
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        prev = await _previous(store, local, previous, principal.tenant)
        if not prev.ended:
            raise _bad(f"the previous response {previous!r} is still in progress")
        history = list(prev.conversation)
    history += input_messages(body.get("input"))
    messages = _messages(body, history)
    stored = body.get("store", True) is not False
    if body.get("generate", True) is False:
        return await _prepared(gw, store if stored else local, principal, body, history,
                               messages)
    turn = _turn(gw, body, messages)
    stream = await chat_turn.admit(gw, principal, turn)
    run = Run(_response(gw, body, stored, bool(body.get("background"))), principal.tenant,
              history, stream=stream)
    (store if stored else local or ResponseStore()).add(run)
    # resumable elsewhere: background responses (as OpenAI resumes only those) and the
    # WebSocket mode's (which resume after a dropped socket), with no tools
    resumable = bool(body.get("background")) or local is not None
    if stored and resumable and store.shared is not None and turn.tools is None:
        live = store._live(run.id)
        if await live.open({"tenant": principal.tenant, "body": body, "history": history,
                            "response": _snapshot(run.response)}):
            run.live, run.shown = live, 0  # (its followers get what is recorded)
            store._watch(run)
    if not driven:
        run.task = asyncio.get_running_loop().create_task(produce(gw, run))
    return run


def _messages(body: dict[str, Any], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turn's chat messages: the instructions, then the conversation."""
    instructions = body.get("instructions")
    return tool_calls.check_messages(
        ([{"role": "system", "content": instructions}] if instructions else []) + history)


def _turn(gw: Gateway, body: dict[str, Any], messages: list[dict[str, Any]]) -> Turn:
    sampling = {k: body[k] for k in SAMPLING if body.get(k) is not None}
    sampling["max_tokens"] = body.get("max_output_tokens")
    sampling["response_format"] = format_of(body.get("text"))
    params = openai_request.sampling_params(sampling, True, gw.sampling_defaults)
    return Turn(messages, params, tools_of(body), think_of(body))


async def _previous(store: ResponseStore, local: ResponseStore | None, rid: str,
                    tenant: str) -> Run:
    if local is not None:
        try:
            return local.get(rid, tenant)
        except ProtocolError:
            pass
    try:
        return await store.fetch(rid, tenant)
    except ProtocolError:
        raise _bad(f"previous_response_id {rid!r} is not a stored response") from None


async def _prepared(gw: Gateway, store: ResponseStore | None, principal: Principal,
                    body: dict[str, Any], history: list[dict[str, Any]],
                    messages: list[dict[str, Any]]) -> Run:
    """`generate: false` (WebSocket mode): the conversation prefilled into the cache
    (as /v1/warm) and a completed response with no output, to continue from."""
    rendered = tool_calls.render(messages, None, gw.engine.template_renders_tools)[0]
    warmed = await gw.warm(principal, None, None, rendered)
    run = Run(_response(gw, body, body.get("store", True) is not False, False),
              principal.tenant, history)
    r = run.response
    run.emit("response.created", {"response": _snapshot(r)})
    r["status"], r["completed_at"] = "completed", int(time.time())
    r["usage"] = {"input_tokens": warmed["prompt_tokens"],
                  "input_tokens_details": {"cached_tokens": warmed["cached_tokens"]},
                  "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": warmed["prompt_tokens"]}
    run.conversation = list(history)
    run.finish(run.event("response.completed", {"response": _snapshot(r)}))
    if store is not None:
        store.add(run)
        await store.publish(run)
    return run


async def create(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        principal = gw.authenticate(request.headers.get("authorization"))
        body = await openai_request.read_body(request)
        if "generate" in body or "stream_id" in body:
            raise _bad("generate and stream_id are WebSocket mode's (ws://.../v1/responses)")
        background = bool(body.get("background"))
        driven = bool(body.get("stream")) and not background
        run = await start(gw, store_of(request), principal, body, driven=driven)
    except ProtocolError as e:
        gw.metrics.errors.labels(e.code).inc()
        return error_response(e)
    if driven:
        return _driven_stream(gw, run)
    if body.get("stream"):
        return _event_stream(run, -1, stop_on_close=False)
    if background:
        return JSONResponse(_snapshot(run.response))
    assert run.task is not None
    try:
        await asyncio.shield(run.task)
    except asyncio.CancelledError:
        run.cancel()
        raise
    return JSONResponse(run.response)


def _response(gw: Gateway, body: dict[str, Any], stored: bool, background: bool
              ) -> dict[str, Any]:
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    return {"id": _new_id("resp"), "object": "response", "created_at": int(time.time()),
            "status": "queued" if background else "in_progress", "background": background,
            "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": gw.config.model_name,
            "output": [], "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
            "store": stored, "temperature": body.get("temperature"),
            "text": {"format": fmt}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "top_p": body.get("top_p"),
            "truncation": body.get("truncation", "disabled"), "usage": None,
            "user": body.get("user"), "metadata": body.get("metadata") or {}}


def sse(event: str) -> str:
    """An event's JSON as a server-sent event, its type the SSE event name (Run.emit
    writes `{"type": "...", ...` first)."""
    kind = event[10:event.index('"', 10)]
    return f"event: {kind}\ndata: {event}\n\n"


def _driven_stream(gw: Gateway, run: Run) -> StreamingResponse:
    """A streamed response that is not background: this connection runs it, sending
    each event as it is written; its going away stops the response."""
    async def events() -> AsyncIterator[str]:
        sent, produced = 0, steps(gw, run)
        try:
            async for _ in produced:
                while sent < len(run.events):
                    sent += 1
                    yield sse(run.events[sent - 1])
            for event in run.events[sent:]:
                yield sse(event)
        finally:
            await produced.aclose()
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event_stream(run: Run, after: int, stop_on_close: bool) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            async for event in run.follow(after):
                yield event
        finally:
            if stop_on_close:
                run.cancel()  # (a no-op once it has ended)
    return _sse_of(events())


def _sse_of(events: AsyncIterator[str]) -> StreamingResponse:
    async def sent() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield sse(event)
        finally:
            await events.aclose()  # type: ignore[attr-defined]  # (an async generator)
    return StreamingResponse(sent(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stored(request: Request, forget: bool = False) -> Run | Response:
    """The stored response the path names, for the request's key (removed with
    `forget`), or the error answer."""
    gw: Gateway = request.app.state.gateway
    store = store_of(request)
    try:
        tenant = gw.authenticate(request.headers.get("authorization")).tenant
        rid = request.path_params["id"]
        return await (store.forget(rid, tenant) if forget else store.fetch(rid, tenant))
    except ProtocolError as e:
        return error_response(e) if e.code == "unauthorized" else _not_found(e)


async def retrieve(request: Request) -> Response:
    """GET /v1/responses/{id}: the object, or (stream=true) its events after
    starting_after; a response running on another replica is read from its live record
    (and followed, or taken over when that replica is gone)."""
    q = request.query_params
    streamed = q.get("stream", "false").lower() == "true"
    after = q.get("starting_after", "-1")
    if streamed and not re.fullmatch(r"-1|\d{1,9}", after, re.ASCII):
        return error_response(_bad("starting_after must be an integer >= -1"))
    run = await _stored(request)
    if isinstance(run, Run):
        if streamed:
            return _event_stream(run, int(after), stop_on_close=False)
        return JSONResponse(run.response)
    if run.status_code != 404:
        return run
    gw: Gateway = request.app.state.gateway
    store, rid = store_of(request), request.path_params["id"]
    principal = gw.authenticate(request.headers.get("authorization"))  # (it passed)
    live = await store.live_record(rid, principal.tenant)
    if live is None:
        return run
    if streamed:
        return _sse_of(store.follow_live(gw, principal, rid, int(after)))
    shown = Run(live[0]["response"], principal.tenant, [], events=live[1])
    Writer.replayed(shown)
    return JSONResponse(shown.response)


async def delete(request: Request) -> Response:
    run = await _stored(request, forget=True)
    if not isinstance(run, Run):
        return run
    run.cancel()
    return JSONResponse({"id": run.id, "object": "response", "deleted": True})


async def cancel(request: Request) -> Response:
    """Stop a background response (OpenAI cancels only those); an ended one is
    returned as it is."""
    run = await _stored(request)
    if not isinstance(run, Run):
        return run
    if not run.response["background"]:
        return error_response(_bad("only background responses can be cancelled"))
    if not run.ended and run.task is not None:
        run.cancel()
        await asyncio.shield(run.task)
    return JSONResponse(run.response)


# -- WebSocket mode ---------------------------------------------------------------------------

MAX_SOCKET_RESPONSES = 64  # responses in flight or waiting in its lanes, per socket


def _socket_error(status: int, e: ProtocolError, stream_id: Any = None) -> str:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    event: dict[str, Any] = {"type": "error", "status": status, "error": {
        "type": kind, "code": e.code, "message": e.message, "param": None}}
    if stream_id is not None:
        event["stream_id"] = stream_id
    return json.dumps(event, ensure_ascii=False)


def _with_stream_id(event: str, stream_id: Any) -> str:
    """An event's JSON with the lane's stream_id (right after its type)."""
    if stream_id is None:
        return event
    at = event.index(",")
    return f"{event[:at]}, \"stream_id\": {json.dumps(stream_id)}{event[at:]}"


class ResponseSocket:
    """One WebSocket on /v1/responses: `response.create` events (the create body, flat,
    with `generate` and `stream_id`), each answered by that response's events. Requests
    of one `stream_id` lane run in order, one at a time; lanes run side by side (no
    stream_id: the default lane). `response.resume` (Tidewire's) follows a stored
    response of this key from `starting_after`, as GET ?stream=true does."""

    def __init__(self, ws: Any, gw: Gateway, store: ResponseStore, principal: Principal) -> None:
        self.ws, self.gw, self.store, self.principal = ws, gw, store, principal
        # its store=false responses, for previous_response_id
        self.local = ResponseStore(max_stored=MAX_SOCKET_RESPONSES)
        self.lanes: dict[Any, asyncio.Queue[dict[str, Any] | None]] = {}  # while busy
        self.tasks: set[asyncio.Task[None]] = set()
        self.started: list[Run] = []
        self.pending = 0
        self._send_lock = asyncio.Lock()

    async def send(self, text: str) -> None:
        async with self._send_lock:
            await self.ws.send_text(text)

    async def serve(self) -> None:
        try:
            limit = self.gw.config.limits.max_message_bytes
            while True:
                raw = await self.ws.receive_text()
                if len(raw) > limit:  # (characters: at least as many bytes)
                    await self.send(_socket_error(413, ProtocolError(
                        "message_too_big", f"a message is at most {limit} bytes "
                        "(--max-message-bytes)")))
                    continue
                try:
                    msg = json.loads(raw)
                except (ValueError, RecursionError):
                    await self.send(_socket_error(400, _bad("the message is not valid JSON")))
                    continue
                self.dispatch(msg)
        finally:
            for task in self.tasks:
                task.cancel()
            grace = self.gw.config.limits.resume_grace
            for run in self.started:
                run.linger(grace)

    def dispatch(self, msg: Any) -> None:
        kind = msg.get("type") if isinstance(msg, dict) else None
        lane = msg.get("stream_id") if isinstance(msg, dict) else None
        if lane is not None and not (isinstance(lane, str) and 0 < len(lane) <= 64):
            self._later(self.send(_socket_error(400, _bad(
                "stream_id must be a string of 1-64 characters"))))
            return
        if kind not in ("response.create", "response.resume"):
            self._later(self.send(_socket_error(400, _bad(
                'a message is {"type": "response.create", ...} or '
                '{"type": "response.resume", "response_id", "starting_after"}'), lane)))
            return
        if self.pending >= MAX_SOCKET_RESPONSES:
            self._later(self.send(_socket_error(429, ProtocolError(
                "too_many_inflight", f"at most {MAX_SOCKET_RESPONSES} responses in flight "
                "or waiting on one socket"), lane)))
            return
        self.pending += 1
        queue = self.lanes.get(lane)
        if queue is None:
            queue = self.lanes[lane] = asyncio.Queue()
            self._later(self._lane(lane, queue))
        queue.put_nowait(msg)

    def _later(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _lane(self, lane: Any, queue: asyncio.Queue[dict[str, Any] | None]) -> None:
        """A lane's messages in order; the lane ends when it has none left (no await
        between the last check and its removal, so a message queued meanwhile is not
        lost: dispatch then starts a new lane)."""
        while True:
            msg = await queue.get()
            try:
                if msg is not None:
                    await self._one(lane, msg)
            except Exception as e:  # noqa: BLE001 - a fault of ours answers this message only
                log.exception("responses socket: a message failed")
                await self.send(_socket_error(500, ProtocolError(
                    "internal_error", f"the server failed this message: {type(e).__name__}"),
                    lane))
            finally:
                self.pending -= 1
            if queue.empty():
                del self.lanes[lane]
                return

    async def _one(self, lane: Any, msg: dict[str, Any]) -> None:
        gw = self.gw
        self.started = [r for r in self.started if not r.ended]
        try:
            if msg["type"] == "response.resume":
                after = msg.get("starting_after", -1)
                if not isinstance(after, int) or isinstance(after, bool) or after < -1:
                    raise _bad("starting_after must be an integer >= -1")
                rid = str(msg.get("response_id"))
                try:
                    run = await self.store.fetch(rid, self.principal.tenant)
                except ProtocolError:
                    if await self.store.live_record(rid, self.principal.tenant) is None:
                        raise
                    # running on another replica: followed (or taken over) from here
                    async for event in self.store.follow_live(gw, self.principal, rid, after):
                        await self.send(_with_stream_id(event, lane))
                    return
            else:
                body = {k: v for k, v in msg.items() if k not in ("type", "stream_id")}
                if not isinstance(body.get("generate", True), bool):
                    raise _bad("generate must be a boolean")
                run = await start(gw, self.store, self.principal, body, self.local,
                                  SOCKET_FIELDS - {"type", "stream_id"})
                self.started.append(run)
                after = -1
        except ProtocolError as e:
            gw.metrics.errors.labels(e.code).inc()
            status = 404 if e.code == "model_not_found" and msg["type"] == "response.resume" \
                else HTTP_STATUS.get(e.code, 400)
            await self.send(_socket_error(status, e, lane))
            return
        async for event in run.follow(after):
            await self.send(_with_stream_id(event, lane))


async def socket(ws: WebSocket) -> None:
    """WS /v1/responses: OpenAI's Responses WebSocket mode (ResponseSocket)."""
    gw: Gateway = ws.app.state.gateway
    if not origin_allowed(ws.headers.get("origin"), ws.headers.get("host"),
                          gw.config.allowed_origins):
        await ws.close(code=1008, reason="origin not allowed")  # before accept: HTTP 403
        return
    try:
        principal = gw.authenticate(ws.headers.get("authorization"),
                                    ws.scope.get("subprotocols", []))
    except ProtocolError:
        await ws.close(code=1008, reason="unauthorized")  # before accept: HTTP 403
        return
    await ws.accept()
    try:
        await ResponseSocket(ws, gw, store_of_app(ws.app), principal).serve()
    except WebSocketDisconnect:
        pass

"""Clients for the chaos tests: many requests over real WebSockets, every frame checked
against the protocol's invariants as it arrives (known types, contiguous seqs from 1,
nothing after a request's done, exactly one done per accepted request)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed


FRAMES = {"ready", "queued", "start", "delta", "done", "error", "pong", "warmed", "resumed"}


@dataclass
class Stream:
    """What one request saw."""

    rid: str
    start: dict[str, Any] | None = None
    tokens: list[int] = field(default_factory=list)
    seq: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, Any] | None = None
    close_code: int | None = None  # the socket closed before the done

    @property
    def refused(self) -> bool:
        """An error before any start: the request was not accepted."""
        return self.start is None and self.done is None and bool(self.errors)

    @property
    def outcome(self) -> str:
        if self.done is not None:
            return self.done["status"]
        if self.refused:
            return "refused:" + self.errors[0]["code"]
        return f"closed:{self.close_code}"


class Violation(AssertionError):
    pass


def check_frame(streams: dict[str, Stream], m: dict[str, Any]) -> None:
    """Apply one server frame to `streams`, raising Violation on a broken invariant."""
    kind = m.get("type")
    if kind not in FRAMES:
        raise Violation(f"unknown frame {m!r}")
    rid = m.get("id")
    if kind in ("ready", "pong", "warmed", "resumed") or (kind == "error" and rid not in streams):
        if kind == "error" and rid is not None:
            raise Violation(f"an error for an id never sent: {m!r}")
        return
    s = streams.get(rid)
    if s is None:
        raise Violation(f"a {kind} frame for an id never sent: {m!r}")
    if s.done is not None:
        raise Violation(f"a {kind} frame after {rid}'s done: {m!r}")
    if kind == "queued":
        if s.start is not None:
            raise Violation(f"{rid} queued after its start")
    elif kind == "start":
        if s.start is not None or s.seq:
            raise Violation(f"a second start, or a start after deltas, for {rid}")
        s.start = m
    elif kind == "delta":
        if m["seq"] != s.seq + 1:
            raise Violation(f"{rid}: seq {m['seq']} after {s.seq}")
        s.seq = m["seq"]
        s.tokens += m["token_ids"]
    elif kind == "error":
        s.errors.append(m)
    else:
        s.done = m


async def run_socket(ws_url: str, jobs: list[tuple[str, dict[str, Any]]],
                     streams: dict[str, Stream], headers: dict[str, str] | None = None,
                     on_frame: Callable[[dict[str, Any]], None] | None = None) -> None:
    """One socket: send every (id, generate body) at once, read until each has its done,
    was refused, or the socket closed (recorded as each open stream's close_code)."""
    for rid, _ in jobs:
        streams[rid] = Stream(rid)
    mine = {rid: streams[rid] for rid, _ in jobs}
    async with connect(ws_url, subprotocols=["tidewire.v1.json"], max_size=None,
                       additional_headers=headers or {}, open_timeout=60,
                       ping_interval=None) as ws:
        first = json.loads(await ws.recv())
        if first["type"] != "ready":
            raise Violation(f"expected ready, got {first!r}")
        for rid, body in jobs:
            await ws.send(json.dumps({"type": "generate", "id": rid, **body}))
        try:
            while any(s.done is None and not s.refused for s in mine.values()):
                m = json.loads(await ws.recv())
                check_frame(streams, m)
                if on_frame is not None:
                    on_frame(m)
        except ConnectionClosed as e:
            code = e.rcvd.code if e.rcvd is not None else 1006
            for s in mine.values():
                if s.done is None and not s.refused:
                    s.close_code = code


async def run_requests(ws_url: str, jobs: list[tuple[str, dict[str, Any]]], sockets: int,
                       timeout: float = 120.0, **kw: Any) -> dict[str, Stream]:
    """Spread `jobs` over `sockets` sockets (round robin), all at once."""
    streams: dict[str, Stream] = {}
    groups = [jobs[i::sockets] for i in range(min(sockets, len(jobs)))]
    await asyncio.wait_for(asyncio.gather(*(run_socket(ws_url, g, streams, **kw)
                                            for g in groups)), timeout)
    return streams


def greedy_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"prompt_token_ids": prompt,
            "params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def full() -> bool:
    """`make chaos` runs the long forms (TIDEWIRE_CHAOS_FULL=1); `make test` the short."""
    return os.environ.get("TIDEWIRE_CHAOS_FULL", "") not in ("", "0")

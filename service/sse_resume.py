"""Resumable server-sent event streams of the completion endpoints.

Every event of a streamed `/v1/chat/completions` or `/v1/completions` answer carries an
SSE `id:` of the form `SEQ:TOKENS` (its place in the stream from 0, and the output
tokens sent up to it). A request that opts in (`X-Tidewire-Resume: 1`, or `?resume=1`
on the URL) is not aborted when its client goes away: it runs on for `--resume-grace`
seconds (the socket's grace), its events kept, and
`GET /v1/chat/completions/{id}/events` (or `/v1/completions/{id}/events`) with the
standard `Last-Event-ID` header (or `?after=SEQ`) replays what came after and follows the
rest. That is what a browser's EventSource does by itself when its connection drops, so
a page resumes with no code. A stream that ended stays replayable for the grace period.

The producer (the endpoint's event generator) runs as a task of its own that appends to
the record; each connection follows the record. When the last follower leaves, a timer
of `resume_grace` seconds starts; a follower that comes back in time stops it, and
otherwise the producer is cancelled, which aborts the request as a disconnect always
did. At most `max_detached` streams (the socket's limit) run without a follower; past
it (or past `max_detached_per_key` of one tenant's) a disconnect aborts at once.

With a shared state (the Redis host tier), a stream of one prompt and one choice keeps
a live record there (service/live_record.py, `SseStreams.live`): another replica asked
for it follows the record while this one runs it, and takes it over when this one dies
(service/openai_api.py, `_continue`)."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from service.config import Limits
from service.live_record import LiveRecord
from service.protocol import ProtocolError
from service.shared_state import SharedState

RETRY_MS = 500  # the reconnection delay a resumable stream asks EventSource for
RECORD_PREFIX = "tidewire:sse:"  # a stream's record in the shared state (SseStreams.shared)


def wants_resume(headers: Mapping[str, str], query: Mapping[str, str]) -> bool:
    """The request opted in: `X-Tidewire-Resume: 1` (or true), or `?resume=1`."""
    value = headers.get("x-tidewire-resume") or query.get("resume") or ""
    return value.lower() in ("1", "true", "yes")


def parse_position(last_event_id: str | None, after: str | None) -> tuple[int, int | None]:
    """What a follower has seen: (the last event's sequence number, the output tokens up
    to it), from Last-Event-ID or `after` (either `SEQ:TOKENS` or `SEQ`; TOKENS None
    when not given); (-1, 0) without either."""
    raw = last_event_id if last_event_id else after
    if raw is None or raw == "":
        return -1, 0
    m = re.fullmatch(r"(-1|\d{1,9})(?::(\d{1,9}))?", raw, re.ASCII)
    if m is None:
        raise ProtocolError("invalid_request", "Last-Event-ID (or after) must be SEQ:TOKENS "
                            "or SEQ, SEQ an integer >= -1")
    return int(m.group(1)), int(m.group(2)) if m.group(2) else None


@dataclass(eq=False)
class SseStream:
    """One streamed answer: its events (each with its id line) and who follows it."""

    id: str
    tenant: str
    events: list[str] = field(default_factory=list)
    ended: bool = False
    shown: int = -1  # events its followers may have (-1: all; else those recorded)
    live: LiveRecord | None = None  # its live record, when it has one
    followers: int = 0
    task: asyncio.Task | None = None
    timer: asyncio.TimerHandle | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, data: str, tokens: int) -> None:
        """`data`: an event's `data: ...` line(s) and its blank line."""
        seq = len(self.events)
        retry = f"retry: {RETRY_MS}\n" if seq == 0 else ""
        self.events.append(f"{data[:-1]}id: {seq}:{tokens}\n{retry}\n")
        self._wake.set()

    def end(self) -> None:
        self.ended = True
        self._wake.set()

    def show(self, upto: int | None) -> None:
        """Its events up to `upto` are recorded: its followers may have them (None: all,
        as they come, recorded or not)."""
        if self.shown >= 0:
            self.shown = -1 if upto is None else max(self.shown, upto)
            self._wake.set()

    async def follow(self, after: int) -> AsyncIterator[str]:
        async for event in follow_events(
                self.events, lambda: self.ended, self._wake, after,
                lambda: len(self.events) if self.shown < 0 else self.shown):
            yield event


async def follow_events(events: list[str], ended: Callable[[], bool], wake: asyncio.Event,
                        after: int, visible: Callable[[], int] | None = None
                        ) -> AsyncIterator[str]:
    """The events after index `after` of a list that grows (each append sets `wake`),
    then each new one until `ended()`: a follower of a recorded stream (these, and the
    Responses API's). `visible()`: how many of them may be sent yet (default: all; at
    the end, all)."""
    at = after + 1
    while True:
        while at < (len(events) if visible is None or ended() else visible()):
            at += 1
            yield events[at - 1]
        if ended():
            return
        wake.clear()
        await wake.wait()


class SseStreams:
    """This process's resumable streams, by completion id."""

    def __init__(self, limits: Limits, shared: SharedState | None = None) -> None:
        """`shared`: where streams are recorded for the other replicas (None: nowhere,
        a stream resumes only here); a record lives 60 s (or the grace, if longer)
        after its last write."""
        self.limits, self.shared = limits, shared
        self.record_ttl = max(limits.resume_grace, 60.0)
        self.me = uuid.uuid4().hex  # this process's name as a live record's owner
        self.streams: dict[str, SseStream] = {}
        self.detached = 0  # running with no follower now
        self.detached_by: dict[str, int] = {}  # of those, by tenant

    def live(self, stream_id: str) -> LiveRecord:
        """A stream's live record (service/live_record.py): its request, then each
        event and the output token ids it came from."""
        assert self.shared is not None
        return LiveRecord(self.shared, RECORD_PREFIX, stream_id, self.me, int(self.record_ttl))

    def start(self, stream_id: str, tenant: str, source: AsyncIterator[tuple[str, int]],
              live: LiveRecord | None = None,
              token_ids: Callable[[], Sequence[int]] | None = None,
              events: list[str] | None = None) -> SseStream:
        """Run `source` ((event data, tokens so far) pairs) into a new stream after
        `events` (a stream taken over: those another replica sent); with `live`, each
        event and `token_ids()` (all the output's so far) are recorded there, and its
        followers get it once recorded."""
        s = SseStream(stream_id, tenant, events=list(events or []), live=live)
        if live is not None:
            s.shown = len(s.events)

            def lost() -> None:  # another replica took it over: it is that one's now
                if self.streams.get(stream_id) is s:
                    del self.streams[stream_id]
                self._stop(s)
            live.on_lost = lost
        self.streams[stream_id] = s
        s.task = asyncio.get_running_loop().create_task(
            self._produce(s, source, live, token_ids or tuple))
        return s

    def find(self, stream_id: str, tenant: str) -> SseStream:
        s = self.streams.get(stream_id)
        if s is None or s.tenant != tenant:
            raise ProtocolError("invalid_request", f"no resumable stream {stream_id!r} here: "
                                "unknown, not resumable, or past its grace period")
        return s

    async def follow(self, s: SseStream, after: int) -> AsyncIterator[str]:
        """`s`'s events after `after` for one connection; when it goes, the stream may
        run on detached (see the module doc)."""
        self._attach(s)
        s.followers += 1
        try:
            async for event in s.follow(after):
                yield event
        finally:
            s.followers -= 1
            if not s.followers:
                self._detach(s)

    def _detach(self, s: SseStream) -> None:
        lim = self.limits
        if s.ended:
            return
        if lim.resume_grace <= 0 or self.detached >= lim.max_detached or \
                self.detached_by.get(s.tenant, 0) >= lim.max_detached_per_key:
            self._stop(s)  # (the room is shared: no tenant takes more than its part)
            return
        self._count(s, 1)
        s.timer = asyncio.get_running_loop().call_later(lim.resume_grace, self._expire, s)

    def _attach(self, s: SseStream) -> None:
        """`s` is followed again, or ended: no longer detached."""
        if s.timer is not None:
            s.timer.cancel()
            s.timer = None
            self._count(s, -1)

    def _count(self, s: SseStream, n: int) -> None:
        self.detached += n
        left = self.detached_by.get(s.tenant, 0) + n
        if left:
            self.detached_by[s.tenant] = left
        else:
            self.detached_by.pop(s.tenant, None)

    def _expire(self, s: SseStream) -> None:
        s.timer = None
        if s.live is not None and s.live.owned:  # followed on another replica, maybe
            asyncio.get_running_loop().create_task(self._expire_unless_watched(s))
            return
        self._count(s, -1)
        self._stop(s)

    async def _expire_unless_watched(self, s: SseStream) -> None:
        assert s.live is not None
        if not s.ended and s.timer is None and await s.live.watched():
            s.timer = asyncio.get_running_loop().call_later(self.limits.resume_grace,
                                                            self._expire, s)
            return
        if s.timer is None:  # (not followed here again meanwhile)
            self._count(s, -1)
            self._stop(s)

    def cancel(self, s: SseStream) -> None:
        """Stop a stream now (its client says it is done with it), followed or not."""
        self._stop(s)

    def _stop(self, s: SseStream) -> None:
        if s.task is not None and not s.task.done():
            s.task.cancel()  # closes the endpoint's generator: the request is aborted

    async def _produce(self, s: SseStream, source: AsyncIterator[tuple[str, int]],
                       live: LiveRecord | None, token_ids: Callable[[], Sequence[int]]
                       ) -> None:
        try:
            async for data, tokens in source:
                s.add(data, tokens)
                if live is not None:
                    live.record(s.events, token_ids(), None, s.show)
        finally:
            if live is not None:
                live.end(s.end)  # (its last events shown once recorded)
            else:
                s.end()
            self._attach(s)
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()
            # replayable for the grace period, then gone
            asyncio.get_running_loop().call_later(max(self.limits.resume_grace, 0.0),
                                                  self._forget, s)

    def _forget(self, s: SseStream) -> None:
        if self.streams.get(s.id) is s:  # (not one continued here since under its id)
            del self.streams[s.id]

"""A running stream's live record in the shared state (service/shared_state.py), so that
another replica can follow it while its replica lives and take it over when it dies. The
Responses API records background and WebSocket-mode responses this way
(service/responses_api.py), the completion endpoints their opted-in resumable streams
(service/sse_resume.py).

A record is four keys under one prefix and id:

- `{prefix}{id}`: the request, JSON, written once (`open`);
- `{prefix}{id}:steps`: a list, one entry per write of what the stream sent since the
  last (its events, the output token ids they came from, and what else the caller
  keeps), and `null` once it has ended (`end`);
- `{prefix}{id}:owner`: the name of the replica that writes it;
- `{prefix}{id}:alive`: the owner's heartbeat, renewed every BEAT_EVERY seconds and by
  each write, gone ALIVE_TTL seconds after the last.

Writes go through one `StepWriter` a Redis: all records' writes since the last call was
answered are one Lua call, done only while the writer still owns each record. A stream
shows its followers only what is written, so a follower never has an event the record
lacks; the stream itself never waits for Redis. Another replica asked for the stream
reads the steps every FOLLOW_POLL seconds while the heartbeat lives; once it has
lapsed, `take` makes it the owner (atomically: one taker; the old owner's writes are
refused from then on, should it come back) and it continues the stream from the
recorded tokens, recording on as the owner."""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from service.shared_state import SharedState

ALIVE_TTL = 5  # seconds the owner's heartbeat lasts: past it, another replica may take over
BEAT_EVERY = 1.0  # seconds between heartbeats
FOLLOW_POLL = 0.1  # seconds between a cross-replica follower's reads of the record
WATCHED_TTL = 3  # seconds a follower elsewhere counts as following after its last read
END = "!"  # the step that ends a record (a `null` entry; owner and heartbeat go)

# Writes of several records at once. KEYS: per record owner, steps, request, alive. ARGV:
# alive ttl, then per record its writer's name, a step (JSON; "" for a heartbeat, which
# also makes every key live `ttl` more; END) and its ttl. Each is done only while that
# name owns the record (1; else 0).
_STEPS = """
local out = {}
for i = 0, (#ARGV - 1) / 3 - 1 do
  local k, me, step, ttl = i * 4, ARGV[2 + 3 * i], ARGV[3 + 3 * i], ARGV[4 + 3 * i]
  if redis.call('get', KEYS[k + 1]) ~= me then
    out[i + 1] = 0
  else
    if step == '!' then
      redis.call('rpush', KEYS[k + 2], 'null')
      for j = 2, 3 do redis.call('expire', KEYS[k + j], ttl) end
      redis.call('del', KEYS[k + 1], KEYS[k + 4])
    else
      if step == '' then
        for j = 1, 3 do redis.call('expire', KEYS[k + j], ttl) end
      elseif redis.call('rpush', KEYS[k + 2], step) == 1 then
        redis.call('expire', KEYS[k + 2], ttl)
      end
      redis.call('set', KEYS[k + 4], '1', 'EX', ARGV[1])
    end
    out[i + 1] = 1
  end
end
return out
"""
# KEYS: request, owner, alive. ARGV: request JSON, me, ttl, alive ttl.
_OPEN = """
redis.call('set', KEYS[1], ARGV[1], 'EX', ARGV[3])
redis.call('set', KEYS[2], ARGV[2], 'EX', ARGV[3])
redis.call('set', KEYS[3], '1', 'EX', ARGV[4])
return 1
"""
# KEYS: owner, alive. ARGV: me, alive ttl. Takes a record whose owner's heartbeat stopped.
TAKE = """
if redis.call('exists', KEYS[2]) == 1 or redis.call('exists', KEYS[1]) == 0 then return 0 end
redis.call('set', KEYS[1], ARGV[1], 'KEEPTTL')
redis.call('set', KEYS[2], '1', 'EX', ARGV[2])
return 1
"""

_TASKS: set[asyncio.Task[None]] = set()  # writes under way, referenced till done


@dataclass(eq=False)
class LiveRecord:
    shared: SharedState
    prefix: str
    rid: str
    me: str  # the writer's name (its replica's)
    ttl: int  # seconds the record outlasts its last write
    events: int = 0  # the stream's events recorded (or on their way)
    tokens: int = 0  # its output tokens recorded (or on their way)
    owned: bool = True
    broken: bool = False  # a write failed: the record ends at the gap (end, or the beat)
    beat: asyncio.Task | None = None
    on_lost: Callable[[], None] | None = None  # called once another replica took it

    def key(self, part: str = "") -> str:
        return f"{self.prefix}{self.rid}{part}"

    async def open(self, request: dict[str, Any]) -> bool:
        """Write the request and own the record (False: Redis did not answer)."""
        ok = await self.shared.run_script(_OPEN, [self.key(), self.key(":owner"),
                                                  self.key(":alive")],
                                          [json.dumps(request), self.me, self.ttl, ALIVE_TTL])
        if ok == 1:
            self._beat()
        return ok == 1

    async def take(self) -> bool:
        """Own a record whose owner's heartbeat lapsed (False: it lives, another replica
        took it, or it is gone)."""
        ok = await self.shared.run_script(TAKE, [self.key(":owner"), self.key(":alive")],
                                          [self.me, ALIVE_TTL])
        if ok == 1:
            self._beat()
        return ok == 1

    def release(self) -> None:
        """Stop writing it (its heartbeat lapses: another replica may take it)."""
        self.owned = False
        if self.beat is not None:
            self.beat.cancel()

    def _beat(self) -> None:
        async def beat() -> None:
            # its own call, not queued behind steps: a slow batch does not stop it
            keys = [self.key(":owner"), self.key(":steps"), self.key(), self.key(":alive")]
            while True:
                await asyncio.sleep(BEAT_EVERY)
                if not self.owned:
                    return
                if self.broken:  # (Redis answers again, maybe: end the record at its gap)
                    self.end()
                    return
                answer = await self.shared.run_script(_STEPS, keys,
                                                      [ALIVE_TTL, self.me, "", self.ttl])
                if isinstance(answer, list) and answer[0] == 0:
                    self._lose()
                    return
        self.beat = asyncio.get_running_loop().create_task(beat())

    def _lose(self) -> None:
        """Another replica took it over (this one stalled past the heartbeat): stop."""
        if self.owned:
            self.release()
            if self.on_lost is not None:
                self.on_lost()

    def record(self, events: list[str], token_ids: Sequence[int], extra: Any,
               show: Callable[[int | None], None]) -> None:
        """Write the events after the `events` recorded (all of `events` so far) and the
        token ids after `tokens`; `show(len(events))` once written. When a write fails
        the record ends where it was (`broken`; what comes after a gap cannot be
        continued elsewhere) and `show(None)`: the stream shows everything as it comes."""
        if not self.owned or self.broken:
            show(None)
            return
        if len(events) == self.events:
            return
        upto, tokens = len(events), max(len(token_ids), self.tokens)
        step = json.dumps([events[self.events:], list(token_ids[self.tokens:tokens]), extra])
        self.events, self.tokens = upto, tokens

        def written(answer: int | None) -> None:
            if answer == 1:
                show(upto)
                return
            show(None)
            if answer == 0:
                self._lose()
            else:
                self.broken = True
        StepWriter.of(self.shared).write(self, step, written)

    def end(self, done: Callable[[], None] | None = None) -> None:
        """The stream ended (or its record broke): an end entry after its last step; the
        request and the steps stay `ttl` seconds for replays, owner and heartbeat go.
        `done()` once that is answered (at once when the record is not this one's):
        the stream's last events are recorded by then."""
        if self.beat is not None and self.beat is not asyncio.current_task():
            self.beat.cancel()
        if not self.owned:
            if done is not None:
                done()
            return
        self.owned = False
        StepWriter.of(self.shared).write(self, END, lambda answer: done() if done else None)

    async def close(self) -> None:
        """The stream ended and is shared elsewhere: the whole record goes (a write
        still on its way then finds no owner, and is not done)."""
        was = self.owned
        self.release()
        if was:
            await self.shared.delete(*(self.key(p) for p in (":owner", "", ":steps", ":alive")))

    async def read(self, start: int) -> tuple[Any, list[Any], bool] | None:
        """The request, the steps from index `start` (an ended record's last is None)
        and whether the owner's heartbeat lives, read by a follower elsewhere (which
        marks the record watched for WATCHED_TTL seconds); None when Redis did not
        answer."""
        return await self.shared.read_from(self.key(), self.key(":steps"), start,
                                           self.key(":alive"), self.key(":watched"),
                                           WATCHED_TTL)

    async def watched(self) -> bool:
        """Whether a follower on another replica read it in the last WATCHED_TTL
        seconds (its owner then keeps the stream running, as for a follower of its
        own)."""
        return await self.shared.exists(self.key(":watched")) is True


class StepWriter:
    """The live records' writes, sent as one script call for all that came in since the
    last one was answered: with many streams running, about one Redis round trip (and
    one command to pack) an engine step rather than one a stream, and no wait in any
    stream's own loop. One call at a time, so each record's writes are done in order."""

    _of: weakref.WeakKeyDictionary[SharedState, StepWriter] = weakref.WeakKeyDictionary()

    def __init__(self, shared: SharedState) -> None:
        self.shared = shared
        self.pending: list[tuple[LiveRecord, str, Callable[[int | None], None]]] = []
        self.busy = False

    @classmethod
    def of(cls, shared: SharedState) -> StepWriter:
        writer = cls._of.get(shared)
        if writer is None:
            writer = cls._of[shared] = cls(shared)
        return writer

    def write(self, record: LiveRecord, step: str, answered: Callable[[int | None], None]
              ) -> None:
        """Write `step` soon; `answered(1)` once written, 0 when the record is not
        `record.me`'s, None when Redis did not answer."""
        self.pending.append((record, step, answered))
        if not self.busy:
            self.busy = True
            loop = asyncio.get_running_loop()  # (the batch goes once this turn is over)
            loop.call_soon(self._start)

    def _start(self) -> None:
        task = asyncio.get_running_loop().create_task(self._flush())
        _TASKS.add(task)
        task.add_done_callback(_TASKS.discard)

    async def _flush(self) -> None:
        try:
            while self.pending:
                batch, self.pending = self.pending, []
                keys = [k for r, _, _ in batch
                        for k in (r.key(":owner"), r.key(":steps"), r.key(), r.key(":alive"))]
                args: list[Any] = [ALIVE_TTL]
                for r, step, _ in batch:
                    args += [r.me, step, r.ttl]
                answer = await self.shared.run_script(_STEPS, keys, args)
                for i, (_, _, answered) in enumerate(batch):
                    answered(answer[i] if isinstance(answer, list) else None)
        finally:
            self.busy = False

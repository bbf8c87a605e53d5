"""WS /v1/ws: one session per socket with a reader task and a writer task.

The engine's per-step dispatch (on the loop thread) calls each stream's listener, which
only queues the request's id for the socket's writer: one task wake-up per socket per
step, whatever the number of streams on it. The writer pulls each stream's pending
output (steps that queued up while it was blocked on a full socket are merged into one
delta, never dropped), builds the frames, encodes and sends them. The send queue holds
control frames and at most one "pull" marker per request, so it stays small; a writer
blocked on one send past the slow-consumer timeout gets its requests aborted.

Resume: when a socket drops, its unfinished requests are parked in the engine (out of the
batch, blocks freed within a step, tokens and sampler state kept) for `resume_grace`
seconds. A new socket of the same key sends `resume {id, after_seq, session_id}`; it gets
`resumed`, then one delta per sample with everything after `after_seq` (merged, as under
backpressure), and the request, requeued, goes on streaming where it stopped: its KV is
recomputed, mostly from the prefix cache. A request that finished while its done frame
was unsent is replayed the same way."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from engine.outputs import RequestOutput
from service.gateway import Admission, Gateway, Principal
from service.origins import origin_allowed
from service.protocol import (SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, Codec, ProtocolError,
                              parse_generate, parse_resume, parse_warm, request_id)

FINISH = {"stop": "stop", "length": "length", "abort": "cancelled", "error": "error"}
STATUS = {"stop": "completed", "length": "completed", "abort": "cancelled", "error": "failed"}
_CLOSE = object()  # send-queue sentinel: the writer stops


@dataclass(eq=False, slots=True)
class _Live:
    """A request in flight on this socket."""

    rid: str
    adm: Admission
    logprobs: bool
    track: Timings
    seq: int = 0
    started: bool = False
    queued: bool = False  # a pull marker for it is in the send queue
    failure: ProtocolError | None = None  # reported before its done (slow_consumer)
    last: RequestOutput | None = None
    # after delta seq s the client has marks[s-1] = (sample index, its tokens, its chars)
    marks: list[tuple[int, int, int]] = field(default_factory=list)
    ended: bool = False  # its done frame is built (tail holds it until it is written)
    tail: list[dict[str, Any]] = field(default_factory=list)


@dataclass(eq=False)
class _SuspendedSend:
    """A frame whose send suspended in dispatch (flow control), and the frames after it."""

    coro: Any
    awaiting: Any
    msg: dict[str, Any]
    rest: list[dict[str, Any]]
    live: _Live


class Session:
    def __init__(self, ws: WebSocket, codec: Codec, gateway: Gateway, principal: Principal) -> None:
        self.ws, self.codec, self.gw, self.principal = ws, codec, gateway, principal
        self.limits = gateway.config.limits
        self.live: dict[str, _Live] = {}
        self.unsent: dict[str, _Live] = {}  # ended, but the done frame is not written yet
        self.dropped = False  # the client went away (rather than us closing the socket)
        # frames (dicts), _Live markers (pull that stream now), or _CLOSE; in send order
        self.sendq: deque[Any] = deque()
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()  # the reader waits on it while sendq is over limit
        self._drained.set()
        self._sending_since: float | None = None
        self._busy = False  # the writer task has frames to send or a send in flight
        self._dead = False  # a send failed: the socket is gone
        # The server's own ASGI send (stashed by service.app.RawSend): data frames skip
        # Starlette's per-message state checks and exception-handling wrappers.
        self._asgi_send = ws.scope.get("tidewire.asgi_send") or ws._send
        # Under our uvicorn protocol (service.server.FrameWriterProtocol) a data frame is
        # written synchronously with no ASGI message at all; it declines when the ASGI
        # send must carry the frame (flow control, closing, compression).
        self._write_frame = ws.scope.get("extensions", {}).get("tidewire.write_frame")
        self.warms: set[asyncio.Task[None]] = set()
        self.session_id = uuid.uuid4().hex

    async def run(self) -> None:
        tasks = [asyncio.create_task(self._writer()), asyncio.create_task(self._watchdog())]
        self._frame({"type": "ready", "session_id": self.session_id,
                     "protocol": self.codec.subprotocol, "model": self.gw.config.model_name,
                     "limits": self._limits(), "features": self._features(),
                     "sampling_defaults": self.gw.sampling_defaults})
        try:
            await self._reader()
        finally:
            self._close_all()
            self.sendq.append(_CLOSE)
            self._wake.set()
            tasks[1].cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    def _limits(self) -> dict[str, Any]:
        lim = self.limits
        return {"max_inflight": lim.max_inflight_per_connection,
                "max_message_bytes": lim.max_message_bytes,
                "max_model_len": self.gw.engine.max_model_len,
                "resume_grace_s": lim.resume_grace}

    def _features(self) -> list[str]:
        return ["warm", "cancel", "ping"] + (["resume"] if self.limits.resume_grace > 0 else [])

    # -- the send side ---------------------------------------------------------------------

    def _frame(self, msg: dict[str, Any]) -> None:
        self.sendq.append(msg)
        self._wake.set()
        if len(self.sendq) > self.limits.send_queue:
            self._drained.clear()  # stop reading this client until it reads its frames

    def _notify(self, live: _Live) -> None:
        """A stream has output (called from the engine's dispatch, on the loop thread).

        When nothing is queued or in flight on this socket, its frames are written right
        here, synchronously: the server's ASGI send completes without suspending while
        the transport accepts data, so each socket costs one pass through the send path
        and no task wake-up. Otherwise (or if a send does suspend: flow control) the
        writer task takes over, in order."""
        if live.queued:
            return
        if self.sendq or self._busy or self._dead:
            live.queued = True
            self.sendq.append(live)
            self._wake.set()
            return
        frames = self._pull(live)
        for i, msg in enumerate(frames):
            sent = self._send_now(msg, live)
            if sent is True:
                continue
            if sent is not None:  # suspended mid-send: the writer finishes it, then the rest
                self._busy = True
                self.sendq.append(_SuspendedSend(sent[0], sent[1], msg, frames[i + 1:], live))
                self._wake.set()
            return
        self._delivered(live)

    def _send_now(self, msg: dict[str, Any], live: _Live | None) -> Any:
        """Write one frame, or run its ASGI send up to its first suspension. True:
        written; None: the socket is gone; else (coroutine, what it awaits) to finish
        later."""
        data = self._write(msg, live)
        if data is None:
            return True
        coro = self._asgi_send(self._message(data))
        try:
            awaiting = coro.send(None)  # type: ignore[union-attr]  # an ASGI send coroutine
        except StopIteration:
            self._written(msg, live)
            return True
        except (WebSocketDisconnect, RuntimeError, OSError):
            self._dead = True  # the reader sees the disconnect and parks or aborts everything
            return None
        return coro, awaiting

    def _write(self, msg: dict[str, Any], live: _Live | None) -> bytes | str | None:
        """Encode a frame and write it directly if the server lets us (None: written);
        else return it encoded, for the ASGI send."""
        data = self.codec.encode(msg)
        if self._write_frame is not None and self._write_frame(data):
            self._written(msg, live)
            return None
        return data

    @staticmethod
    def _message(data: bytes | str) -> dict[str, Any]:
        if isinstance(data, bytes):
            return {"type": "websocket.send", "bytes": data}
        return {"type": "websocket.send", "text": data}

    def _written(self, msg: dict[str, Any], live: _Live | None) -> None:
        if live is not None and msg["type"] == "delta":
            self.gw.log_delivery(time.monotonic() - live.adm.stream.sampled_at)

    def _delivered(self, live: _Live) -> None:
        if live.ended and self.unsent.get(live.rid) is live:
            del self.unsent[live.rid]  # its done is written: nothing left to resume

    async def _writer(self) -> None:
        q, wake = self.sendq, self._wake
        while True:
            while not q:
                self._busy = False
                wake.clear()
                await wake.wait()
            self._busy = True
            item = q.popleft()
            if item is _CLOSE:
                return
            if not self._drained.is_set() and len(q) <= self.limits.send_queue // 2:
                self._drained.set()
            if isinstance(item, _SuspendedSend):
                if not await self._finish_send(item.coro, item.awaiting):
                    return
                self._written(item.msg, item.live)
                frames, live = item.rest, item.live
            elif isinstance(item, _Live):
                frames, live = self._pull(item), item
            else:
                frames, live = [item], None
            for msg in frames:
                if not await self._send(msg, live):
                    return
            if live is not None:
                self._delivered(live)

    async def _send(self, msg: dict[str, Any], live: _Live | None) -> bool:
        data = self._write(msg, live)
        if data is None:
            return True
        coro = self._asgi_send(self._message(data))
        self._sending_since = time.monotonic()
        try:
            await coro
        except (WebSocketDisconnect, RuntimeError, OSError):
            self._dead = True
            return False  # gone: the reader sees the disconnect and parks or aborts everything
        finally:
            self._sending_since = None
        self._written(msg, live)
        return True

    async def _finish_send(self, coro: Any, awaiting: Any) -> bool:
        """Drive a send that suspended in _send_now to its end: wait for what it
        awaits, then resume it, until it returns."""
        self._sending_since = time.monotonic()
        try:
            while True:
                try:
                    if awaiting is None:
                        await asyncio.sleep(0)  # a bare yield
                    else:
                        # as a Task does with what its coroutine yields: clear the flag
                        # the future set when it was yielded, then wait for it
                        awaiting._asyncio_future_blocking = False
                        await awaiting
                except asyncio.CancelledError:
                    if awaiting is None or not awaiting.cancelled():
                        raise  # we are cancelled, not what it awaited
                except Exception:  # noqa: BLE001 - it raises inside the send, below
                    pass
                try:
                    awaiting = coro.send(None)
                except StopIteration:
                    return True
        except (WebSocketDisconnect, RuntimeError, OSError):
            self._dead = True
            return False
        finally:
            coro.close()
            self._sending_since = None

    async def _watchdog(self) -> None:
        """A send blocked past the timeout means the client is not reading: abort its
        requests (their frames, with a slow_consumer error, go out if it ever reads)."""
        timeout = self.limits.slow_consumer_timeout
        while True:
            await asyncio.sleep(min(timeout / 4, 1.0))
            since = self._sending_since
            if since is not None and time.monotonic() - since > timeout:
                for live in self.live.values():
                    if live.failure is None:
                        live.failure = ProtocolError(
                            "slow_consumer", "the client is not reading its stream", live.rid)
                        self.gw.engine.abort(live.adm.stream.request_id)

    def _pull(self, live: _Live) -> list[dict[str, Any]]:
        """Frames for everything the stream has produced since the last pull."""
        live.queued = False
        stream, frames = live.adm.stream, []
        out = stream.output  # cumulative; each step below is already folded into it
        while (step := stream.take_step()) is not None:
            live.last = out
            if not live.started:
                live.started = True
                frames.append(self._start(live.rid, out, stream.queue_time))
            new, text = step.new_token_ids, step.text_delta
            live.track.token(len(new), self.gw)
            if new or text:
                live.seq += 1
                index = step.index
                c = out.outputs[index]
                live.marks.append((index, len(c.token_ids), c.text_len))
                frames.append(self._delta(live.rid, live.seq, index, len(out.outputs), new,
                                          text, c.logprobs if live.logprobs else None))
        if stream.finished:
            frames += self._finish(live)
        return frames

    def _finish(self, live: _Live) -> list[dict[str, Any]]:
        last = live.last
        reason = (last.finish_reason if last else None) or "error"
        frames = []
        if live.failure is not None:
            reason = "error"
            frames.append(self._failed(live.failure))
        elif reason == "error":  # the engine failed this request (its thread died)
            frames.append(self._failed(ProtocolError(
                "internal_error", (last.error if last else None) or "engine failure", live.rid)))
        self._forget(live, reason)
        frames.append(self._done(live.rid, live.adm, last, reason, live.track))
        live.ended, live.tail = True, frames
        self.unsent[live.rid] = live
        return frames

    def _failed(self, e: ProtocolError) -> dict[str, Any]:
        self.gw.metrics.errors.labels(e.code).inc()
        return e.frame()

    def _forget(self, live: _Live, reason: str) -> None:
        live.adm.stream.listener = None
        if self.live.pop(live.rid, None) is not None:
            self.gw.release(live.adm, reason)

    # -- the receive side --------------------------------------------------------------------

    async def _reader(self) -> None:
        while True:
            if not self._drained.is_set():
                await self._drained.wait()
            try:
                m = await asyncio.wait_for(self.ws.receive(), self._idle_timeout())
            except asyncio.TimeoutError:
                await self.ws.close(code=1000, reason="idle timeout")
                return
            if m["type"] == "websocket.disconnect":
                if m.get("code") == 1009:  # the server's hard cap (service.server) closed it
                    self.gw.metrics.errors.labels("message_too_big").inc()
                self.dropped = True
                return
            data = m.get("bytes") if m.get("bytes") is not None else m.get("text")
            if data is None:
                continue
            if self._over_limit(data):
                self._error(self._too_big(data))  # the socket stays open, as for any bad message
                continue
            try:
                self._handle(self.codec.decode(data))
            except ProtocolError as e:
                self._error(e)

    def _over_limit(self, data: bytes | str) -> bool:
        """Whether a message is over max_message_bytes as it was on the wire: a text
        frame's UTF-8 bytes, encoded only when its length in characters cannot tell."""
        limit, n = self.limits.max_message_bytes, len(data)
        if isinstance(data, str) and limit // 4 < n <= limit:
            n = len(data.encode())
        return n > limit

    def _too_big(self, data: bytes | str) -> ProtocolError:
        """message_too_big, naming the message's request when it has a valid id, so that
        an SDK fails that request rather than waiting on it. The id is looked for only in
        a message up to twice the limit: decoding megabytes on the event loop stalls
        every stream's fan-out, and a client could repeat it at will."""
        rid = None
        size = len(data.encode()) if isinstance(data, str) else len(data)
        if size <= 2 * self.limits.max_message_bytes:
            with contextlib.suppress(ProtocolError):
                rid = request_id(self.codec.decode(data))
        return ProtocolError("message_too_big",
                             f"message of {size} bytes is over max_message_bytes "
                             f"({self.limits.max_message_bytes}, in the ready frame's limits)",
                             rid)

    def _idle_timeout(self) -> float | None:
        return None if self.live else self.limits.idle_timeout

    def _error(self, e: ProtocolError) -> None:
        self._frame(self._failed(e))

    def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "generate":
            self._generate(msg)
        elif kind == "cancel":
            self._cancel(request_id(msg))
        elif kind == "ping":
            self._frame({"type": "pong", "t": msg.get("t")})
        elif kind == "warm":
            self._warm(msg)
        elif kind == "resume":
            self._resume(msg)
        else:
            raise ProtocolError("invalid_request", f"unknown message type {kind!r}",
                                msg.get("id") if isinstance(msg.get("id"), str) else None)

    def _cancel(self, rid: str) -> None:
        """Abort a request in flight on this socket; its done (cancelled) follows.

        An id not in flight here answers `unknown_id`: never generated on this socket
        (a warm, another socket's, parked by a dropped one), or finished. A finished one
        leaves self.live when its done frame is built, and that frame is written or
        queued ahead of this error: the client sees done, then unknown_id. One that the
        engine finished but whose done is not built yet is still here: the abort is a
        no-op and its done tells how it really ended."""
        live = self.live.get(rid)
        if live is None:
            raise ProtocolError("unknown_id", f"no request {rid!r} is in flight on this socket",
                                rid)
        self.gw.engine.abort(live.adm.stream.request_id)

    def _check_room(self, rid: str) -> None:
        """A new (or resumed) stream needs a free id and room on this socket."""
        if rid in self.live:
            raise ProtocolError("duplicate_id", f"request {rid!r} is already in flight", rid)
        if len(self.live) >= self.limits.max_inflight_per_connection:
            raise ProtocolError("too_many_inflight", "too many requests in flight on this socket",
                                rid)

    def _generate(self, msg: dict[str, Any]) -> None:
        g = parse_generate(msg, self.gw.sampling_defaults)
        self._check_room(g.id)
        ahead = self.gw.queue_position()
        adm = self.gw.submit(self.principal, g.params, g.id, g.prompt, g.messages)
        if ahead is not None:
            self._frame({"type": "queued", "id": g.id, "position": ahead})
        live = _Live(g.id, adm, g.params.logprobs is not None, Timings(adm.arrival))
        self.live[g.id] = live
        # No output can have arrived yet: dispatch runs on this (the loop) thread.
        adm.stream.listener = partial(self._notify, live)

    def _warm(self, msg: dict[str, Any]) -> None:
        w = parse_warm(msg)
        if len(self.live) + len(self.warms) >= self.limits.max_inflight_per_connection:
            raise ProtocolError("too_many_inflight", "too many requests in flight on this socket",
                                w.id)
        task = asyncio.create_task(self._run_warm(w.id, w.prompt, w.messages))
        self.warms.add(task)
        task.add_done_callback(self.warms.discard)

    async def _run_warm(self, rid: str | None, prompt: str | list[int] | None,
                        messages: list[dict[str, str]] | None) -> None:
        try:
            res = await self.gw.warm(self.principal, rid, prompt, messages)
        except ProtocolError as e:
            self._error(e)
            return
        self._frame({"type": "warmed", "id": rid, **res})

    def _resume(self, msg: dict[str, Any]) -> None:
        r = parse_resume(msg)
        self._check_room(r.id)
        live = self.gw.reattach(r.session_id, self.principal, r.id, r.after_seq)
        self._frame({"type": "resumed", "id": r.id, "after_seq": r.after_seq})
        for frame in self._replay(live, r.after_seq):
            self._frame(frame)
        if live.ended:
            for frame in live.tail:
                self._frame(frame)
            return
        self.live[r.id] = live
        live.adm.stream.listener = partial(self._notify, live)
        self._notify(live)  # whatever arrived while it was parked

    def _replay(self, live: _Live, after_seq: int) -> list[dict[str, Any]]:
        """Deltas for everything sent after `after_seq`: one per sample, merged."""
        have: dict[int, tuple[int, int]] = {}
        for index, ntok, nchar in live.marks[:after_seq]:
            have[index] = (ntok, nchar)
        del live.marks[after_seq:]
        live.seq = after_seq
        frames = []
        outputs = live.adm.stream.output.outputs
        for c in outputs:
            ntok, nchar = have.get(c.index, (0, 0))
            if len(c.token_ids) > ntok or c.text_len > nchar:
                live.seq += 1
                live.marks.append((c.index, len(c.token_ids), c.text_len))
                frames.append(self._delta(live.rid, live.seq, c.index, len(outputs),
                                          c.token_ids[ntok:], c.text[nchar:],
                                          (c.logprobs or []) if live.logprobs else None,
                                          ntok))
        return frames

    def _close_all(self) -> None:
        """Our side of the socket is done. If the client dropped, its unfinished
        requests are parked for a resume (blocks freed next step); otherwise, or past
        the limits, they are aborted (blocks freed next step)."""
        for t in self.warms:
            t.cancel()
        for live in self.live.values():
            live.adm.stream.listener = None
            live.queued = False
        self.sendq.clear()  # markers and frames for a dead socket
        keep = {**self.unsent, **self.live} if self.dropped else {}
        refused = self.gw.detach(self.session_id, self.principal, keep) if keep else []
        for live in (refused if self.dropped else list(self.live.values())):
            if not live.ended:
                self.gw.engine.abort(live.adm.stream.request_id)
                self._forget(live, "abort")
        self.live.clear()
        self.unsent.clear()

    # -- frames ----------------------------------------------------------------------------

    @staticmethod
    def _start(rid: str, out: RequestOutput, queue_time: float) -> dict[str, Any]:
        return {"type": "start", "id": rid, "prompt_tokens": len(out.prompt_token_ids),
                "cached_tokens": cached_tokens(out), "queue_ms": round(queue_time * 1000, 3)}

    @staticmethod
    def _delta(rid: str, seq: int, index: int, n: int, token_ids: list[int], text: str,
               logprobs: list | None, start: int | None = None) -> dict[str, Any]:
        """A delta frame; `logprobs` is the sample's cumulative list, whose entries for
        `token_ids` start at `start` (default: they are its tail)."""
        d: dict[str, Any] = {"type": "delta", "id": rid, "seq": seq, "text": text,
                             "token_ids": token_ids}
        if n > 1:
            d["index"] = index
        if logprobs is not None:
            at = len(logprobs) - len(token_ids) if start is None else start
            d["logprobs"] = [{"token_id": x.token_id, "logprob": x.logprob,
                              "top": [[t, v] for t, v in x.top]}
                             for x in logprobs[at:at + len(token_ids)]] if token_ids else []
        return d

    @staticmethod
    def _done(rid: str, adm: Admission, last: RequestOutput | None, reason: str,
              track: Timings) -> dict[str, Any]:
        completion = sum(len(o.token_ids) for o in last.outputs) if last else 0
        done: dict[str, Any] = {
            "type": "done", "id": rid, "status": STATUS.get(reason, "failed"),
            "finish_reason": FINISH.get(reason, "error"),
            "usage": {"prompt_tokens": len(adm.stream.output.prompt_token_ids),
                      "completion_tokens": completion,
                      "cached_tokens": cached_tokens(last)},
            "timings": track.summary(completion, adm.stream.queue_time),
        }
        if last and len(last.outputs) > 1:
            done["finish_reasons"] = [FINISH.get(o.finish_reason or "error", "error")
                                      for o in last.outputs]
        return done

def cached_tokens(out: RequestOutput | None) -> dict[str, int]:
    """Prompt tokens whose KV was reused: found on the device, or loaded from the host
    tier (memory / Redis)."""
    if out is None:
        return {"device": 0, "host": 0}
    host = out.num_host_cached_tokens
    return {"device": out.num_cached_tokens - host, "host": host}


class Timings:
    __slots__ = ("arrival", "first", "last")

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.first: float | None = None
        self.last = arrival

    def token(self, n: int, gw: Gateway) -> None:
        """n tokens delivered now (metrics are recorded after the step's fan-out)."""
        if n:
            now = time.monotonic()
            if self.first is None:
                self.first = now
                gw.log_tokens(True, now - self.arrival, n)
            else:
                gw.log_tokens(False, now - self.last, n)
            self.last = now

    def summary(self, completion: int, queue_time: float) -> dict[str, float]:
        total = time.monotonic() - self.arrival
        ttft = (self.first - self.arrival) if self.first else total
        gen = self.last - (self.first or self.last)
        rate = (completion - 1) / gen if completion > 1 and gen > 0 else 0.0
        return {"queue_ms": round(queue_time * 1000, 3), "ttft_ms": round(ttft * 1000, 3),
                "tokens_per_s": round(rate, 3), "total_ms": round(total * 1000, 3)}


def choose_subprotocol(offered: list[str]) -> str | None:
    for sp in (SUBPROTOCOL_MSGPACK, SUBPROTOCOL_JSON):
        if sp in offered:
            return sp
    return None


async def websocket_endpoint(ws: WebSocket) -> None:
    gw: Gateway = ws.app.state.gateway
    offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    if not origin_allowed(ws.headers.get("origin"), ws.headers.get("host"),
                          gw.config.allowed_origins):
        await ws.close(code=1008, reason="origin not allowed")  # before accept: HTTP 403
        return
    try:
        principal = gw.authenticate(ws.headers.get("authorization"), offered)
    except ProtocolError:
        gw.metrics.errors.labels("unauthorized").inc()
        await ws.close(code=1008, reason="unauthorized")
        return
    if len(gw.sessions) >= gw.config.limits.max_connections or not gw.accepting:
        await ws.accept()  # close codes only reach a client after the handshake
        await ws.close(code=1013, reason="overloaded")
        return
    sub = choose_subprotocol(offered) or SUBPROTOCOL_JSON
    await ws.accept(subprotocol=sub if sub in offered else None)  # never echo the auth key
    session = Session(ws, Codec(sub), gw, principal)
    gw.sessions.add(session)
    gw.metrics.connections.inc()
    try:
        await session.run()
    finally:
        gw.sessions.discard(session)
        gw.metrics.connections.dec()


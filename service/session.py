"""WS /v1/ws: one Session per socket, in the shape of Starlette's WebSocketEndpoint: a
reader loop that decodes each client message and dispatches it (generate, cancel, warm,
resume, ping), over the rooms that do the rest:

- service/sender.py: the socket's one writer (the fast path inside the engine's
  dispatch, the writer task, backpressure);
- service/delivery.py: what a stream sends (start, merged deltas with resume marks,
  done), without sockets;
- service/resume.py: the requests of dropped sockets, parked for a resume;
- service/gateway.py: auth, limits, admission and the end-of-request bookkeeping.

Resume: when a socket drops, its unfinished requests are parked (blocks freed within a
step, tokens and sampler state kept) for `resume_grace` seconds. A new socket of the same
key sends `resume {id, after_seq, session_id}`; it gets `resumed`, then one delta per
sample with everything after `after_seq` (merged, as under backpressure), and the
request, requeued, goes on streaming where it stopped: its KV is recomputed, mostly from
the prefix cache. A request that finished while its done frame was unsent is replayed
the same way, and so is one whose done was written in the last RECENT_DONE_SECONDS
(at most RECENT_DONES per socket): written to the transport is not received, and a
connection that dies takes what was in flight with it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from functools import partial
from typing import Any

from starlette.websockets import WebSocket

from service.delivery import Live, Timings, done_frame, replay, step_frames
from service.gateway import Admission, Gateway, Hold, Principal
from service.origins import origin_allowed
from service.protocol import (SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, Codec, Generate,
                              ProtocolError, Resume, parse_generate, parse_resume, parse_warm,
                              request_id)
from service import tools as tool_calls
from service.sender import Sender

log = logging.getLogger("tidewire.service")

# How long, and for how many requests, a socket keeps its ended requests resumable after
# their done was written (see the module docstring).
RECENT_DONE_SECONDS = 10.0
RECENT_DONES = 64
# How long a resume naming a session whose socket is still open here waits for it to close
# (a client that reconnects at once can be ahead of the server noticing the drop).
RESUME_WAIT_SECONDS = 5.0


class Session:
    clock = staticmethod(time.monotonic)  # (tests replace it on an instance)

    def __init__(self, ws: WebSocket, codec: Codec, gateway: Gateway, principal: Principal) -> None:
        self.ws, self.codec, self.gw, self.principal = ws, codec, gateway, principal
        self.limits = gateway.config.limits
        self.live: dict[str, Live] = {}
        self.unsent: dict[str, Live] = {}  # ended, but the done frame is not written yet
        # ended, done written lately (by when): a frame written to the transport may still
        # die with the connection, so a drop keeps these resumable too (RECENT_DONES)
        self.recent: dict[str, tuple[Live, float]] = {}
        self.dropped = False  # the client went away (rather than us closing the socket)
        self._log_tokens = gateway.log_tokens  # bound once: called per stream per step
        self.sender = Sender(ws, codec, self.limits, self._pull, self._delivered,
                             gateway.log_delivery)
        self.warms: set[asyncio.Task[None]] = set()
        # generates prepared before admission (a constraint compiling, a large prompt
        # tokenizing off the loop), by client id: they count as in flight
        self.preparing: dict[str, asyncio.Task[None]] = {}
        self.resuming: set[asyncio.Task[None]] = set()  # resumes waiting for a socket to close
        self.session_id = uuid.uuid4().hex
        self.closed = asyncio.Event()  # set once this socket's requests are parked or ended
        self.closing = False  # _close_all has run: nothing may start on this socket now

    async def run(self) -> None:
        tasks = [asyncio.create_task(self.sender.run()), asyncio.create_task(self._watchdog())]
        self._frame({"type": "ready", "session_id": self.session_id,
                     "protocol": self.codec.subprotocol, "model": self.gw.config.model_name,
                     "limits": self._limits(), "features": self._features(),
                     "sampling_defaults": self.gw.sampling_defaults})
        try:
            await self._reader()
        finally:
            self._close_all()
            self.closed.set()
            self.sender.close()
            tasks[1].cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    @property
    def idle(self) -> bool:
        """No request, warm or resume in flight, and every frame written: closing the
        socket now loses the client nothing."""
        return not (self.live or self.unsent or self.warms or self.preparing or self.resuming
                    or not self.sender.idle)

    def _limits(self) -> dict[str, Any]:
        lim = self.limits
        return {"max_inflight": lim.max_inflight_per_connection,
                "max_message_bytes": lim.max_message_bytes,
                "max_model_len": self.gw.engine.max_model_len,
                "resume_grace_s": lim.resume_grace}

    def _features(self) -> list[str]:
        return ["warm", "cancel", "ping"] + (["resume"] if self.limits.resume_grace > 0 else [])

    # -- what goes out (written by self.sender) --------------------------------------------

    def _frame(self, msg: dict[str, Any]) -> None:
        self.sender.frame(msg)

    def _delivered(self, live: Live) -> None:
        if live.ended and self.unsent.get(live.rid) is live:
            del self.unsent[live.rid]  # its done is written to the transport
            self.recent.pop(live.rid, None)
            self.recent[live.rid] = (live, self.clock())
            if len(self.recent) > RECENT_DONES:
                del self.recent[next(iter(self.recent))]
            self._expire_recent()

    def _expire_recent(self) -> None:
        """Forget the ends written over RECENT_DONE_SECONDS ago (oldest first: `recent` is
        in write order). Kept past that they served no resume and held every request's
        output (64 a socket: a soak's heap grew with them)."""
        recent, since = self.recent, self.clock() - RECENT_DONE_SECONDS
        while recent:
            rid = next(iter(recent))
            if recent[rid][1] >= since:
                break
            del recent[rid]

    async def _watchdog(self) -> None:
        """A send blocked past the timeout means the client is not reading: abort its
        requests (their frames, with a slow_consumer error, go out if it ever reads)."""
        timeout = self.limits.slow_consumer_timeout
        while True:
            await asyncio.sleep(min(timeout / 4, 1.0))
            self._expire_recent()  # (an idle socket's too)
            since = self.sender.sending_since
            if since is not None and time.monotonic() - since > timeout:
                for live in self.live.values():
                    if live.failure is None:
                        live.failure = ProtocolError(
                            "slow_consumer", "the client is not reading its stream", live.rid)
                        self.gw.engine.abort(live.adm.stream.request_id)

    def _pull(self, live: Live) -> list[dict[str, Any]]:
        """Frames for everything the stream has produced since the last pull."""
        frames = step_frames(live, self._log_tokens)
        if live.adm.stream.finished:
            frames += self._finish(live)
        return frames

    def _finish(self, live: Live) -> list[dict[str, Any]]:
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
        frames.append(done_frame(live.rid, live.adm, last, reason, live.track, live.tools,
                                 live.calls))
        live.ended, live.tail = True, frames
        self.unsent[live.rid] = live
        return frames

    def _failed(self, e: ProtocolError) -> dict[str, Any]:
        self.gw.metrics.errors.labels(e.code).inc()
        return e.frame()

    def _forget(self, live: Live, reason: str) -> None:
        live.adm.stream.listener = None
        if self.live.pop(live.rid, None) is not None:
            self.gw.release(live.adm, reason)

    # -- the receive side --------------------------------------------------------------------

    async def _reader(self) -> None:
        while True:
            if not self.sender.drained.is_set():
                await self.sender.drained.wait()
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
            msg = None
            try:
                msg = self.codec.decode(data)
                self._handle(msg)
            except ProtocolError as e:
                self._error(e)
            except Exception as e:  # noqa: BLE001 - one frame's fault: answered, socket stays
                self._internal(e, msg)

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

    def _internal(self, e: BaseException, msg: Any = None) -> None:
        """A fault of ours while handling one client message: logged, answered with
        internal_error (naming the message's id when it has one), the socket open."""
        log.error("handling a client message failed: %r", e, exc_info=e)
        rid = msg.get("id") if isinstance(msg, dict) else None
        self._error(ProtocolError("internal_error", f"the server failed handling this message "
                                  f"({type(e).__name__})",
                                  rid if isinstance(rid, str) and len(rid) <= 128 else None))

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
        if rid in self.live or rid in self.preparing:
            raise ProtocolError("duplicate_id", f"request {rid!r} is already in flight", rid)
        if len(self.live) + len(self.preparing) >= self.limits.max_inflight_per_connection:
            raise ProtocolError("too_many_inflight", "too many requests in flight on this socket",
                                rid)

    def _generate(self, msg: dict[str, Any]) -> None:
        g = parse_generate(msg, self.gw.sampling_defaults)
        self._check_room(g.id)
        self._admit(g)

    def _admit(self, g: Generate, cont: Resume | None = None) -> None:
        """Start a generate now, or, when its constraint must compile (on the engine's
        grammar workers) or its prompt is large (tokenized off the loop), once that is
        done: the socket goes on reading meanwhile, and the request is held in flight
        for its key from now on."""
        constrained = g.params.response_format is not None
        off_loop = self.gw.off_loop(g.prompt, g.messages)
        if not constrained and not off_loop:
            self._start(g, cont)
            return
        # held before its compile starts: a key past its compile limit starts none (one
        # that waits for a compile already under way or done adds none)
        hold = self.gw.hold(self.principal, g.id, compiling=constrained
                            and not self.gw.engine.format_started(g.params))
        try:
            try:
                ready = self.gw.engine.format_ready(g.params)  # (starts nothing)
            except ValueError as e:
                raise ProtocolError("invalid_request", str(e), g.id) from None
            if ready:
                self.gw.compiled(hold)
            if ready and not off_loop:
                self._start(g, cont, hold=hold)
                return
            task = asyncio.create_task(self._prepare(g, hold, cont))
        except BaseException:
            self.gw.unhold(hold)  # (a no-op once admitted)
            raise
        self.preparing[g.id] = task
        task.add_done_callback(partial(self._prepared, g.id, hold))

    def _prepared(self, rid: str, hold: Hold, task: asyncio.Task[None]) -> None:
        if self.preparing.get(rid) is task:
            del self.preparing[rid]
        self.gw.unhold(hold)  # (a task cancelled before it ran never reached its finally)

    async def _prepare(self, g: Generate, hold: Hold, cont: Resume | None) -> None:
        try:
            try:
                await self.gw.engine.prepare(g.params)
            except ValueError as e:
                raise ProtocolError("invalid_request", str(e), g.id) from None
            self.gw.compiled(hold)
            messages, template_tools = self._render(g)
            ids = None
            if self.gw.off_loop(g.prompt, messages):
                ids = await self.gw.prompt_ids(g.prompt, messages, g.id, True, template_tools)
            self._check_open()
            self.preparing.pop(g.id, None)  # (its room is the live stream's now)
            self._start(g, cont, ids, hold)
        except ProtocolError as e:
            self._error(e)
        except Exception as e:  # noqa: BLE001 - this request's fault: answered, not leaked
            self._internal(e, {"id": g.id})
        finally:
            self.gw.unhold(hold)  # (a no-op once admitted)

    def _check_open(self) -> None:
        """Raise CancelledError in a task resuming after this socket closed: on Python
        3.11 asyncio.wait_for returns a result that arrived with its cancel instead of
        raising, and a request started then would be admitted on a dead socket, in
        flight for its key for ever."""
        if self.closing:
            raise asyncio.CancelledError

    def _render(self, g: Generate) -> tuple[Any, Any]:
        """The generate's messages with its tools rendered, and the tools the template
        takes (None, None for a plain prompt)."""
        if g.messages is None:
            return None, None
        return tool_calls.render(g.messages, g.tools, self.gw.engine.template_renders_tools)

    def _start(self, g: Generate, cont: Resume | None = None, ids: list[int] | None = None,
               hold: Hold | None = None) -> None:
        """Admit a generate. `cont`: a resume continuing it from the tokens its client
        received (answered `resumed`; the stream goes on from `cont.after_seq`). `ids`:
        its prompt, tokenized already; `hold`: its hold (Session._admit)."""
        ahead = self.gw.queue_position()
        messages, template_tools = self._render(g)
        adm = self.gw.submit(self.principal, g.params, g.id, g.prompt, messages,
                             tools=template_tools,
                             output_token_ids=cont.token_ids if cont is not None else (),
                             prompt_ids=ids, hold=hold)
        try:
            self._started(g, adm, ahead, cont)
        except BaseException:  # nothing admitted may leak: the request ends here
            self.live.pop(g.id, None)
            adm.stream.listener = None
            self.gw.end(adm)
            raise

    def _started(self, g: Generate, adm: Admission, ahead: int | None,
                 cont: Resume | None) -> None:
        if cont is not None:
            self.gw.metrics.resumes.labels("continued").inc()
            self._frame({"type": "resumed", "id": g.id, "after_seq": cont.after_seq})
        if ahead is not None:
            self._frame({"type": "queued", "id": g.id, "position": ahead})
        live = Live(g.id, adm, g.params.logprobs is not None, Timings(adm.arrival), tools=g.tools)
        if cont is not None:  # the client had its start and after_seq deltas
            first = adm.stream.output.outputs[0]
            live.started, live.seq = True, cont.after_seq
            live.marks = [(0, len(first.token_ids), first.text_len)] * cont.after_seq
        self.live[g.id] = live
        # No output can have arrived yet: dispatch runs on this (the loop) thread.
        adm.stream.listener = partial(self.sender.notify, live)

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
        old = self.gw.open_session(r.session_id)
        if old is not None and old is not self and old.principal.key == self.principal.key:
            # The client reconnected before this server saw its old socket close (its
            # requests are not parked yet): the resume waits for that close.
            task = asyncio.create_task(self._resume_after_close(old, r))
            self.resuming.add(task)
            task.add_done_callback(self.resuming.discard)
            return
        self._reattach(r)

    async def _resume_after_close(self, old: Session, r: Resume) -> None:
        try:
            try:
                await asyncio.wait_for(old.closed.wait(), RESUME_WAIT_SECONDS)
            except asyncio.TimeoutError:
                raise ProtocolError("invalid_request", f"session {r.session_id!r} is still open "
                                    "on another socket: resume it after that one closes",
                                    r.id) from None
            self._check_open()
            self._check_room(r.id)
            self._reattach(r)
        except ProtocolError as e:
            self._error(e)

    def _reattach(self, r: Resume) -> None:
        try:
            live = self.gw.parked.reattach(r.session_id, self.principal.key, r.id, r.after_seq)
        except ProtocolError:
            if r.request is None:
                raise
            self._continue(r)  # not held here: continue it from what the client has
            return
        self._frame({"type": "resumed", "id": r.id, "after_seq": r.after_seq})
        for frame in replay(live, r.after_seq):
            self._frame(frame)
        if live.ended:
            for frame in live.tail:
                self._frame(frame)
            return
        self.live[r.id] = live
        live.adm.stream.listener = partial(self.sender.notify, live)
        self.sender.notify(live)  # whatever arrived while it was parked

    def _continue(self, r: Resume) -> None:
        """A resume this server cannot reattach, carrying its request: a new request
        under this socket's key, continuing from the token ids the client received
        (recomputed with the prompt, mostly prefix hits, then sampled as if never
        interrupted: greedy and seeded output are exactly the uninterrupted run's)."""
        assert r.request is not None
        body = dict(r.request, id=r.id)  # the generate it was (a message, not a frame)
        g = parse_generate(body, self.gw.sampling_defaults)
        if g.tools is not None:
            raise ProtocolError("invalid_request", "a request with tools can only be resumed "
                                "on the server that ran it", r.id)
        if g.params.n != 1:
            raise ProtocolError("invalid_request", "a request with n > 1 can only be resumed "
                                "on the server that ran it", r.id)
        if r.after_seq > len(r.token_ids) + 1:  # a delta carries a token, but for a last
            raise ProtocolError("invalid_request", f"after_seq {r.after_seq} is more deltas "
                                f"than the {len(r.token_ids)} token_ids given could fill", r.id)
        self._admit(g, r)

    def _close_all(self) -> None:
        """Our side of the socket is done. If the client dropped, its unfinished
        requests are parked for a resume (blocks freed next step); otherwise, or past
        the limits, they are aborted (blocks freed next step)."""
        self.closing = True
        for t in (*self.warms, *self.preparing.values(), *self.resuming):
            t.cancel()
        for live in self.live.values():
            live.adm.stream.listener = None
            live.queued = False
        self.sender.discard()  # markers and frames for a dead socket
        keep: dict[str, Live] = {}
        if self.dropped:  # unfinished first: they go first when the parking space runs out
            keep = dict(self.live)
            for rid, live in self.unsent.items():
                keep.setdefault(rid, live)
            since = self.clock() - RECENT_DONE_SECONDS
            for rid, (live, when) in self.recent.items():
                if when >= since:
                    keep.setdefault(rid, live)
        refused = (self.gw.parked.detach(self.session_id, self.principal.key, keep,
                                         self.gw.accepting) if keep else [])
        for live in (refused if self.dropped else list(self.live.values())):
            if not live.ended:
                self.gw.engine.abort(live.adm.stream.request_id)
                self._forget(live, "abort")
        self.live.clear()
        self.unsent.clear()
        self.recent.clear()


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
    lim = gw.config.limits
    if len(gw.sessions) >= lim.max_connections or not gw.accepting:
        await ws.accept()  # close codes only reach a client after the handshake
        await ws.close(code=1013, reason="overloaded")
        return
    if (principal.key is not None
            and gw.sessions_by_key.get(principal.key, 0) >= lim.max_connections_per_key):
        await ws.accept()
        await ws.close(code=1013, reason="overloaded")  # (this key's share of them)
        return
    sub = choose_subprotocol(offered) or SUBPROTOCOL_JSON
    await ws.accept(subprotocol=sub if sub in offered else None)  # never echo the auth key
    session = Session(ws, Codec(sub), gw, principal)
    gw.add_session(session)
    gw.metrics.connections.inc()
    try:
        await session.run()
    finally:
        gw.remove_session(session)
        gw.metrics.connections.dec()


"""WS /v1/ws: one Session per socket, in the shape of Starlette's WebSocketEndpoint: a
reader loop that decodes each client message and dispatches it (generate, cancel, warm,
resume, ping), then the close. The rest is done by the session's parts:

- service/admission.py: its generates on their way in (room, preparing, admission);
- service/streams.py: its requests as data (in flight, ended, their frames, what a drop
  keeps resumable);
- service/resume.py: its resumes, and the parked requests of dropped sockets;
- service/sender.py and service/sink.py: the socket's one writer, and where it writes;
- service/delivery.py: what a stream sends (start, merged deltas with resume marks, done);
- service/gateway.py: auth, limits, admission and the end-of-request bookkeeping.

Resume: when a socket drops, its unfinished requests are parked (blocks freed within a
step, tokens and sampler state kept) for `resume_grace` seconds. A new socket of the same
key sends `resume {id, after_seq, session_id}`; it gets `resumed`, then one delta per
sample with everything after `after_seq` (merged, as under backpressure), and the
request, requeued, goes on streaming where it stopped: its KV is recomputed, mostly from
the prefix cache. A request that finished while its done frame was unsent is replayed
the same way, and so is one whose done was written lately (service/streams.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

from starlette.websockets import WebSocket

from service.admission import Admitter
from service.gateway import Gateway, Principal
from service.origins import origin_allowed
from service.protocol import (SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, Codec, ProtocolError,
                              parse_warm, request_id)
from service.resume import Resumer
from service.sender import Sender
from service.sink import AsgiSink, FrameSink
from service.streams import Streams, counted

log = logging.getLogger("tidewire.service")


class Session:
    """One socket: its reader loop, the dispatch of each message, and the close."""

    def __init__(self, ws: WebSocket, codec: Codec, gateway: Gateway, principal: Principal,
                 sink: FrameSink | None = None) -> None:
        """`sink`: where frames go (default: the socket's own, AsgiSink)."""
        self.ws, self.codec, self.gw, self.principal = ws, codec, gateway, principal
        self.engine = gateway.engine
        self.limits = gateway.config.limits
        self.streams = Streams(gateway)
        self.sender = Sender(sink if sink is not None else AsgiSink(ws), codec, self.limits,
                             self.streams.pull, self.streams.delivered, gateway.log_delivery)
        self.admission = Admitter(self)
        self.resumer = Resumer(self)
        self.warms: set[asyncio.Task[None]] = set()
        self.session_id = uuid.uuid4().hex
        self.closed = asyncio.Event()  # set once this socket's requests are parked or ended
        self.dropped = False  # the client went away (rather than us closing the socket)
        self.closing = False  # _close has run: nothing may start on this socket now

    async def run(self) -> None:
        tasks = [asyncio.create_task(self.sender.run()), asyncio.create_task(self._watchdog())]
        self.frame({"type": "ready", "session_id": self.session_id,
                    "protocol": self.codec.subprotocol, "model": self.gw.config.model_name,
                    "limits": self._limits(), "features": self._features(),
                    "sampling_defaults": self.gw.sampling_defaults})
        try:
            await self._reader()
        finally:
            self._close()
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
        st = self.streams
        return not (st.live or st.unsent or self.warms or self.admission.preparing
                    or self.resumer.waiting or not self.sender.idle)

    def _limits(self) -> dict[str, Any]:
        lim = self.limits
        return {"max_inflight": lim.max_inflight_per_connection,
                "max_message_bytes": lim.max_message_bytes,
                "max_model_len": self.engine.max_model_len,
                "resume_grace_s": lim.resume_grace}

    def _features(self) -> list[str]:
        return (["warm", "cancel", "ping"] + (["resume"] if self.limits.resume_grace > 0 else [])
                + (["reasoning"] if self.gw.think.on else []))

    # -- what goes out (written by self.sender) --------------------------------------------

    def frame(self, msg: dict[str, Any]) -> None:
        self.sender.frame(msg)

    def error(self, e: ProtocolError) -> None:
        self.frame(counted(self.gw, e))

    def internal(self, e: BaseException, msg: Any = None) -> None:
        """A fault of ours while handling one client message: logged, answered with
        internal_error (naming the message's id when it has one), the socket open."""
        log.error("handling a client message failed: %r", e, exc_info=e)
        rid = msg.get("id") if isinstance(msg, dict) else None
        self.error(ProtocolError("internal_error", f"the server failed handling this message "
                                 f"({type(e).__name__})",
                                 rid if isinstance(rid, str) and len(rid) <= 128 else None))

    def check_open(self) -> None:
        """Raise CancelledError in a task resuming after this socket closed: on Python
        3.11 asyncio.wait_for returns a result that arrived with its cancel instead of
        raising, and a request started then would be admitted on a gone socket, in
        flight for its key for ever."""
        if self.closing:
            raise asyncio.CancelledError

    async def _watchdog(self) -> None:
        """A send blocked past the timeout means the client is not reading: abort its
        requests (their frames, with a slow_consumer error, go out if it ever reads)."""
        timeout = self.limits.slow_consumer_timeout
        while True:
            await asyncio.sleep(min(timeout / 4, 1.0))
            self.streams.expire_recent()  # (an idle socket's too)
            since = self.sender.blocked_since
            if since is not None and time.monotonic() - since > timeout:
                self.streams.fail_all(ProtocolError(
                    "slow_consumer", "the client is not reading its stream"))

    # -- the receive side --------------------------------------------------------------------

    async def _reader(self) -> None:
        while True:
            if not self.sender.caught_up.is_set():
                await self.sender.caught_up.wait()
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
            if data is not None:
                self._receive(data)

    def _receive(self, data: bytes | str) -> None:
        """One client message: decoded and handled; a bad one is answered, the socket
        stays open."""
        if self._over_limit(data):
            self.error(self._too_big(data))  # the socket stays open, as for any bad message
            return
        msg = None
        try:
            msg = self.codec.decode(data)
            self._handle(msg)
        except ProtocolError as e:
            self.error(e)
        except Exception as e:  # noqa: BLE001 - one frame's fault: answered, socket stays
            self.internal(e, msg)

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
        return None if self.streams.live else self.limits.idle_timeout

    def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "generate":
            self.admission.generate(msg)
        elif kind == "cancel":
            self._cancel(request_id(msg))
        elif kind == "ping":
            self.frame({"type": "pong", "t": msg.get("t")})
        elif kind == "warm":
            self._warm(msg)
        elif kind == "resume":
            self.resumer.resume(msg)
        else:
            raise ProtocolError("invalid_request", f"unknown message type {kind!r}",
                                msg.get("id") if isinstance(msg.get("id"), str) else None)

    def _cancel(self, rid: str) -> None:
        """Abort a request in flight on this socket; its done (cancelled) follows.

        An id not in flight here answers `unknown_id`: never generated on this socket
        (a warm, another socket's, parked by a dropped one), or finished. A finished one
        leaves `streams.live` when its done frame is built, and that frame is written or
        queued ahead of this error: the client sees done, then unknown_id. One that the
        engine finished but whose done is not built yet is still here: the abort is a
        no-op and its done tells how it really ended."""
        live = self.streams.live.get(rid)
        if live is None:
            raise ProtocolError("unknown_id", f"no request {rid!r} is in flight on this socket",
                                rid)
        self.engine.abort(live.stream.request_id)

    def _warm(self, msg: dict[str, Any]) -> None:
        w = parse_warm(msg)
        if len(self.streams.live) + len(self.warms) >= self.limits.max_inflight_per_connection:
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
            self.error(e)
            return
        self.frame({"type": "warmed", "id": rid, **res})

    # -- the close ------------------------------------------------------------------------------

    def _close(self) -> None:
        """Our side of the socket is done. If the client dropped, its unfinished
        requests are parked for a resume (blocks freed next step); otherwise, or past
        the limits, they are aborted (blocks freed next step)."""
        self.closing = True
        for t in (*self.warms, *self.admission.preparing.values(), *self.resumer.waiting):
            t.cancel()
        st = self.streams
        st.close()
        self.sender.discard()  # markers and frames for a gone socket
        keep = st.resumable() if self.dropped else {}
        refused = (self.gw.parked.park(self.session_id, self.principal.key, keep,
                                       self.gw.accepting) if keep else [])
        st.abort(refused if self.dropped else list(st.live.values()))
        st.clear()


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


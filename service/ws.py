"""WS /v1/ws: one session per socket, a reader task and a writer task, one pump task
per request in flight. Deltas are merged under backpressure (the engine's stream
merges what a blocked pump has not taken yet), never dropped."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from engine.outputs import RequestOutput
from service.gateway import Admission, Gateway, Principal
from service.protocol import (SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, Codec, ProtocolError,
                              parse_generate, request_id)

FINISH = {"stop": "stop", "length": "length", "abort": "cancelled", "error": "error"}
STATUS = {"stop": "completed", "length": "completed", "abort": "cancelled", "error": "failed"}


class Outbox:
    """Bounded per-socket send queue. Request pumps wait for room (so their streams
    merge deltas meanwhile); control frames (errors, pongs, done) always go in."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # (message, time its newest token was sampled or None)
        self.items: asyncio.Queue[tuple[dict[str, Any], float | None] | None] = asyncio.Queue()
        self._room = asyncio.Event()
        self._room.set()

    async def put(self, msg: dict[str, Any], timeout: float,
                  sampled_at: float | None = None) -> None:
        while self.items.qsize() >= self.limit:
            self._room.clear()
            await asyncio.wait_for(self._room.wait(), timeout)
        self.items.put_nowait((msg, sampled_at))

    def force(self, msg: dict[str, Any] | None) -> None:
        self.items.put_nowait(None if msg is None else (msg, None))

    async def get(self) -> tuple[dict[str, Any], float | None] | None:
        msg = await self.items.get()
        if self.items.qsize() < self.limit:
            self._room.set()
        return msg


class Session:
    def __init__(self, ws: WebSocket, codec: Codec, gateway: Gateway, principal: Principal) -> None:
        self.ws, self.codec, self.gw, self.principal = ws, codec, gateway, principal
        self.limits = gateway.config.limits
        self.outbox = Outbox(self.limits.send_queue)
        self.pumps: dict[str, asyncio.Task[None]] = {}
        self.engine_ids: dict[str, str] = {}
        self.session_id = uuid.uuid4().hex

    async def run(self) -> None:
        writer = asyncio.create_task(self._writer())
        self.outbox.force({"type": "ready", "session_id": self.session_id,
                           "protocol": self.codec.subprotocol, "model": self.gw.config.model_name,
                           "limits": self._limits()})
        try:
            await self._reader()
        finally:
            await self._close_all()
            self.outbox.force(None)
            with contextlib.suppress(Exception):
                await writer

    def _limits(self) -> dict[str, Any]:
        lim = self.limits
        return {"max_inflight": lim.max_inflight_per_connection,
                "max_message_bytes": lim.max_message_bytes,
                "max_model_len": self.gw.engine.engine.max_model_len}

    async def _writer(self) -> None:
        delivery = self.gw.metrics.delivery
        while (item := await self.outbox.get()) is not None:
            msg, sampled_at = item
            data = self.codec.encode(msg)
            try:
                if isinstance(data, bytes):
                    await self.ws.send_bytes(data)
                else:
                    await self.ws.send_text(data)
            except (WebSocketDisconnect, RuntimeError, OSError):
                return
            if sampled_at:
                delivery.observe(time.monotonic() - sampled_at)

    async def _reader(self) -> None:
        while True:
            try:
                m = await asyncio.wait_for(self.ws.receive(), self._idle_timeout())
            except asyncio.TimeoutError:
                await self.ws.close(code=1000, reason="idle timeout")
                return
            if m["type"] == "websocket.disconnect":
                return
            data = m.get("bytes") if m.get("bytes") is not None else m.get("text")
            if data is None:
                continue
            if len(data) > self.limits.max_message_bytes:
                self._error(ProtocolError("message_too_big", "message exceeds the size limit"))
                await self.ws.close(code=1009, reason="message too big")
                return
            try:
                self._handle(self.codec.decode(data))
            except ProtocolError as e:
                self._error(e)

    def _idle_timeout(self) -> float | None:
        return None if self.pumps else self.limits.idle_timeout

    def _error(self, e: ProtocolError) -> None:
        self.gw.metrics.errors.labels(e.code).inc()
        self.outbox.force(e.frame())

    def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "generate":
            self._generate(msg)
        elif kind == "cancel":
            rid = request_id(msg)
            if rid in self.engine_ids:
                self.gw.engine.abort(self.engine_ids[rid])
        elif kind == "ping":
            self.outbox.force({"type": "pong", "t": msg.get("t")})
        else:
            raise ProtocolError("invalid_request", f"unknown message type {kind!r}",
                                msg.get("id") if isinstance(msg.get("id"), str) else None)

    def _generate(self, msg: dict[str, Any]) -> None:
        g = parse_generate(msg)
        if g.id in self.pumps:
            raise ProtocolError("duplicate_id", f"request {g.id!r} is already in flight", g.id)
        if len(self.pumps) >= self.limits.max_inflight_per_connection:
            raise ProtocolError("too_many_inflight", "too many requests in flight on this socket",
                                g.id)
        ahead = self.gw.queue_position()
        adm = self.gw.submit(self.principal, g.params, g.id, g.prompt, g.messages)
        if ahead is not None:
            self.outbox.force({"type": "queued", "id": g.id, "position": ahead})
        self.engine_ids[g.id] = adm.stream.request_id
        self.pumps[g.id] = asyncio.create_task(self._pump(g.id, adm, g.params.logprobs))

    async def _pump(self, rid: str, adm: Admission, logprobs: int | None) -> None:
        track = Timings(adm.arrival)
        last: RequestOutput | None = None
        reason = "error"
        try:
            last = await self._stream(rid, adm, track, logprobs is not None)
            reason = last.finish_reason or "error"
            if reason == "error":  # the engine failed this request (its thread died)
                self._error(ProtocolError("internal_error", last.error or "engine failure", rid))
        except asyncio.TimeoutError:
            self.gw.engine.abort(adm.stream.request_id)
            self._error(ProtocolError("slow_consumer", "the client is not reading its stream", rid))
        except asyncio.CancelledError:
            self.gw.engine.abort(adm.stream.request_id)
            reason = "abort"
            raise
        finally:
            self.pumps.pop(rid, None)
            self.engine_ids.pop(rid, None)
            self.gw.release(adm, reason)
            self.outbox.force(self._done(rid, adm, last, reason, track))

    async def _stream(self, rid: str, adm: Admission, track: Timings,
                      with_logprobs: bool) -> RequestOutput:
        out = None
        seq = 0
        timeout = self.limits.slow_consumer_timeout
        async for out in adm.stream:
            if track.first is None:
                await self.outbox.put(self._start(rid, out, adm.stream.queue_time), timeout)
            track.token(len(out.new_token_ids), self.gw.metrics)
            if out.new_token_ids or out.delta_text:
                seq += 1
                await self.outbox.put(self._delta(rid, seq, out, with_logprobs), timeout,
                                      adm.stream.sampled_at)
        assert out is not None
        return out

    @staticmethod
    def _start(rid: str, out: RequestOutput, queue_time: float) -> dict[str, Any]:
        return {"type": "start", "id": rid, "prompt_tokens": len(out.prompt_token_ids),
                "cached_tokens": {"device": out.num_cached_tokens, "host": 0},
                "queue_ms": round(queue_time * 1000, 3)}

    @staticmethod
    def _delta(rid: str, seq: int, out: RequestOutput, with_logprobs: bool) -> dict[str, Any]:
        d: dict[str, Any] = {"type": "delta", "id": rid, "seq": seq, "text": out.delta_text,
                             "token_ids": out.new_token_ids}
        if len(out.outputs) > 1:
            d["index"] = out.index
        if with_logprobs:
            lps = out.outputs[out.index].logprobs or []
            d["logprobs"] = [{"token_id": x.token_id, "logprob": x.logprob,
                              "top": [[t, v] for t, v in x.top]}
                             for x in lps[-len(out.new_token_ids):]] if out.new_token_ids else []
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
                      "cached_tokens": last.num_cached_tokens if last else 0},
            "timings": track.summary(completion, adm.stream.queue_time),
        }
        if last and len(last.outputs) > 1:
            done["finish_reasons"] = [FINISH.get(o.finish_reason or "error", "error")
                                      for o in last.outputs]
        return done

    async def _close_all(self) -> None:
        """The client left: abort everything it had in flight (blocks free next step)."""
        tasks = list(self.pumps.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


class Timings:
    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.first: float | None = None
        self.last = arrival

    def token(self, n: int, metrics: Any) -> None:
        now = time.monotonic()
        if n:
            if self.first is None:
                self.first = now
                metrics.ttft.observe(now - self.arrival)
            else:
                metrics.itl.observe(now - self.last)
            metrics.output_tokens.inc(n)
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
    origins = gw.config.allowed_origins
    if origins and ws.headers.get("origin") not in origins:
        await ws.close(code=1008, reason="origin not allowed")
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


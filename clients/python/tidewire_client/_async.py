"""The asyncio client: one WebSocket, any number of concurrent streams on it."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Set, Union, cast

import msgpack
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from tidewire_client._errors import (APIConnectionError, APITimeoutError, AuthenticationError,
                                     BadRequestError, TidewireError, error_from_frame)
from tidewire_client._types import (CachedTokens, Completion, DeltaEvent, DoneEvent, Event,
                                    StartEvent, WarmResult, parse_event, parse_output,
                                    wire_params)

Messages = Sequence[Dict[str, Any]]
PROTOCOLS = {"msgpack": "tidewire.v1.msgpack", "json": "tidewire.v1.json"}
AFFINITY_HEADER = "X-Tidewire-Affinity"  # the routing key a load balancer hashes
_END = object()  # queue item: the stream was abandoned or the client closed


class AsyncStream:
    """The events of one request: iterate it (`async for event in stream`), or take just
    the text (`stream.text_stream()`), or the whole result (`await stream.final()`).

    Leaving the loop early, `await stream.cancel()` or `stream.close()` cancels the
    request on the server. After the last event, `stream.done` holds the DoneEvent."""

    def __init__(self, client: AsyncClient, request_id: str,
                 request: Optional[Dict[str, Any]] = None) -> None:
        self.id = request_id
        self._client = client
        # what a resume needs on a server that never saw the request (another replica):
        # the generate's fields, and every token id received so far
        self._request = request
        self.received_token_ids: List[int] = []
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.start: Optional[StartEvent] = None
        self.done: Optional[DoneEvent] = None
        self._finished = False
        self._texts: Dict[int, List[str]] = {}
        self._reasonings: Dict[int, List[str]] = {}
        self._tokens: Dict[int, List[int]] = {}
        self.last_seq = 0  # of the newest delta received: where a resume picks up

    def _push(self, item: Any) -> None:
        self._queue.put_nowait(item)

    async def next_event(self) -> Optional[Event]:
        """The next event, or None once the stream has ended. Raises the request's
        APIError, APIConnectionError if the socket dropped, APITimeoutError."""
        if self._finished:
            return None
        try:
            item = await asyncio.wait_for(self._queue.get(), self._client.timeout)
        except asyncio.TimeoutError:
            self.close()
            raise APITimeoutError(f"no event for {self._client.timeout}s on {self.id!r}") from None
        if item is _END:
            self._finished = True
            return None
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        if isinstance(item, StartEvent):
            self.start = item
        elif isinstance(item, DeltaEvent):
            self._texts.setdefault(item.index, []).append(item.text)
            if item.reasoning:
                self._reasonings.setdefault(item.index, []).append(item.reasoning)
            self._tokens.setdefault(item.index, []).extend(item.token_ids)
        elif isinstance(item, DoneEvent):
            self.done = item
            self._finished = True
        return cast(Event, item)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        try:
            while (ev := await self.next_event()) is not None:
                yield ev
        finally:
            if not self._finished:  # the caller left the loop early
                self.close()

    async def text_stream(self) -> AsyncIterator[str]:
        """Only the text of each delta, as it arrives (a thinking model's answer,
        without its reasoning)."""
        async for ev in self:
            if isinstance(ev, DeltaEvent) and ev.text:
                yield ev.text

    async def final(self) -> Completion:
        """Read to the end and return the whole result."""
        while await self.next_event() is not None:
            pass
        assert self.done is not None
        n = max([*self._texts, *self._tokens, *self._reasonings, 0]) + 1
        return Completion(self.id, ["".join(self._texts.get(i, [])) for i in range(n)],
                          [self._tokens.get(i, []) for i in range(n)], self.done.status,
                          self.done.finish_reason, self.done.usage, self.done.timings,
                          self.start.cached_tokens if self.start else CachedTokens(),
                          self.done.tool_calls, self.done.content,
                          reasonings=["".join(self._reasonings.get(i, [])) for i in range(n)])

    async def cancel(self) -> None:
        """Ask the server to stop; the stream then ends with a `cancelled` DoneEvent."""
        if not self._finished:
            await self._client._send({"type": "cancel", "id": self.id})

    def close(self) -> None:
        """Stop listening and cancel the request (no more events are delivered)."""
        if not self._finished:
            self._finished = True
            self._client._abandon(self.id)

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class _Namespace:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client


class AsyncChat(_Namespace):
    async def stream(self, messages: Messages, *, request_id: Optional[str] = None,
                     **params: Any) -> AsyncStream:
        """Start a chat completion; `params` are sampling parameters (max_tokens,
        temperature, top_p, top_k, stop, seed, n, logprobs, ...) and the chat's own
        (tools, enable_thinking, chat_template_kwargs, max_reasoning_tokens, ...)."""
        return await self._client._generate({"messages": list(messages)}, params, request_id)

    async def create(self, messages: Messages, **params: Any) -> Completion:
        """A chat completion, whole."""
        return await (await self.stream(messages, **params)).final()

    async def parse(self, messages: Messages, *, response_format: Any,
                    **params: Any) -> Completion:
        """create() constrained to `response_format` (a Pydantic model class, or a
        response_format object of type json_schema or json_object),
        with the output read into `.parsed`: the model's instance, or the JSON value.
        Raises IncompleteOutputError when the output was cut off."""
        c = await self.create(messages, response_format=response_format, **params)
        c.parsed = parse_output(response_format, c)
        return c


class AsyncCompletions(_Namespace):
    async def stream(self, prompt: Union[str, List[int]], *, request_id: Optional[str] = None,
                     **params: Any) -> AsyncStream:
        """Start a completion of a text prompt (or a list of token ids)."""
        body = {"prompt_token_ids": list(prompt)} if isinstance(prompt, list) else {"prompt": prompt}
        return await self._client._generate(body, params, request_id)

    async def create(self, prompt: Union[str, List[int]], **params: Any) -> Completion:
        """A completion, whole."""
        return await (await self.stream(prompt, **params)).final()


class AsyncClient:
    """A Tidewire client on one WebSocket.

    `url`: `ws://host:port/v1/ws`; `api_key`: sent as `Authorization: Bearer`;
    `protocol`: "msgpack" (default) or "json"; `timeout`: seconds to wait for any event
    of a stream; `max_retries`: reconnect attempts (with exponential backoff) when a
    new request finds the socket closed. The socket opens on first use (or `connect()`).

    `resume` (default on): when the socket drops (not by `close()`) while streams are in
    flight and the server offers resume, the client reconnects and resumes each of them
    where it stopped; they see no gap and no duplicate. Each resume carries its request
    and the token ids received, so a server that never ran it (another replica behind a
    load balancer, or one restarted) continues it. Otherwise, or if that fails, streams
    in flight raise APIConnectionError.

    `affinity`: the routing key sent as the `X-Tidewire-Affinity` header on every
    connect, for a load balancer to hash (same key, same replica: its prefix cache is
    warm). Default: one random key per client, kept across reconnects; give a
    conversation or user id to keep one conversation on one replica across clients."""

    def __init__(self, url: str, api_key: Optional[str] = None, protocol: str = "msgpack",
                 timeout: float = 60.0, connect_timeout: float = 10.0,
                 max_retries: int = 3, resume: bool = True,
                 affinity: Optional[str] = None) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError("protocol must be 'msgpack' or 'json'")
        self.affinity = affinity or uuid.uuid4().hex
        self.url, self.api_key, self.protocol = url, api_key, protocol
        self.timeout, self.connect_timeout, self.max_retries = timeout, connect_timeout, max_retries
        self.resume = resume
        self._closing = False
        self.chat = AsyncChat(self)
        self.completions = AsyncCompletions(self)
        self.ready: Optional[Dict[str, Any]] = None  # the server's `ready` frame
        self._ws: Optional[ClientConnection] = None
        self._reader: Optional[asyncio.Task[None]] = None
        self._streams: Dict[str, AsyncStream] = {}
        self._waiters: Dict[str, asyncio.Future[Any]] = {}  # warm / ping replies by id
        self._tasks: Set[asyncio.Task[Any]] = set()
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:8]

    # -- connection ------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._ws is not None and self._reader is not None and not self._reader.done()

    async def connect(self) -> None:
        """Open the socket (retrying with backoff) and read the server's `ready`."""
        async with self._lock:
            if self.connected:
                return
            delay = 0.25
            for attempt in range(self.max_retries + 1):
                try:
                    await self._open()
                    return
                except (OSError, asyncio.TimeoutError, InvalidHandshake, ConnectionClosed) as e:
                    if isinstance(e, InvalidStatus) and e.response.status_code in (401, 403):
                        raise AuthenticationError("unauthorized", "the server refused the API "
                                                  "key (or the origin)") from None
                    if attempt == self.max_retries:
                        raise APIConnectionError(f"cannot connect to {self.url}: {e}") from e
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 4.0)

    async def _open(self) -> None:
        headers = {AFFINITY_HEADER: self.affinity}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        ws = await connect(self.url, subprotocols=[PROTOCOLS[self.protocol]],  # type: ignore[list-item]
                           additional_headers=headers, open_timeout=self.connect_timeout,
                           max_size=None, compression=None)
        try:
            first = self._decode(await asyncio.wait_for(ws.recv(), self.connect_timeout))
        except BaseException:
            await ws.close()
            raise
        if first.get("type") != "ready":
            await ws.close()
            raise APIConnectionError(f"expected a ready frame, got {first!r}")
        self.ready, self._ws, self._closing = first, ws, False
        self._reader = asyncio.create_task(self._read(ws))

    async def close(self) -> None:
        """Close the socket; streams still open end with APIConnectionError."""
        self._closing = True
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- frames ----------------------------------------------------------------------------

    def _encode(self, frame: Dict[str, Any]) -> Union[bytes, str]:
        return msgpack.packb(frame) if self.protocol == "msgpack" else json.dumps(frame)

    def _decode(self, data: Union[bytes, str]) -> Dict[str, Any]:
        if self.protocol == "msgpack":
            return cast(Dict[str, Any], msgpack.unpackb(data))
        return cast(Dict[str, Any], json.loads(data))

    async def _send(self, frame: Dict[str, Any]) -> None:
        ws = self._ws
        if ws is None:
            raise APIConnectionError("not connected")
        try:
            await ws.send(self._encode(frame))
        except ConnectionClosed as e:
            raise APIConnectionError(f"connection lost: {e}") from e

    async def _read(self, ws: ClientConnection) -> None:
        reason: BaseException = APIConnectionError("connection closed")
        dropped = False
        try:
            async for data in ws:
                self._route(self._decode(data))
        except ConnectionClosed as e:
            reason, dropped = APIConnectionError(f"connection lost: {e}"), True
        finally:
            if self._ws is ws:
                self._ws = None
            ready = self.ready or {}
            if (dropped and self.resume and self._streams and not self._closing
                    and "resume" in ready.get("features", ())):
                task = asyncio.ensure_future(self._recover(dict(self._streams),
                                                           ready["session_id"], reason))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                for s in self._streams.values():
                    s._push(reason)
            self._streams.clear()
            for f in self._waiters.values():
                if not f.done():
                    f.set_exception(reason)
            self._waiters.clear()

    async def _recover(self, streams: Dict[str, AsyncStream], session_id: str,
                       reason: BaseException) -> None:
        """Reconnect and resume the streams the dropped socket carried; each goes on
        from the last delta it received (the server parked them meanwhile)."""
        try:
            await self.connect()
            for rid, stream in streams.items():
                if stream._finished:
                    continue  # closed by its reader meanwhile: the server lets it expire
                self._streams[rid] = stream
                frame = {"type": "resume", "id": rid, "after_seq": stream.last_seq,
                         "session_id": session_id}
                if stream._request is not None:
                    frame.update(request=stream._request,
                                 token_ids=list(stream.received_token_ids))
                await self._send(frame)
        except TidewireError as e:
            for rid, stream in streams.items():
                if self._streams.get(rid, stream) is stream:
                    self._streams.pop(rid, None)
                    stream._push(e if isinstance(e, APIConnectionError) else reason)

    def _route(self, frame: Dict[str, Any]) -> None:
        kind, rid = frame.get("type"), frame.get("id")
        if kind in ("queued", "start", "delta", "done"):
            stream = self._streams.get(rid)  # type: ignore[arg-type]
            if stream is not None:
                if kind == "delta":
                    stream.last_seq = frame["seq"]
                    stream.received_token_ids.extend(frame.get("token_ids", ()))
                stream._push(parse_event(frame))
                if kind == "done":
                    del self._streams[rid]  # type: ignore[arg-type]
        elif kind == "error":
            err = error_from_frame(frame)
            if rid in self._streams:
                self._streams.pop(rid)._push(err)
            elif rid in self._waiters:
                self._waiters.pop(rid).set_exception(err)
        elif kind in ("warmed", "pong"):
            key = rid if kind == "warmed" else f"ping:{frame.get('t')}"
            fut = self._waiters.pop(key, None)  # type: ignore[arg-type]
            if fut is not None and not fut.done():
                fut.set_result(frame)
        elif kind == "resumed":
            pass  # _recover registered the stream again; the missed deltas follow

    def _abandon(self, rid: str) -> None:
        """Forget a stream and cancel it on the server (callable without awaiting)."""
        if self._streams.pop(rid, None) is not None and self._ws is not None:
            task = asyncio.ensure_future(self._send({"type": "cancel", "id": rid}))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    # -- requests --------------------------------------------------------------------------

    async def _generate(self, body: Dict[str, Any], params: Dict[str, Any],
                        request_id: Optional[str]) -> AsyncStream:
        await self.connect()
        rid = request_id or self._new_id()
        if rid in self._streams:
            raise BadRequestError("duplicate_id", f"request {rid!r} is already in flight")
        request = {**body, "params": wire_params(params)}
        # only a single-sample request without tools can continue on a server that never
        # saw it; others resume only where they ran
        portable = request["params"].get("n", 1) == 1 and not request["params"].get("tools")
        stream = AsyncStream(self, rid, request if portable else None)
        self._streams[rid] = stream
        try:
            await self._send({"type": "generate", "id": rid, **request})
        except TidewireError:
            self._streams.pop(rid, None)
            raise
        return stream

    async def _request(self, key: str, frame: Dict[str, Any]) -> Dict[str, Any]:
        await self.connect()
        fut = asyncio.get_running_loop().create_future()
        self._waiters[key] = fut
        try:
            await self._send(frame)
            return await asyncio.wait_for(fut, self.timeout)
        except asyncio.TimeoutError:
            raise APITimeoutError(f"no reply to {frame['type']} in {self.timeout}s") from None
        finally:
            self._waiters.pop(key, None)

    async def warm(self, messages: Optional[Messages] = None,
                   prompt: Union[str, List[int], None] = None) -> WarmResult:
        """Prefill a prefix (a conversation so far, or a prompt) into the server's
        cache without generating, so that the next request starting with it is fast."""
        if (messages is None) == (prompt is None):
            raise ValueError("give exactly one of messages or prompt")
        rid = self._new_id()
        body: Dict[str, Any] = ({"messages": list(messages)} if messages is not None else
                                {"prompt_token_ids": list(prompt)} if isinstance(prompt, list)
                                else {"prompt": prompt})
        r = await self._request(rid, {"type": "warm", "id": rid, **body})
        return WarmResult(int(r["prompt_tokens"]), int(r["cached_tokens"]),
                          CachedTokens.parse(r.get("reused_tokens")))

    async def ping(self) -> float:
        """Round-trip time of a ping, in seconds."""
        t = time.monotonic()
        await self._request(f"ping:{t}", {"type": "ping", "t": t})
        return time.monotonic() - t

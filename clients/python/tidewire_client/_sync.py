"""The blocking client: the asyncio client on a private event-loop thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine, Dict, Iterator, List, Optional, TypeVar, Union

from tidewire_client._async import AsyncClient, AsyncStream, Messages
from tidewire_client._types import Completion, DeltaEvent, Event, WarmResult, parse_output

T = TypeVar("T")


class Stream:
    """A blocking stream: `for event in stream`, `stream.text_stream()`, `stream.final()`.
    Leaving the loop early (or `stream.cancel()` / `stream.close()`) cancels the request."""

    def __init__(self, client: Client, inner: AsyncStream) -> None:
        self._client, self._inner = client, inner

    @property
    def id(self) -> str:
        return self._inner.id

    @property
    def done(self) -> Any:
        return self._inner.done

    @property
    def start(self) -> Any:
        return self._inner.start

    def __iter__(self) -> Iterator[Event]:
        try:
            while (ev := self._client._run(self._inner.next_event())) is not None:
                yield ev
        finally:
            if self._inner.done is None:
                self.close()

    def text_stream(self) -> Iterator[str]:
        for ev in self:
            if isinstance(ev, DeltaEvent) and ev.text:
                yield ev.text

    def final(self) -> Completion:
        return self._client._run(self._inner.final())

    def cancel(self) -> None:
        self._client._run(self._inner.cancel())

    def close(self) -> None:
        self._client._loop.call_soon_threadsafe(self._inner.close)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Chat:
    def __init__(self, client: Client) -> None:
        self._c = client

    def stream(self, messages: Messages, **params: Any) -> Stream:
        """Start a chat completion (see AsyncClient.chat.stream)."""
        return Stream(self._c, self._c._run(self._c._async.chat.stream(messages, **params)))

    def create(self, messages: Messages, **params: Any) -> Completion:
        return self.stream(messages, **params).final()

    def parse(self, messages: Messages, *, response_format: Any, **params: Any) -> Completion:
        """create() constrained to `response_format`, read into `.parsed` (see
        AsyncClient.chat.parse)."""
        c = self.create(messages, response_format=response_format, **params)
        c.parsed = parse_output(response_format, c)
        return c


class _Completions:
    def __init__(self, client: Client) -> None:
        self._c = client

    def stream(self, prompt: Union[str, List[int]], **params: Any) -> Stream:
        """Start a completion (see AsyncClient.completions.stream)."""
        return Stream(self._c, self._c._run(self._c._async.completions.stream(prompt, **params)))

    def create(self, prompt: Union[str, List[int]], **params: Any) -> Completion:
        return self.stream(prompt, **params).final()


class Client:
    """Blocking Tidewire client for plain scripts; same arguments as AsyncClient.
    Thread-safe: many threads may run streams on the one socket at once."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tidewire-client",
                                        daemon=True)
        self._thread.start()

        async def make() -> AsyncClient:
            return AsyncClient(url, **kwargs)

        self._async = self._run(make())
        self.chat = _Chat(self)
        self.completions = _Completions(self)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def ready(self) -> Optional[Dict[str, Any]]:
        return self._async.ready

    def connect(self) -> None:
        self._run(self._async.connect())

    def warm(self, messages: Optional[Messages] = None,
             prompt: Union[str, List[int], None] = None) -> WarmResult:
        return self._run(self._async.warm(messages, prompt))

    def ping(self) -> float:
        return self._run(self._async.ping())

    def close(self) -> None:
        """Close the socket and stop the loop thread."""
        if self._thread.is_alive():
            self._run(self._async.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

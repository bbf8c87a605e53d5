"""Python SDK for Tidewire's WebSocket streaming protocol (tidewire.v1).

`AsyncClient` (asyncio) and `Client` (blocking) share one socket among any number of
concurrent streams; `client.chat.stream(...)` / `client.completions.stream(...)` return
streams of typed events, `create(...)` the whole result. `tidewire_client.sse` streams
the OpenAI-compatible HTTP endpoints and picks a dropped stream up again."""

from tidewire_client._async import AsyncClient, AsyncStream
from tidewire_client._errors import (APIConnectionError, APIError, APITimeoutError,
                                     AuthenticationError, BadRequestError,
                                     IncompleteOutputError, InternalServerError,
                                     NotFoundError, OverloadedError, RateLimitError,
                                     SlowConsumerError, TidewireError)
from tidewire_client._sync import Client, Stream
from tidewire_client._types import (CachedTokens, Completion, DeltaEvent, DoneEvent, Event,
                                    QueuedEvent, StartEvent, Timings, Usage, WarmResult)

__all__ = ["APIConnectionError", "APIError", "APITimeoutError", "AsyncClient", "AsyncStream",
           "AuthenticationError", "BadRequestError", "CachedTokens", "Client", "Completion",
           "DeltaEvent", "DoneEvent", "Event", "IncompleteOutputError", "InternalServerError",
           "NotFoundError",
           "OverloadedError", "QueuedEvent", "RateLimitError", "SlowConsumerError",
           "StartEvent", "Stream", "TidewireError", "Timings", "Usage", "WarmResult"]

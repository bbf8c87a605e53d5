"""Exceptions, mapped from the protocol's stable error codes."""

from __future__ import annotations

from typing import Any, Dict, Optional


class TidewireError(Exception):
    """Base class of every error this SDK raises."""


class APIError(TidewireError):
    """The server answered with an `error` frame.

    Attributes: `code` (the protocol's error code), `message`, `retryable` (whether the
    same request may succeed later), `request_id` (the stream's id, if any)."""

    def __init__(self, code: str, message: str, retryable: bool = False,
                 request_id: Optional[str] = None, retry_after: Optional[float] = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.retryable, self.request_id = (code, message, retryable,
                                                                    request_id)
        self.retry_after = retry_after


class AuthenticationError(APIError):
    """Missing or wrong API key (`unauthorized`, or the handshake was refused)."""


class BadRequestError(APIError):
    """The request is invalid as sent: `invalid_request`, `duplicate_id`,
    `context_length_exceeded`, `message_too_big`, `unknown_id` (a cancel of an id that
    is not in flight)."""


class NotFoundError(BadRequestError):
    """`model_not_found`."""


class RateLimitError(APIError):
    """Too many requests in flight on this socket or API key (`too_many_inflight`), or the
    key used its tokens a minute (`rate_limited`; `retry_after` says for how long, in
    seconds)."""


class OverloadedError(RateLimitError):
    """The server's queue is full or it is shutting down (`overloaded`); retry later."""


class SlowConsumerError(APIError):
    """The server gave up on a stream this client did not read fast enough."""


class InternalServerError(APIError):
    """The server failed the request (`internal_error`)."""


class APIConnectionError(TidewireError):
    """The socket could not be opened or was lost while a stream was in flight."""


class APITimeoutError(APIConnectionError):
    """No event arrived within the client's timeout."""


_BY_CODE = {
    "unauthorized": AuthenticationError,
    "invalid_request": BadRequestError,
    "duplicate_id": BadRequestError,
    "context_length_exceeded": BadRequestError,
    "message_too_big": BadRequestError,
    "model_not_found": NotFoundError,
    "too_many_inflight": RateLimitError,
    "rate_limited": RateLimitError,
    "overloaded": OverloadedError,
    "slow_consumer": SlowConsumerError,
    "internal_error": InternalServerError,
    "unknown_id": BadRequestError,
}


def error_from_frame(frame: Dict[str, Any]) -> APIError:
    """The exception for an `error {id?, code, message, retryable}` frame."""
    code = str(frame.get("code", "internal_error"))
    cls = _BY_CODE.get(code, APIError)
    retry_after = frame.get("retry_after")
    return cls(code, str(frame.get("message", "")), bool(frame.get("retryable", False)),
               frame.get("id"),
               float(retry_after) if isinstance(retry_after, (int, float)) else None)


class IncompleteOutputError(TidewireError):
    """`parse()` got an output that did not end by itself (e.g. cut off at max_tokens),
    so it is not a whole value; `completion` holds what came."""

    def __init__(self, message: str, completion: object) -> None:
        super().__init__(message)
        self.completion = completion

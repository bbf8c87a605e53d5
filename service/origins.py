"""Which browser origins may use the API: ServiceConfig.allowed_origins, for the WebSocket
handshake (service.session) and HTTP CORS alike.

The check applies only to requests that carry an Origin header. Browsers always send one
on a WebSocket handshake and on cross-origin fetches, and it is what a hostile page
cannot forge; SDKs, curl and server-side clients send none, and API keys are the
control for them, so a request without Origin is never refused here.

allowed_origins:
  ()              same-origin only: an Origin whose host[:port] is the request's Host
  ("*",)          any origin
  (origins...)    those (scheme://host[:port], compared exactly up to case, a trailing
                  slash and a default port), plus same-origin

Behind a proxy that rewrites Host, same-origin cannot be told: list the public origin."""

from __future__ import annotations

from urllib.parse import urlsplit

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a request with this Origin header (None: none sent) and Host header may
    go on under the allow-list `allowed`."""
    if origin is None or "*" in allowed:
        return True
    key = _origin_key(origin)
    if key is None:  # "null" (sandboxed frames, file:) or garbage: only if listed as is
        return origin in allowed
    if host is not None and key[1:] == _host_key(host, key[0]):
        return True
    return any(_origin_key(a) == key for a in allowed)


def _origin_key(origin: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) with the default port filled in; None if not a URL origin."""
    try:
        u = urlsplit(origin.strip().rstrip("/").lower())
        port = u.port
    except ValueError:  # a malformed port or IPv6 literal
        return None
    if not u.scheme or not u.hostname or u.path or u.query or u.fragment:
        return None
    port = port if port is not None else _DEFAULT_PORTS.get(u.scheme)
    return None if port is None else (u.scheme, u.hostname, port)


def _host_key(host: str, scheme: str) -> tuple[str, int] | None:
    """(host, port) of a Host header; a missing port is the Origin scheme's default, as
    a browser omits it from both."""
    try:
        u = urlsplit("//" + host.strip().lower())
        port = u.port
    except ValueError:
        return None
    if not u.hostname:
        return None
    return u.hostname, port if port is not None else _DEFAULT_PORTS.get(scheme, 0)

"""The server's API keys: which key, and so which tenant, a request's Authorization
header or browser subprotocol presents."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping, Sequence

from service.protocol import AUTH_PREFIX, ProtocolError


class ApiKeys:
    """The accepted keys, each with its tenant (ServiceConfig.api_keys)."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        # by their SHA-256: a presented key is looked up by its digest, so how long a
        # lookup takes says nothing about the keys' characters
        self._keys = {_digest(k): (k, tenant) for k, tenant in keys.items()}

    def find(self, authorization: str | None, subprotocols: Sequence[str] = ()) -> tuple[str, str]:
        """(key, tenant) of the Bearer header's key, or of the subprotocol
        tidewire.auth.<base64url key> (which wins); ProtocolError unauthorized if the
        key is missing or not one of these."""
        key = None
        if authorization and authorization.lower().startswith("bearer "):
            key = authorization[7:].strip()
        for sp in subprotocols:
            if sp.startswith(AUTH_PREFIX):
                key = _b64url(sp[len(AUTH_PREFIX):]) or key
        found = self._keys.get(_digest(key or ""))
        # (compare_digest as well: equal digests of unequal keys are not a concern in
        # practice, but the comparison costs the same either way)
        if key is None or found is None or not hmac.compare_digest(found[0].encode(),
                                                                   key.encode()):
            raise ProtocolError("unauthorized", "missing or invalid API key")
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _b64url(text: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None

"""service/keys.py: which key (and tenant) a Bearer header or a browser subprotocol
presents."""

from __future__ import annotations

import base64

import pytest

from service.keys import ApiKeys
from service.protocol import AUTH_PREFIX, ProtocolError

KEYS = ApiKeys({"ka": "tenant-a", "kb": "tenant-b"})


def sub(key: str) -> str:
    return AUTH_PREFIX + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def test_a_bearer_header_names_its_key_and_tenant() -> None:
    assert KEYS.find("Bearer ka") == ("ka", "tenant-a")
    assert KEYS.find("bearer   kb  ") == ("kb", "tenant-b")


def test_the_subprotocol_key_wins_over_the_header() -> None:
    assert KEYS.find("Bearer ka", [sub("kb")]) == ("kb", "tenant-b")
    assert KEYS.find(None, ["chat", sub("ka")]) == ("ka", "tenant-a")
    # one that does not decode leaves the header's key
    assert KEYS.find("Bearer ka", [AUTH_PREFIX + "%%%"]) == ("ka", "tenant-a")


@pytest.mark.parametrize("authorization, subprotocols", [
    (None, []), ("Bearer", []), ("Bearer kc", []), ("Basic ka", []), ("Bearer KA", []),
    (None, [sub("kc")]), (None, ["ka"])])
def test_a_missing_or_unknown_key_is_unauthorized(authorization: str | None,
                                                  subprotocols: list[str]) -> None:
    with pytest.raises(ProtocolError) as e:
        KEYS.find(authorization, subprotocols)
    assert e.value.code == "unauthorized"

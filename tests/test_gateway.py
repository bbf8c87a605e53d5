"""service.gateway on its own: the tenant salt that seeds the prefix-cache hash chain,
with and without the kv tier secret."""

from __future__ import annotations

import hashlib
import hmac
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engine.config import EngineConfig, TierConfig
from service.config import ServiceConfig
from service.gateway import Gateway, Principal
from service.metrics import Metrics
from tests.conftest import run_side_by_side

ROOT = Path(__file__).resolve().parents[1]
SECRET = "replicas-share-this"
KEYS = {"ka": "tenant-a", "kb": "tenant-b"}


def gateway(secret: str = "", api_keys: dict[str, str] | None = None) -> Gateway:
    config = ServiceConfig(engine=EngineConfig(tier=TierConfig(secret=secret)),
                           api_keys=api_keys or {}, sampling_defaults="none")
    engine: Any = SimpleNamespace()  # authenticate never reaches the engine
    return Gateway(config, engine, Metrics())


def salts(secret: str) -> dict[str, bytes]:
    """The salt of the open server's caller ("") and of each keyed tenant."""
    keyed = gateway(secret, KEYS)
    return {"": gateway(secret).authenticate(None).salt,
            **{t: keyed.authenticate(f"Bearer {k}").salt for k, t in KEYS.items()}}


def expected(secret: str, tenant: str) -> bytes:
    """The derivation spelled out: replicas of different versions must agree on it."""
    salt_key = hmac.new(secret.encode(), b"tidewire.tenant", hashlib.sha256).digest()
    return hmac.new(salt_key, b"tenant:" + tenant.encode(), hashlib.sha256).digest()


def test_salts_are_keyed_by_the_secret_per_tenant_and_unchanged_without_one() -> None:
    plain, keyed, other = salts(""), salts(SECRET), salts("another secret")
    # without a secret: exactly the salts of servers that predate it
    assert plain == {"": b"", **{t: hashlib.sha256(b"tidewire.tenant:" + t.encode()).digest()
                                 for t in KEYS.values()}}
    # with one: an HMAC for every tenant, the open server's "" included
    assert keyed == {t: expected(SECRET, t) for t in ("", *KEYS.values())}
    assert len({*plain.values(), *keyed.values(), *other.values()}) == 9
    # the salt key is not the blocks' MAC key, nor the secret itself
    tier = TierConfig(secret=SECRET)
    assert len({tier.salt_key, tier.mac_key, SECRET.encode()}) == 3
    assert SECRET not in repr(Principal("ka", "tenant-a", tier.salt_key)) + repr(tier)


def test_salts_with_a_secret_are_stable_across_processes() -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]);"
            "from engine.config import TierConfig; from service.gateway import Principal;"
            "print(Principal(None, 'tenant-a', TierConfig(secret=sys.argv[2]).salt_key)"
            ".salt.hex())")
    outs = run_side_by_side([([sys.executable, "-c", code, str(ROOT), SECRET],
                              {**os.environ, "PYTHONHASHSEED": seed}) for seed in ("1", "random")])
    assert [o.strip() for o in outs] == [salts(SECRET)["tenant-a"].hex()] * 2

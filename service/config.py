"""Service configuration: one frozen dataclass, filled from flags and TIDEWIRE_* env."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.config import EngineConfig


@dataclass(frozen=True)
class Limits:
    max_connections: int = 1024
    max_inflight_per_connection: int = 64
    # per API key, across sockets and HTTP; a policy for keyed deployments: an open
    # server (no api_keys) has one anonymous caller, whom it would cap as a whole
    max_inflight_per_key: int = 256
    # tokens (prompt + generated) one API key may use per minute, checked at admission
    # (service.ratelimit); 0 = no limit. Keyed servers only, as max_inflight_per_key.
    max_tokens_per_minute_per_key: int = 0
    # requests waiting in the engine before `overloaded`: room for one waiting request
    # from every connection the server accepts, twice over
    max_queue: int = 2048
    max_message_bytes: int = 1 << 20
    idle_timeout: float = 300.0  # seconds without a message or a request in flight
    slow_consumer_timeout: float = 30.0  # a stream blocked this long on a full socket
    send_queue: int = 256  # control frames queued on a socket before its reads pause
    # A dropped socket's unfinished requests are parked (out of the batch, blocks freed)
    # this long for a reconnect to `resume` them; 0 = a disconnect aborts them.
    resume_grace: float = 30.0
    max_detached: int = 1024  # requests parked server-wide; past it a disconnect aborts
    # of those, what one API key may hold (the parking space is shared between keys)
    max_detached_per_key: int = 256
    # sockets of one API key (keyed servers; max_connections bounds them all)
    max_connections_per_key: int = 256
    # response_format constraints of one API key compiling at once: each holds a grammar
    # worker, and a key must not fill the queue every other tenant's compile waits in
    max_compiles_per_key: int = 4


@dataclass(frozen=True)
class ServiceConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    model_name: str = "smollm2-135m"  # the id clients see in /v1/models and `ready`
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant; empty = open
    # browser origins, checked only on requests that send Origin (see service.origins):
    # empty = same-origin only, "*" = any, else these plus same-origin
    allowed_origins: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    shutdown_grace: float = 10.0
    # permessage-deflate: off by default, since deflating a delta of a few dozen bytes
    # cost ~55 us of the event loop per frame (most of a delta's delivery time)
    ws_compression: bool = False
    # "model": requests that leave sampling fields unset get the model's defaults
    # (generation_config.json, else the registry entry); "none": OpenAI's defaults
    sampling_defaults: str = "model"
    # set: GET /metrics needs `Authorization: Bearer <metrics_key>` (scrapers get their
    # own key, not a tenant's); empty: /metrics is open, as /health is
    metrics_key: str = ""
    # chat outputs split into reasoning and content (service.reasoning): "auto" when the
    # model's chat template mentions <think>, "think" always, "none" never
    reasoning_parser: str = "auto"

    def __post_init__(self) -> None:
        if self.sampling_defaults not in ("model", "none"):
            raise ValueError(f"sampling_defaults must be model or none, "
                             f"got {self.sampling_defaults!r}")
        if self.reasoning_parser not in ("auto", "none", "think"):
            raise ValueError(f"reasoning_parser must be auto, none or think, "
                             f"got {self.reasoning_parser!r}")

    @staticmethod
    def keys_from_env(value: str | None = None) -> dict[str, str]:
        """TIDEWIRE_API_KEYS="key1:tenantA,key2:tenantB" (a key alone is its own tenant)."""
        value = value if value is not None else os.environ.get("TIDEWIRE_API_KEYS", "")
        keys = {}
        for item in filter(None, (x.strip() for x in value.split(","))):
            key, _, tenant = item.partition(":")
            keys[key] = tenant or key
        return keys

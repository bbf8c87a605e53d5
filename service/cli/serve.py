"""`tidewire serve`: the WebSocket and OpenAI-compatible HTTP server, its flags and
the ServiceConfig they describe."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

from engine import runtime
from service.cli.engine_flags import engine_args, engine_config, kv_args, model_args
from service.cli.flags import env_arg

if TYPE_CHECKING:
    from service.config import ServiceConfig


def run(a: argparse.Namespace) -> int:
    from service.net import listen

    try:  # first, before the slow imports: a port in use is reported at once
        sock = listen(a.host, a.port)
    except OSError as e:
        print(f"tidewire: error: {e.strerror}", file=sys.stderr)
        return 2
    with sock:  # closed however the server ends (or fails to start)
        return _serve_on(sock, a)


def _configure_logging(level: str) -> None:
    """--log-level: Tidewire's own loggers at `level`; the root logger (the libraries')
    never below INFO, since their debug output carries request headers and frames."""
    n = logging.getLevelName(level.upper())
    logging.basicConfig(level=max(n, logging.INFO), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("tidewire").setLevel(n)


def _serve_on(sock: Any, a: argparse.Namespace) -> int:
    _configure_logging(a.log_level)
    logging.getLogger("tidewire").info("listening on http://%s:%d (loading the model)",
                                       a.host, a.port)
    from service.server import build_server

    runtime.tune_gil(a.switch_interval)
    config = service_config(a)
    # a dead engine ends the process (exit status 1), for its supervisor to restart it
    server = build_server(config, a.host, a.port, log_level=a.log_level,
                          exit_on_engine_death=True)
    server.run(sockets=[sock])
    return 1 if server.failed else 0


def service_config(a: argparse.Namespace) -> ServiceConfig:
    """The ServiceConfig that serve's flags describe (its TIDEWIRE_* variables are the
    flags' defaults)."""
    from service.config import Limits, ServiceConfig

    engine = engine_config(a)
    limits = Limits(max_connections=a.max_connections,
                    max_inflight_per_connection=a.max_inflight_per_connection,
                    max_inflight_per_key=a.max_inflight_per_key, max_queue=a.max_queue,
                    max_tokens_per_minute_per_key=a.max_tokens_per_minute_per_key,
                    max_message_bytes=a.max_message_bytes, idle_timeout=a.idle_timeout,
                    resume_grace=a.resume_grace, max_detached=a.max_detached,
                    max_detached_per_key=a.max_detached_per_key,
                    max_connections_per_key=a.max_connections_per_key,
                    max_compiles_per_key=a.max_compiles_per_key)
    return ServiceConfig(
        engine=engine, model_name=a.served_model_name or a.model,
        api_keys=ServiceConfig.keys_from_env(a.api_keys),
        allowed_origins=tuple(o for o in (a.allowed_origins or "").split(",") if o),
        limits=limits, ws_compression=a.ws_compression,
        sampling_defaults=a.sampling_defaults, metrics_key=a.metrics_key,
        shutdown_grace=a.shutdown_grace, reasoning_parser=a.reasoning_parser)


def add_args(p: argparse.ArgumentParser) -> None:
    _front_args(p)
    _engine_group(p)
    kv_args(p.add_argument_group("KV cache and host tier"))
    _limit_args(p)


def _front_args(p: argparse.ArgumentParser) -> None:
    """The model, network, security, logging and sampling groups."""
    m = p.add_argument_group("model")
    model_args(m)
    env_arg(m, "--served-model-name", "SERVED_MODEL_NAME", metavar="NAME",
            default_text="the --model value",
            help="the model id clients see in /v1/models and the WebSocket `ready` message")

    n = p.add_argument_group("network")
    env_arg(n, "--host", "HOST", default="127.0.0.1",
            help="interface to listen on (0.0.0.0: all)")
    env_arg(n, "--port", "PORT", type=int, default=8000, help="TCP port")
    env_arg(n, "--ws-compression", "WS_COMPRESSION", default=False, action="store_true",
            help="offer permessage-deflate on WebSockets (off: it costs ~50 us a frame for "
                 "deltas of a few dozen bytes)")

    s = p.add_argument_group("security")
    env_arg(s, "--api-keys", "API_KEYS", default="", metavar="KEY:TENANT,...", secret=True,
            help="accepted API keys, each with its tenant (tenants never share cached "
                 "prefixes; a key alone is its own tenant); none: open, for local use")
    env_arg(s, "--metrics-key", "METRICS_KEY", default="", metavar="KEY", secret=True,
            help="a key that GET /metrics then requires (Authorization: Bearer KEY), for "
                 "the scraper alone; none: /metrics is open, as /health is")
    env_arg(s, "--allowed-origins", "ALLOWED_ORIGINS", default="", metavar="ORIGIN,...",
            help="browser origins (scheme://host[:port]) allowed besides the server's own, "
                 "for WebSocket handshakes and CORS; *: any; none: same-origin only. "
                 "Requests without an Origin header (SDKs, curl) are not checked")

    lg = p.add_argument_group("logging")
    env_arg(lg, "--log-level", "LOG_LEVEL", default="info",
            choices=["debug", "info", "warning", "error"],
            help="info: start-up, load and access lines (query keys redacted); warning: "
                 "no access lines; debug: Tidewire's own debug lines too (the server "
                 "libraries stay at info: their debug output has headers and frames)")

    sm = p.add_argument_group("sampling")
    env_arg(sm, "--sampling-defaults", "SAMPLING_DEFAULTS", default="model",
            choices=["model", "none"],
            help="model: apply the model's default sampling parameters (generation_config.json "
                 "or the registry) to requests that leave them unset; none: OpenAI's defaults "
                 "(temperature 1, top_p 1)")
    env_arg(sm, "--reasoning-parser", "REASONING_PARSER", default="auto",
            choices=["auto", "none", "think"],
            help="split chat outputs into reasoning (<think>...</think>) and the answer: "
                 "reasoning_content over HTTP, `reasoning` in socket deltas; auto: when the "
                 "model's chat template mentions <think>; think: always; none: never (the "
                 "thinking stays in the text)")
    env_arg(sm, "--seed", "SEED", type=int, default=None, metavar="N",
            default_text="none, each unseeded request draws from OS entropy",
            help="seed for requests that set none (reproducible runs)")


def _engine_group(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("engine")
    engine_args(e)
    env_arg(e, "--no-async-output", "ASYNC_OUTPUT", dest="async_output", default=True,
            action="store_false",
            help="on a GPU, send each step's outputs before the next step starts rather than "
                 "once its decode graph is running (lower latency per delta, lower "
                 "throughput with many streams)")
    env_arg(e, "--switch-interval", "SWITCH_INTERVAL", type=float, default=runtime.SWITCH_INTERVAL,
            metavar="SECONDS",
            help="Python's GIL switch interval (sys.setswitchinterval): the engine thread "
                 "gives up the GIL in every torch op and must get it back at once; Python's "
                 "5 ms default lets the event loop hold it that long per op")


def _limit_args(p: argparse.ArgumentParser) -> None:
    lim = p.add_argument_group("service limits")
    env_arg(lim, "--max-connections", "MAX_CONNECTIONS", type=int, default=1024,
            help="open WebSocket connections; beyond it a new socket is closed with 1013 "
                 "(try again later) right after its handshake")
    env_arg(lim, "--max-connections-per-key", "MAX_CONNECTIONS_PER_KEY", type=int, default=256,
            help="open WebSocket connections of one API key (1013 beyond it); with "
                 "--api-keys only")
    env_arg(lim, "--max-inflight-per-connection", "MAX_INFLIGHT_PER_CONNECTION", type=int,
            default=64, help="unfinished requests one WebSocket connection may have")
    env_arg(lim, "--max-inflight-per-key", "MAX_INFLIGHT_PER_KEY", type=int, default=256,
            help="unfinished requests one API key may have (too_many_inflight beyond); "
                 "with --api-keys only: an open server's callers share no key")
    env_arg(lim, "--max-tokens-per-minute-per-key", "MAX_TOKENS_PER_MINUTE_PER_KEY", type=int,
            default=0, metavar="TOKENS",
            help="prompt + generated tokens one API key may use a minute (0: no limit); "
                 "checked at admission: beyond it `rate_limited` (HTTP 429 with Retry-After); "
                 "with --api-keys only")
    env_arg(lim, "--max-queue", "MAX_QUEUE", type=int, default=2048,
            help="requests waiting for the engine; beyond it new ones get `overloaded`")
    env_arg(lim, "--max-message-bytes", "MAX_MESSAGE_BYTES", type=int, default=1 << 20,
            metavar="BYTES", help="largest WebSocket message a client may send")
    env_arg(lim, "--idle-timeout", "IDLE_TIMEOUT", type=float, default=300.0,
            metavar="SECONDS",
            help="close a WebSocket without a message or a request in flight this long")
    env_arg(lim, "--resume-grace", "RESUME_GRACE", type=float, default=30.0,
            metavar="SECONDS",
            help="how long a disconnected socket's requests stay parked (blocks freed) for a "
                 "reconnect to resume them; 0: a disconnect aborts them")
    env_arg(lim, "--max-detached", "MAX_DETACHED", type=int, default=1024,
            help="requests parked for resume server-wide; beyond it a disconnect aborts")
    env_arg(lim, "--max-detached-per-key", "MAX_DETACHED_PER_KEY", type=int, default=256,
            help="of those, what one API key may hold (its further ones are aborted); with "
                 "--api-keys only")
    env_arg(lim, "--max-compiles-per-key", "MAX_COMPILES_PER_KEY", type=int, default=4,
            help="response_format constraints one API key may have compiling at once "
                 "(too_many_inflight beyond); with --api-keys only")
    env_arg(lim, "--shutdown-grace", "SHUTDOWN_GRACE", type=float, default=10.0,
            metavar="SECONDS",
            help="on SIGTERM or SIGINT: how long in-flight streams may go on finishing (no "
                 "new requests, /ready answers 503) before their sockets close with 1001")

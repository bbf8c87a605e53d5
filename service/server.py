"""uvicorn with a graceful drain and a direct writer of WebSocket data frames (the
protocol classes are in service/transport.py, the module that holds every private name
of the server libraries).

On shutdown: stop taking requests, let in-flight streams finish (up to the grace
period), close sockets with 1001, then let uvicorn close connections and run the
lifespan shutdown.

Also here, for every entry point that builds the server: the access log's redaction of
secret query parameters, the warning that an open server listens on a public address,
and (for `tidewire serve`) the exit once the engine has died."""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from urllib.parse import unquote_plus

import uvicorn

from service.app import create_app, drain
from service.config import Limits, ServiceConfig
from service.transport import FrameWriterProtocol

HARD_CAP_FACTOR = 4  # the protocol layer's message size cap, in max_message_bytes
log = logging.getLogger("tidewire.service")
# query parameters whose values are credentials (old chat-page links, clients that put a
# key in the URL): the access log shows them as ***
SECRET_QUERY_PARAMS = frozenset({"key", "api_key"})
# one name=value pair of a query string, as uvicorn logs it (raw, percent-encoded)
_QUERY_PARAM = re.compile(r'(^|&)([^&=\s"#]*)=([^&\s"#]*)')
# uvicorn's loggers that print a request's path with its query string: the access log,
# and the error log's "WebSocket /path?query" lines
URL_LOGGERS = ("uvicorn.access", "uvicorn.error")


def hard_message_cap(limits: Limits) -> int:
    """uvicorn's ws_max_size: past it websockets closes the socket with 1009. Messages
    between limits.max_message_bytes and this reach the app, which answers
    message_too_big and keeps the socket open; the cap bounds what one message makes
    the server buffer (and parse, to name its request)."""
    return HARD_CAP_FACTOR * limits.max_message_bytes


def redact_query(text: str) -> str:
    """`text` (a path with its query string) with the value of every parameter named in
    SECRET_QUERY_PARAMS replaced by `***`; other parameters are left as they are."""
    path, sep, query = text.partition("?")
    if not sep:
        return text
    return path + sep + _QUERY_PARAM.sub(_mask_secret, query)


def _mask_secret(m: re.Match[str]) -> str:
    name = m[2]
    return f"{m[1]}{name}=***" if unquote_plus(name).lower() in SECRET_QUERY_PARAMS else m[0]


class RedactQueryKeys(logging.Filter):
    """Redacts secret query parameters in a log record's string arguments (uvicorn
    passes the path with its query string as one) before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(a) if isinstance(a, str) else a
                                for a in record.args)
        return True


def install_log_redaction() -> None:
    """Put RedactQueryKeys on uvicorn's loggers, once. Call it after uvicorn.Config is
    built: that applies uvicorn's logging config (which keeps a logger's filters)."""
    for name in URL_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactQueryKeys) for f in logger.filters):
            logger.addFilter(RedactQueryKeys())


def is_loopback(host: str) -> bool:
    """Whether `host` (as --host takes it) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost, or "" (every interface)
        return False


def warn_if_open(config: ServiceConfig, host: str) -> None:
    if not config.api_keys and not is_loopback(host):
        log.warning("no --api-keys and listening on %s, not a loopback address: anyone who "
                    "can reach this port can use the model (set --api-keys, or --host "
                    "127.0.0.1)", host or "every interface")


class TidewireServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace: float,
                 exit_on_engine_death: bool = False) -> None:
        super().__init__(config)
        self.grace = grace
        self.exit_on_engine_death = exit_on_engine_death
        self.load_error: BaseException | None = None
        self.engine_error: BaseException | None = None

    @property
    def failed(self) -> bool:
        """The model did not load, or the engine died: the exit status says so."""
        return self.load_error is not None or self.engine_error is not None

    def load_failed(self, error: BaseException) -> None:
        """The model did not load: stop serving (the exit status says so)."""
        self.load_error = error
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's main loop calls this every 0.1 s. With `exit_on_engine_death`, a
        dead engine (AsyncEngine.dead, what /health reports as engine_dead) stops the
        server: a replica that refuses every request is better restarted by its
        supervisor (restart policy, Kubernetes) than left to answer 503."""
        if self.exit_on_engine_death and self.engine_error is None:
            engine = getattr(getattr(self.config.app, "state", None), "engine", None)
            dead = getattr(engine, "dead", None)
            if dead is not None:
                log.error("the engine died (%s): stopping the server, for its supervisor "
                          "to start it again", type(dead).__name__)
                self.engine_error, self.should_exit = dead, True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        gateway = getattr(getattr(self.config.app, "state", None), "gateway", None)
        if gateway is not None:
            await drain(gateway, self.grace)
        await super().shutdown(sockets)


def build_server(config: ServiceConfig, host: str, port: int, log_level: str = "info",
                 exit_on_engine_death: bool = False) -> TidewireServer:
    """The server for `config` on host:port. `log_level` is uvicorn's; below info it is
    info, since at debug the websockets library logs request headers (API keys) and
    frames (prompts). `exit_on_engine_death`: see TidewireServer.on_tick."""
    app = create_app(config)
    uv = uvicorn.Config(app, host=host, port=port, loop="uvloop", ws=FrameWriterProtocol,
                        ws_max_size=hard_message_cap(config.limits),
                        log_level=max(logging.INFO, uvicorn.config.LOG_LEVELS[log_level]),
                        ws_per_message_deflate=config.ws_compression,
                        timeout_graceful_shutdown=int(config.shutdown_grace) + 5)
    install_log_redaction()
    warn_if_open(config, host)
    server = TidewireServer(uv, config.shutdown_grace, exit_on_engine_death)
    app.state.on_load_failed = server.load_failed
    return server


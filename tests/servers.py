"""Run the real app under uvicorn on a free port, in a background thread."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import urllib.error
import urllib.request

import uvicorn

from bench.ws import free_port
from service.config import ServiceConfig
from service.server import build_server


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def scrape_metrics(url: str) -> dict[str, float]:
    """GET /metrics, parsed with prometheus_client's parser: sample name -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_get(url + "/metrics")
    assert status == 200
    return {s.name: s.value for fam in text_string_to_metric_families(body.decode())
            for s in fam.samples}


@dataclass
class RunningServer:
    url: str
    ws_url: str
    app: object
    server: uvicorn.Server

    @property
    def engine(self):  # noqa: ANN201 - engine.LLMEngine
        return self.app.state.gateway.engine.engine

    @property
    def gateway(self):  # noqa: ANN201
        return self.app.state.gateway


@contextlib.contextmanager
def run_server(config: ServiceConfig, log_level: str = "warning") -> Iterator[RunningServer]:
    """`log_level` "info" turns uvicorn's access log on."""
    port = free_port()
    server = build_server(config, "127.0.0.1", port, log_level=log_level)
    app = server.config.app
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and thread.is_alive():
        with contextlib.suppress(OSError):
            if http_get(url + "/ready")[0] == 200:
                break
        time.sleep(0.1)
    else:
        server.should_exit = True
        thread.join(timeout=30)
        raise RuntimeError(f"server did not become ready (load error: {server.load_error!r})")
    try:
        yield RunningServer(url, f"ws://127.0.0.1:{port}/v1/ws", app, server)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def one_socket_request(ws_url: str, timeout: float = 30.0) -> list[dict]:
    """A `generate` of a few tokens over a WebSocket (token ids: no tokenizer involved);
    the frames it got until its `done`, its refusal (an error before any start), or the
    server closing the socket."""
    import json

    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    frames: list[dict] = []
    with connect(ws_url, subprotocols=["tidewire.v1.json"]) as ws:
        assert json.loads(ws.recv(timeout))["type"] == "ready"
        ws.send(json.dumps({"type": "generate", "id": "r1", "prompt_token_ids": [5, 6, 7],
                            "params": {"max_tokens": 4}}))
        with contextlib.suppress(ConnectionClosed):
            while True:
                frames.append(json.loads(ws.recv(timeout)))
                kind = frames[-1]["type"]
                if kind == "done" or (kind == "error"
                                      and not any(f["type"] == "start" for f in frames)):
                    break
    return frames


def request_until(ws_url: str, done: Callable[[], bool], timeout: float = 60.0) -> int:
    """One socket request after another until done() (a faulty engine fails each one,
    and gives up after a few in a row); returns how many went through."""
    from websockets.exceptions import WebSocketException

    deadline, sent = time.monotonic() + timeout, 0
    while not done():
        assert time.monotonic() < deadline, f"not done after {sent} requests"
        try:
            one_socket_request(ws_url)
            sent += 1
        except (OSError, WebSocketException):  # the server is going away
            time.sleep(0.05)
    return sent


@contextlib.contextmanager
def uvicorn_logs_to(handler: logging.Handler) -> Iterator[None]:
    """Send uvicorn's access and error logs to `handler` (pytest's caplog.handler): they
    do not propagate to the root logger. Enter it once the server is built, since
    building one applies uvicorn's logging config, which replaces those loggers'
    handlers."""
    loggers = [logging.getLogger(n) for n in ("uvicorn.access", "uvicorn.error")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


class RedisServer:
    """A real redis-server on a free port (no persistence, LRU under a memory cap, as
    compose.yaml configures it). stop() and start() again keep the port."""

    def __init__(self, maxmemory: str = "256mb", password: str | None = None,
                 tls_dir: Path | None = None, unix_socket: Path | None = None) -> None:
        """`password`: requirepass. `tls_dir`: serve TLS only, with a self-signed
        certificate for 127.0.0.1 made there (openssl); `self.url` is then rediss://,
        trusting that certificate. `unix_socket`: serve on that socket file only (no TCP
        port); `self.url` is then unix://."""
        import shutil

        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: run `make install`")
        self.exe, self.maxmemory, self.password, self.tls_dir = exe, maxmemory, password, tls_dir
        self.port = free_port()
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        if tls_dir is not None:
            self.cert = tls_dir / "redis.crt"
            self.url = (f"rediss://{auth}127.0.0.1:{self.port}/0"
                        f"?ssl_cert_reqs=required&ssl_ca_certs={self.cert}")
        self.unix_socket = unix_socket
        if unix_socket is not None:
            self.url = f"unix://{auth}{unix_socket}?db=0"
        self.proc = None

    def _tls_args(self) -> list[str]:
        import subprocess

        assert self.tls_dir is not None
        key = self.tls_dir / "redis.key"
        if not self.cert.exists():
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                            "-keyout", str(key), "-out", str(self.cert), "-days", "1",
                            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                           check=True, capture_output=True)
        return ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.cert),
                "--tls-key-file", str(key), "--tls-ca-cert-file", str(self.cert),
                "--tls-auth-clients", "no"]

    def start(self) -> RedisServer:
        import subprocess

        import redis

        ports = (self._tls_args() if self.tls_dir is not None else ["--port", str(self.port)])
        if self.unix_socket is not None:
            ports = ["--port", "0", "--unixsocket", str(self.unix_socket), "--unixsocketperm", "700"]
        auth = ["--requirepass", self.password] if self.password else []
        self.proc = subprocess.Popen(
            [self.exe, *ports, *auth, "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory", self.maxmemory,
             "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def client(self):  # noqa: ANN201 - redis.Redis
        import redis

        return redis.Redis.from_url(self.url)


class ServeProcess:
    """`tidewire serve` in a process of its own on a free port (what an operator runs:
    signals, exit status and stderr are real). `args` are its flags past --port;
    `python_args` what the interpreter runs, given `serve ...` as its arguments."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, host: str = "127.0.0.1",
                 port: int | None = None,
                 python_args: tuple[str, ...] = ("-m", "service.cli")) -> None:
        import os

        self.args, self.host, self.port = list(args), host, port or free_port()
        self.python_args = python_args
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.url = f"http://{host}:{self.port}"
        self.ws_url = f"ws://{host}:{self.port}/v1/ws"
        self.proc = None
        self._log = None

    def start(self, timeout: float = 180.0, wait: bool = True) -> ServeProcess:
        """Start it; with `wait`, return once /ready says 200."""
        import subprocess
        import sys
        import tempfile

        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, *self.python_args, "serve", "--host", self.host,
             "--port", str(self.port), *self.args],
            stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while http_get_quiet(self.url + "/ready") != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"tidewire serve did not become ready:\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def log(self) -> str:
        assert self._log is not None
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (a graceful drain) and wait for the exit; returns its status."""
        import signal as signals

        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signals.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


async def apoll(fn, timeout: float, what: str, every: float = 0.01):  # noqa: ANN001, ANN201
    """Await until fn() returns something truthy (and return it); AssertionError naming
    `what` after `timeout` seconds."""
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(every)


def http_get_quiet(url: str) -> int | None:
    """The status of a GET, or None when nothing answers."""
    try:
        return http_get(url)[0]
    except OSError:
        return None

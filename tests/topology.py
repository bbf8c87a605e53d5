"""The scale-out topology as processes: Redis, N `tidewire serve` replicas, a DNS server
that names them, and HAProxy from apt with the repository's own configuration
(deploy/haproxy/haproxy.cfg), as compose.yaml runs them in containers.

Each replica listens on its own loopback address (127.0.0.21, .22, ...) and one shared
port, so that one DNS name resolving to all of them is what Docker's DNS gives HAProxy
for a scaled compose service."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.servers import RedisServer, ServeProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
HAPROXY_CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
NAME = "replicas.tidewire.test"


class Dns:
    """A DNS server (dnslib) on a free UDP port: A records for NAME, one per address in
    `addresses` (which the test changes as replicas come and go), NXDOMAIN otherwise."""

    def __init__(self, addresses: list[str]) -> None:
        from dnslib import QTYPE, RCODE, RR, A
        from dnslib.server import BaseResolver, DNSLogger, DNSServer

        self.addresses = list(addresses)
        outer = self

        class Resolver(BaseResolver):
            def resolve(self, request, handler):  # noqa: ANN001, ANN201
                reply = request.reply()
                q = request.q
                if str(q.qname).rstrip(".") != NAME:
                    reply.header.rcode = RCODE.NXDOMAIN
                elif q.qtype in (QTYPE.A, QTYPE.ANY):
                    for ip in list(outer.addresses):
                        reply.add_answer(RR(q.qname, QTYPE.A, rdata=A(ip), ttl=1))
                return reply  # (AAAA: no records, NOERROR)

        self.port = free_udp_port()
        quiet = DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data")
        self.server = DNSServer(Resolver(), port=self.port, address="127.0.0.1", logger=quiet)

    def start(self) -> Dns:
        self.server.start_thread()
        return self

    def stop(self) -> None:
        self.server.stop()


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free_on(hosts: list[str]) -> int:
    """A TCP port free on every one of `hosts`."""
    for _ in range(100):
        port = free_port()
        try:
            for h in hosts:
                with socket.socket() as s:
                    s.bind((h, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every replica address")


class Balancer:
    """haproxy -db -f deploy/haproxy/haproxy.cfg, its values from the environment."""

    def __init__(self, dns_port: int, replicas_port: int, tmp: Path) -> None:
        exe = shutil.which("haproxy")
        if exe is None:
            raise RuntimeError("haproxy is not installed: run `make install`")
        self.exe, self.port = exe, free_port()
        self.socket_path = tmp / "lb.sock"
        self.env = {**os.environ, "TIDEWIRE_LB_BIND": f"127.0.0.1:{self.port}",
                    "TIDEWIRE_DNS": f"127.0.0.1:{dns_port}",
                    "TIDEWIRE_REPLICAS_ADDR": f"{NAME}:{replicas_port}",
                    "TIDEWIRE_LB_SOCKET": str(self.socket_path)}
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/ws"
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()

    def start(self) -> Balancer:
        self.proc = subprocess.Popen([self.exe, "-db", "-f", str(HAPROXY_CFG)], env=self.env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not self.socket_path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"haproxy did not start:\n{self.log()}")
            time.sleep(0.05)
        return self

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def command(self, cmd: str) -> str:
        """One command on HAProxy's runtime API."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.socket_path))
            s.sendall(cmd.encode() + b"\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out.decode()

    def up(self) -> dict[str, set[str]]:
        """Per backend, the addresses of the servers it considers UP."""
        got: dict[str, set[str]] = {}
        for line in self.command("show servers state").splitlines():
            f = line.split()
            if len(f) > 5 and f[0].isdigit() and f[5] == "2":  # srv_op_state 2: running
                got.setdefault(f[1], set()).add(f[4])
        return got

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)  # soft stop
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Topology:
    """Redis + `n` replicas (flags `args`) + DNS + HAProxy. `replicas[i]` is at
    `addresses[i]`; `stop(i)`, `kill(i)`, `restart(i)` change one."""

    def __init__(self, n: int, args: list[str], tmp: Path, env: dict[str, str] | None = None):
        self.redis = RedisServer()
        self.addresses = [f"127.0.0.{21 + i}" for i in range(n)]
        self.port = port_free_on(self.addresses)
        self.args, self.env = args, env or {}
        self.replicas = [self._replica(i) for i in range(n)]
        self.dns = Dns(self.addresses)
        self.lb = Balancer(self.dns.port, self.port, tmp)

    def _replica(self, i: int) -> ServeProcess:
        return ServeProcess(*self.args, "--kv-tier", "redis", "--redis-url", self.redis.url,
                            env=self.env, host=self.addresses[i], port=self.port)

    def start(self) -> Topology:
        self.redis.start()
        for r in self.replicas:  # load in parallel, then wait for each
            r.start(wait=False)
        for r in self.replicas:
            r.wait_ready()
        self.dns.start()
        self.lb.start()
        self.wait_routed(set(self.addresses))
        return self

    def wait_routed(self, addresses: set[str], timeout: float = 30.0) -> None:
        """Until both backends have exactly these replicas UP."""
        deadline = time.monotonic() + timeout
        while True:
            up = self.lb.up()
            if all(up.get(b, set()) == addresses for b in ("by_affinity", "by_connections")):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the balancer has {up} up, not {addresses}:\n"
                                     f"{self.lb.log()}")
            time.sleep(0.05)

    def kill(self, i: int) -> None:
        self.replicas[i].kill()

    def restart(self, i: int, wait: bool = True) -> ServeProcess:
        self.replicas[i] = self._replica(i)
        self.replicas[i].start(wait=wait)
        return self.replicas[i]

    def stop(self) -> None:
        for part in (self.lb, *self.replicas, self.dns, self.redis):
            try:
                part.stop() if not isinstance(part, ServeProcess) else part.kill()
            except Exception:  # noqa: BLE001 - tear down the rest regardless
                pass

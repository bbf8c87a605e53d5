"""The JS SDK (clients/js) under Node against the real server: `node --test` runs
clients/js/test/*.test.js with the server's URL and an API key in the environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from engine import EngineConfig
from service.config import Limits, ServiceConfig
from tests.servers import run_server

JS = Path(__file__).resolve().parents[1] / "clients" / "js"


CONFIG = ServiceConfig(engine=EngineConfig(model="smollm2-135m", dtype="float32"),
                       limits=Limits(max_inflight_per_connection=4),
                       api_keys={"sk-js": "tenant-js"})


@pytest.fixture(scope="module")
def server(smollm2_dir):
    with run_server(CONFIG) as s:
        yield s


@pytest.fixture(scope="module")
def failover_url(server):  # noqa: ANN201
    """A TCP proxy whose first connection goes to `server` and every later one to a
    second server (a replica that dies, and a reconnect the balancer sends elsewhere)."""
    from tests.chaos.proxy import ChaosProxy

    with run_server(CONFIG) as other:
        port = lambda s: int(s.url.rsplit(":", 1)[1])  # noqa: E731
        proxy = ChaosProxy(port(server)).start()
        proxy.targets = [("127.0.0.1", port(server)), ("127.0.0.1", port(other))]
        try:
            yield f"ws://127.0.0.1:{proxy.port}/v1/ws"
        finally:
            proxy.stop()


def test_js_sdk_node_suite(server, failover_url) -> None:
    node = shutil.which("node")
    assert node, "node is not installed"
    assert (JS / "node_modules" / "@msgpack" / "msgpack").exists(), "run `make install`"
    env = {**os.environ, "TIDEWIRE_URL": server.ws_url, "TIDEWIRE_API_KEY": "sk-js",
           "TIDEWIRE_FAILOVER_URL": failover_url}
    # the three files side by side: they wait on the server, not on the CPU
    out = subprocess.run([node, "--test", "--test-concurrency=3", "--test-reporter=spec",
                          "test/"], cwd=JS, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "# fail 0" in out.stdout or "ℹ fail 0" in out.stdout, out.stdout[-3000:]
    assert "pass 13" in out.stdout, out.stdout[-3000:]  # every test ran
    eng = server.engine
    deadline = time.monotonic() + 10
    while eng.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not eng.has_unfinished() and eng.kv.num_free_blocks == eng.num_blocks  # no leaks

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


@pytest.fixture(scope="module")
def server(smollm2_dir):
    config = ServiceConfig(engine=EngineConfig(model="smollm2-135m", dtype="float32"),
                           limits=Limits(max_inflight_per_connection=4),
                           api_keys={"sk-js": "tenant-js"})
    with run_server(config) as s:
        yield s


def test_js_sdk_node_suite(server) -> None:
    node = shutil.which("node")
    assert node, "node is not installed"
    assert (JS / "node_modules" / "@msgpack" / "msgpack").exists(), "run `make install`"
    env = {**os.environ, "TIDEWIRE_URL": server.ws_url, "TIDEWIRE_API_KEY": "sk-js"}
    out = subprocess.run([node, "--test", "--test-reporter=spec", "test/"], cwd=JS, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "# fail 0" in out.stdout or "ℹ fail 0" in out.stdout, out.stdout[-3000:]
    assert "pass 10" in out.stdout, out.stdout[-3000:]  # every test ran
    eng = server.engine
    deadline = time.monotonic() + 10
    while eng.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not eng.has_unfinished() and eng.kv.num_free_blocks == eng.num_blocks  # no leaks

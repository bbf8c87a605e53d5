"""Start-up and defaults: the port is bound before the model loads; /health and /ready
say what is loading and when it should be done; engine routes answer 503 `loading`
meanwhile; a model that fails to load stops the server with a non-zero status; the
model's default sampling fills unset fields; unseeded requests draw from OS entropy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import urllib.request
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

import engine.build
from engine import EngineConfig
from engine.loader import sampling_defaults
from engine.progress import LoadProgress
from engine.registry import REGISTRY
from engine.runner import kv_pool
from service.config import ServiceConfig
from service.server import build_server
from tests.conftest import run_side_by_side
from tests.servers import free_port, http_get, run_server

REPO = Path(__file__).resolve().parents[1]
TIDEWIRE = [sys.executable, "-m", "service.cli"]


def _post(url: str, body: dict) -> tuple[int, dict, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def _poll(fn, timeout: float = 60.0):  # noqa: ANN001, ANN202 - until fn() is truthy
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            got = fn()
            if got:
                return got
        time.sleep(0.05)
    raise AssertionError("condition not met before the deadline")


# -- sampling defaults and seeds ---------------------------------------------------------------

def test_sampling_defaults_from_generation_config_else_registry(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    assert sampling_defaults("anything", tmp_path) == {"temperature": 0.6, "top_p": 0.95,
                                                       "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert sampling_defaults("smollm2-135m", tmp_path) == REGISTRY["smollm2-135m"].sampling
    assert sampling_defaults("/some/dir", tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults("/some/dir", tmp_path) == {}


def test_the_default_model_samples_at_its_measured_defaults() -> None:
    # chosen with bench/sampling.py (docs/performance.md); OpenAI's T=1 answered 47%
    assert REGISTRY["smollm2-135m"].sampling == {"temperature": 0.3, "top_p": 0.9}


def _tiny_with_defaults(tiny_models, tmp_path: Path, defaults: dict) -> Path:  # noqa: ANN001
    src = tiny_models("llama", seed=5)
    dst = tmp_path / "model"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    (dst / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, **defaults}))
    return dst


async def test_unset_fields_take_the_model_defaults_over_http_and_websocket(
        tiny_models, tmp_path: Path) -> None:
    model = _tiny_with_defaults(tiny_models, tmp_path, {"temperature": 0.0, "top_k": 3})
    prompt = [5, 6, 7, 8, 9]
    config = ServiceConfig(engine=EngineConfig(model=str(model)))
    with run_server(config) as s:
        seen = []  # the SamplingParams each request was admitted with
        submit = s.gateway.submit
        s.gateway.submit = lambda p, params, *a, **k: (seen.append(params), submit(p, params, *a, **k))[1]
        status, body = http_get(s.url + "/v1/models")
        assert json.loads(body)["data"][0]["sampling_defaults"] == {"temperature": 0.0,
                                                                    "top_k": 3}
        assert _post(s.url + "/v1/completions", {"prompt": prompt, "max_tokens": 4})[0] == 200
        assert _post(s.url + "/v1/completions", {"prompt": prompt, "max_tokens": 4,
                                                 "temperature": 0.9, "top_k": None})[0] == 200
        assert [(p.temperature, p.top_k) for p in seen] == [(0.0, 3), (0.9, 3)]
        async with connect(s.ws_url, subprotocols=["tidewire.v1.json"]) as ws:
            ready = json.loads(await ws.recv())
            assert ready["sampling_defaults"] == {"temperature": 0.0, "top_k": 3}
            runs = []
            for i, params in enumerate([{"max_tokens": 12}, {"max_tokens": 12},
                                        {"max_tokens": 12, "temperature": 0.0, "top_k": 0},
                                        {"max_tokens": 12, "temperature": None}]):
                await ws.send(json.dumps({"type": "generate", "id": f"r{i}",
                                          "prompt_token_ids": prompt, "params": params}))
                ids = []
                while (f := json.loads(await ws.recv()))["type"] != "done":
                    ids += f.get("token_ids", []) if f["type"] == "delta" else []
                runs.append(ids)
        assert (seen[2].temperature, seen[2].top_k) == (0.0, 3)
        assert (seen[5].temperature, seen[5].top_k) == (0.0, 3)  # null means unset, as on HTTP
        assert runs[0] == runs[1] == runs[2] == runs[3] and len(runs[0]) == 12  # greedy


async def test_sampling_defaults_none_keeps_openai_defaults(tiny_models, tmp_path: Path) -> None:
    model = _tiny_with_defaults(tiny_models, tmp_path, {"temperature": 0.0})
    config = ServiceConfig(engine=EngineConfig(model=str(model)), sampling_defaults="none")
    with run_server(config) as s:
        assert json.loads(http_get(s.url + "/v1/models")[1])["data"][0]["sampling_defaults"] == {}
        seen = []
        submit = s.gateway.submit
        s.gateway.submit = lambda p, params, *a, **k: (seen.append(params), submit(p, params, *a, **k))[1]
        assert _post(s.url + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4})[0] == 200
        assert (seen[0].temperature, seen[0].top_p, seen[0].top_k) == (1.0, 1.0, 0)


def test_unseeded_sampling_differs_across_processes_and_seed_repeats() -> None:
    code = ("from engine.sampler import Sampler; import torch;"
            "print(torch.rand(8, generator=Sampler({}).generator).tolist())")
    a, b, c, d = run_side_by_side([([sys.executable, "-c", f"import sys; sys.path.insert(0, "
                                      f"{str(REPO)!r}); " + code.format(seed)], dict(os.environ))
                                    for seed in ("None", "None", "7", "7")])
    assert a != b  # OS entropy: the first reply after a restart varies
    assert c == d  # --seed: reproducible


# -- start-up ----------------------------------------------------------------------------------

def test_a_port_in_use_fails_at_once_with_a_clear_message() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([*TIDEWIRE, "serve", "--port", str(port)], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
    assert r.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr
    assert "Traceback" not in r.stderr
    # before torch is imported or the model touched (well under a second when quiet)
    assert took < 10, took


def test_two_servers_cannot_both_hold_a_port() -> None:
    from service.net import listen

    first = listen("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            listen("127.0.0.1", port)  # SO_REUSEADDR lets a bind through; listen() does not
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # queued by the backlog before any server accepts
    finally:
        first.close()


def test_a_model_that_fails_to_load_stops_the_server_with_status_1(tmp_path: Path) -> None:
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text("{}")  # no architecture, no weights
    r = subprocess.run([*TIDEWIRE, "serve", "--port", str(free_port()), "--model", str(bad)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "the model did not load" in r.stderr


def test_health_and_ready_report_loading_then_serve(tiny_models, monkeypatch) -> None:
    release = threading.Event()
    real = engine.build.resolve_model

    def slow_resolve(name: str, **kw: bool) -> Path:
        assert release.wait(60)
        return real(name, **kw)

    monkeypatch.setattr(engine.build, "resolve_model", slow_resolve)
    port = free_port()
    ui = "https://ui.example"
    server = build_server(ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama"))),
                                        allowed_origins=(ui,)),
                          "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        # polled until the engine thread is inside its first phase (which blocks)
        status, body = _poll(lambda: (r := http_get(url + "/health")) and json.loads(
            r[1]).get("progress", {}).get("phase") and r)
        health = json.loads(body)
        assert status == 503 and health["status"] == "loading"
        assert health["progress"]["phase"].startswith("model files")
        status, body = http_get(url + "/ready")
        assert status == 503 and json.loads(body)["ready"] is False
        code, err, headers = _post(url + "/v1/completions", {"prompt": [5], "max_tokens": 1})
        assert code == 503 and err["error"]["code"] == "loading"
        assert headers["Retry-After"] == "2"  # no earlier start of this setup: no estimate
        # a page on an allowed origin can read the 503 (the gate sits inside CORS)
        req = urllib.request.Request(url + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": [5], "max_tokens": 1}).encode(),
                                     headers={"Content-Type": "application/json", "Origin": ui})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 503
        assert refused.value.headers["Access-Control-Allow-Origin"] == ui
        # the page and the SDK it imports load, then wait for the socket
        assert http_get(url + "/")[0] == 200 and http_get(url + "/sdk/index.js")[0] == 200
        assert http_get(url + "/version")[0] == 503

        async def handshake() -> int:
            with pytest.raises(InvalidStatus) as e:
                async with connect(f"ws://127.0.0.1:{port}/v1/ws"):
                    pass
            return e.value.response.status_code

        assert asyncio.run(handshake()) == 503
        release.set()
        _poll(lambda: http_get(url + "/ready")[0] == 200)
        health = json.loads(http_get(url + "/health")[1])
        assert health == {"status": "ok"}
        code, out, _ = _post(url + "/v1/completions",
                             {"prompt": [5, 6], "max_tokens": 2, "temperature": 0})
        assert code == 200 and out["usage"]["completion_tokens"] == 2
        done = dict(server.config.app.state.engine.progress.snapshot().done)
        assert {"tokenizer", "weights"} <= set(done)
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tidewire-engine"]


def test_stopping_while_the_model_loads_leaves_no_engine_behind(tiny_models, monkeypatch
                                                                 ) -> None:
    release, entered = threading.Event(), threading.Event()
    real = engine.build.resolve_model

    def slow_resolve(name: str, **kw: bool) -> Path:
        entered.set()
        assert release.wait(60)
        return real(name, **kw)

    monkeypatch.setattr(engine.build, "resolve_model", slow_resolve)
    before = set(_engine_threads())
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama"))),
                           shutdown_grace=0.2)
    server = build_server(config, "127.0.0.1", free_port(), log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert entered.wait(60)
    server.should_exit = True  # Ctrl-C while loading: the server stops without waiting
    thread.join(30)
    assert not thread.is_alive()
    release.set()  # the load completes; nobody will use the engine, so its thread ends
    _poll(lambda: not (set(_engine_threads()) - before))


def test_load_progress_remembers_the_last_start(tmp_path: Path) -> None:
    now = [100.0]
    clock = lambda: now[0]  # noqa: E731
    first = LoadProgress("m|bf16", tmp_path, clock)
    assert first.snapshot().as_dict(now[0])["eta_s"] is None  # nothing known yet
    with first.phase("weights"):
        now[0] += 4.0
    assert first.snapshot().done == (("weights", 4.0),)
    now[0] += 1.0
    assert first.finish() == 5.0
    second = LoadProgress("m|bf16", tmp_path, clock)
    now[0] += 2.0
    snap = second.snapshot().as_dict(now[0])
    assert snap["expected_s"] == 5.0 and snap["eta_s"] == 3.0
    assert LoadProgress("other", tmp_path, clock).snapshot().expected_s is None


def test_the_cpu_kv_pool_is_zeroed_and_costs_memory_only_where_written() -> None:
    import torch

    def rss_mb() -> float:
        with open(f"/proc/{os.getpid()}/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024

    before = rss_mb()
    pool = kv_pool((4, 2, 512, 16, 2, 64), torch.bfloat16, torch.device("cpu"))  # 512 MiB
    assert rss_mb() - before < 64
    pool[1, 0, 7] = 1.0
    assert pool[1, 0, 7].sum().item() == 16 * 2 * 64 and pool.sum().item() == 16 * 2 * 64
    assert rss_mb() - before < 64

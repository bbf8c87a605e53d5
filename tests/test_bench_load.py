"""`tidewire bench load`: the role mix, and a soak against a real `tidewire serve`
subprocess (tiny model): sockets of every role loop for TIDEWIRE_SOAK_SECONDS (60 in
`make test`, 1,800 in `make soak`), and the server ends with every
KV block back, no error, its fds back where they were and its RSS flat after warm-up."""

from __future__ import annotations

import argparse
import os

import pytest

from bench import load
from service.cli import build_parser


def test_mix_and_roles() -> None:
    mix = load.parse_mix("stream=2,cancel=1,abandon=1")
    assert mix == {"stream": 0.5, "cancel": 0.25, "abandon": 0.25}
    roles = load.assign_roles(100, load.parse_mix("stream=0.7,cancel=0.1,abandon=0.05,"
                                                  "slow=0.1,resume=0.05"), seed=3)
    assert len(roles) == 100
    assert {r: roles.count(r) for r in load.ROLES} == {"stream": 70, "cancel": 10,
                                                       "abandon": 5, "slow": 10, "resume": 5}
    with pytest.raises(ValueError, match="unknown role"):
        load.parse_mix("stream=1,nap=1")
    with pytest.raises(ValueError):
        load.parse_mix("stream=0")


def test_soak_every_role_no_errors_blocks_back_flat_memory(tiny_chat_model, monkeypatch,
                                                           tmp_path) -> None:
    seconds = float(os.environ.get("TIDEWIRE_SOAK_SECONDS", "60"))
    # the server subprocess: its KV pool mapped at start (as `tidewire serve` does by
    # default, and unlike the rest of the suite), a small pool, and a memory tier small
    # enough to fill during the warm-up (a filling tier is RSS growth up to its size).
    # Abandoned sockets park ~70 requests a second here: with the default 30 s grace the
    # parking space (--max-detached 1024) would fill and later drops would be aborted,
    # as designed, failing the resumes behind them; 5 s keeps it under the cap.
    monkeypatch.setenv("TIDEWIRE_KV_PREFAULT", "1")
    monkeypatch.setenv("TIDEWIRE_KV_CACHE_MEMORY_GB", "0.25")
    monkeypatch.setenv("TIDEWIRE_KV_TIER_MEMORY_GB", "0.02")
    monkeypatch.setenv("TIDEWIRE_RESUME_GRACE", "5")
    a = build_parser().parse_args([
        "bench", "load", "--model", str(tiny_chat_model), "--dtype", "float32",
        "--sockets", "48", "--sse", "4", "--clients", "2", "--duration", str(seconds),
        "--sample-every", "2", "--max-token-id", "40000",
        # warm-up: the tier fills and the parked requests reach their steady count (5 s
        # grace, plus dones kept 10 s) in the first ~15 s
        "--warmup", "0.3",
        ])
    assert isinstance(a, argparse.Namespace)
    r = load.run(a)
    print("\n" + load.report(r))
    o = r["outcomes"]
    assert r["errors"] == {} and r["connect_failures"] == 0, r["error_examples"]
    assert not [k for k in o if k.startswith("socket_error")], o
    for what in ("completed", "cancelled", "abandoned", "resumed", "sse_completed"):
        assert o.get(what, 0) > 0, (what, o)  # every role ran
    assert r["peak_live_streams"] >= 48
    assert r["blocks_back"], r["end"]
    assert r["fds"]["after"] <= r["fds"]["before"] + 2, r["fds"]
    # RSS after the warm-up: within 10% (60 s here; `make soak` runs 30 minutes)
    assert r["rss_mb"]["max_drift_pct"] <= 10.0, r["rss_mb"]
    load.plot(r, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").stat().st_size > 10_000

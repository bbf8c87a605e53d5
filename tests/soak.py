"""The soak's setup and checks, shared by its two ways of running:

- inline, in `tests/test_bench_load.py` (`pytest tests/test_bench_load.py`: 60 s;
  `make soak`: TIDEWIRE_SOAK_SECONDS=1800);
- in the background of the whole suite (`make test` sets TIDEWIRE_SOAK_BACKGROUND=60):
  `tidewire bench load` in its own process group at the idle scheduling class, started
  with the first test and checked by the soak test, which runs last. It runs on the CPU
  the rest of the suite leaves idle (the suite keeps ~1.3 of the 2 cores busy), but not
  for free: a busy neighbour slows torch's two-thread kernels whatever its priority (each
  of their barriers waits for a thread the neighbour holds: on a 2-vCPU VM a benchmark
  test took 70 s beside it against 2.4 s alone), so while it runs the tests' own torch
  work takes one thread (conftest.py, one_thread_beside_the_soak) and runs at its solo
  speed. Its load is burstier than alone, which the checks do not depend on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

# The server's settings: its KV pool mapped at start (as `tidewire serve` does by default,
# unlike the rest of the suite), a small pool, and a memory tier small enough to fill
# during the warm-up (a filling tier is RSS growth up to its size). Abandoned sockets park
# ~70 requests a second alone: with the default 30 s grace the parking space (1,024)
# would fill and later drops would be aborted, as designed, failing the resumes behind
# them; 5 s keeps it under the cap.
ENV = {"TIDEWIRE_KV_PREFAULT": "1", "TIDEWIRE_KV_CACHE_MEMORY_GB": "0.25",
       "TIDEWIRE_KV_TIER_MEMORY_GB": "0.02", "TIDEWIRE_RESUME_GRACE": "5"}
# In the background the soak can wait seconds for a core while the suite holds both, the
# server and its clients alike: a 5 s grace could expire between a drop and its resume.
# The default 30 s grace, with parking room for what it holds at full speed.
BACKGROUND_ENV = {**ENV, "TIDEWIRE_RESUME_GRACE": "30", "TIDEWIRE_MAX_DETACHED": "20000"}


def args(model: Path, seconds: float) -> list[str]:
    """`tidewire bench load` arguments: 48 sockets of every role and 4 SSE streams from
    two load-generator processes, sampled every 2 s; the RSS drift counts after a 30%
    warm-up (the tier fills and the parked requests reach their steady count)."""
    return ["bench", "load", "--model", str(model), "--dtype", "float32", "--sockets", "48",
            "--sse", "4", "--clients", "2", "--duration", str(seconds), "--sample-every", "2",
            "--max-token-id", "40000", "--warmup", "0.3"]


def check(r: dict[str, Any], max_drift_pct: float = 10.0) -> None:
    """Every role ran and none failed, every block came back, fds are back where they
    were and RSS stayed flat after the warm-up."""
    o = r["outcomes"]
    assert r["errors"] == {} and r["connect_failures"] == 0, r["error_examples"]
    assert not [k for k in o if k.startswith("socket_error")], o
    for what in ("completed", "cancelled", "abandoned", "resumed", "sse_completed"):
        assert o.get(what, 0) > 0, (what, o)  # every role ran
    assert r["peak_live_streams"] >= 48
    assert r["blocks_back"], r["end"]
    assert r["fds"]["after"] <= r["fds"]["before"] + 2, r["fds"]
    assert r["rss_mb"]["max_drift_pct"] <= max_drift_pct, r["rss_mb"]


class BackgroundSoak:
    """`tidewire bench load` (server, load generators) in a process group of its own at
    SCHED_IDLE; `result()` waits for it and reads its JSON report."""

    def __init__(self, model: Path, seconds: float, out: Path) -> None:
        self.seconds = seconds
        self.json = out / "soak.json"
        self.log_path = out / "soak.log"
        # no --plot: the soak test plots the report it reads back
        cmd = [sys.executable, "-m", "service.cli", *args(model, seconds), "--json", str(self.json)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **BACKGROUND_ENV},
                                         start_new_session=True, preexec_fn=_idle)
        self.policy = ("SCHED_IDLE" if os.sched_getscheduler(self.proc.pid) == os.SCHED_IDLE
                       else "nice 19")

    def running(self) -> bool:
        return self.proc.poll() is None

    def result(self) -> dict[str, Any]:
        # bench load's own limits (the server's start, the generators' 30-minute cap)
        # end it first; this deadline is the backstop
        rc = self.proc.wait(timeout=self.seconds + 3600)
        log = self.log_path.read_text(errors="replace")
        assert self.json.exists(), f"the soak wrote no report (rc {rc}); its log ends:\n{log[-3000:]}"
        print(f"\nbackground soak ({self.policy}), rc {rc}:\n{log[-2500:]}")
        return json.loads(self.json.read_text())

    def stop(self) -> None:
        """End whatever of its process group still runs (the suite was cut short, or it
        failed before stopping its server): SIGINT, which stops the server and the load
        generators in order, then SIGKILL. (A pytest killed outright skips this: the soak
        then ends on its own when its time is up.)"""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):  # whatever is left of the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class NotStarted:
    """What the fixture holds when the background soak could not start: only the soak
    test fails, with the reason."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def running(self) -> bool:
        return False

    def result(self) -> dict[str, Any]:
        raise AssertionError(f"the background soak did not start: {self.error!r}") from self.error

    def stop(self) -> None:
        pass


def _idle() -> None:
    """In the child before exec: the idle scheduling class (nice 19 where refused),
    inherited by the server and the load generators it starts."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        os.nice(19)

"""Progress of an engine's start, as named phases other threads can watch.

The engine thread runs the phases; the event loop reads `snapshot()` (an immutable
object replaced at each phase boundary, so a read never sees a half-updated state) to
answer /health while the model loads. How long the last start of the same setup took
is remembered under the cache directory, to say when this one should be done."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

log = logging.getLogger("tidewire.engine")


@dataclass(frozen=True)
class LoadSnapshot:
    started: float  # clock() at the start
    phase: str | None = None  # running now; None before the first and after the last
    phase_started: float = 0.0
    done: tuple[tuple[str, float], ...] = ()  # finished phases and their seconds
    finished: bool = False
    expected_s: float | None = None  # the last start of the same setup took this long

    def as_dict(self, now: float) -> dict[str, Any]:
        """JSON for /health and /ready: the phase, times, and an estimate of what is left."""
        elapsed = now - self.started
        eta = None if self.expected_s is None else round(max(0.0, self.expected_s - elapsed), 1)
        return {"phase": self.phase,
                "phase_s": round(now - self.phase_started, 1) if self.phase else None,
                "elapsed_s": round(elapsed, 1), "done": {n: round(s, 2) for n, s in self.done},
                "expected_s": self.expected_s, "eta_s": eta}


@dataclass
class LoadProgress:
    """Phases of one start. `key` names the setup (model, dtype, ...) whose last start
    time is remembered in `record_dir`; None remembers nothing."""

    key: str | None = None
    record_dir: Path | None = None
    clock: Callable[[], float] = time.monotonic
    _snap: LoadSnapshot = field(init=False)

    def __post_init__(self) -> None:
        self._snap = LoadSnapshot(self.clock(), expected_s=self._recorded())

    def snapshot(self) -> LoadSnapshot:
        return self._snap

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time one phase; logged at its start and, with its time, at its end."""
        log.info("loading: %s ...", name)
        t0 = self.clock()
        self._snap = replace(self._snap, phase=name, phase_started=t0)
        yield
        took = self.clock() - t0
        self._snap = replace(self._snap, phase=None, done=(*self._snap.done, (name, took)))
        log.info("loading: %s done in %.1f s", name, took)

    def finish(self) -> float:
        """Mark the start done; remember its time for the next one. Returns the seconds."""
        total = self.clock() - self._snap.started
        self._snap = replace(self._snap, finished=True, phase=None)
        self._record(total)
        return total

    def _path(self) -> Path | None:
        if self.key is None or self.record_dir is None:
            return None
        return self.record_dir / f"{hashlib.sha256(self.key.encode()).hexdigest()[:16]}.json"

    def _recorded(self) -> float | None:
        path = self._path()
        try:
            return float(json.loads(path.read_text())["seconds"]) if path else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _record(self, seconds: float) -> None:
        path = self._path()
        if path is None:
            return
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": self.key, "seconds": round(seconds, 2)}))
            os.replace(tmp, path)

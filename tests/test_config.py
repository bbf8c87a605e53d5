"""One config object: EngineConfig is built from LLM's flat keywords, from an EngineConfig,
or from the command line's flags, and every one of those reaches its field."""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
from dataclasses import fields, is_dataclass, replace
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from engine.config import (CacheConfig, EngineConfig, SchedulerConfig, TierConfig,
                           flat_names)

# a non-default value for every flat keyword (LLM's, from_flat's)
FLAT_SAMPLE: dict[str, Any] = dict(
    model="other-model", dtype="float32", attention_backend="triton-interpret",
    kv_cache_memory=1 << 20, max_model_len=256, seed=7, debug=True, enforce_eager=True,
    quantization="int8", threads=3, async_output=False, block_size=8, num_kv_blocks=40,
    num_full_kv_blocks=12, enable_prefix_caching=False, max_num_batched_tokens=64,
    max_num_seqs=4, watermark=0.05,
    kv_tier="none", redis_url="redis://h:6379/2", kv_tier_memory=1 << 20, kv_tier_ttl=60,
    kv_tier_write_through=True, kv_tier_load_timeout=0.5, kv_tier_io_timeout=0.25,
    kv_tier_max_pending_writes=16, kv_tier_secret="s3cret", kv_prefault=False, kv_cache_dtype="int8",
    speculative="ngram", num_speculative_tokens=6, draft_model="draft", speculative_ngram_min=3,
    speculative_ngram_max=5, speculative_min_acceptance=0.5, speculative_max_batch=4,
    speculative_probe_steps=2, speculative_cooldown=3)


def leaves(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """A config's fields, the sub-configs' as "section.field"."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            out.update(leaves(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


def changed(a: Any, b: Any) -> list[str]:
    la, lb = leaves(a), leaves(b)
    return sorted(k for k in la if la[k] != lb[k])


# -- EngineConfig ----------------------------------------------------------------------------


def test_engine_config_is_one_class_wherever_it_is_imported_from() -> None:
    import engine
    import engine.llm_engine
    import service.config

    assert engine.EngineConfig is engine.llm_engine.EngineConfig is EngineConfig
    assert service.config.EngineConfig is EngineConfig
    # the command line builds one before anything loads torch
    probe = "import sys, engine.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)


def test_dtype_names_are_the_engines_torch_dtypes() -> None:
    from engine.config import DTYPE_NAMES
    from engine.platform import DTYPES

    assert set(DTYPE_NAMES) == set(DTYPES)


def test_every_field_has_exactly_one_flat_keyword() -> None:
    """Each flat keyword changes one field, no two the same one, and every field of
    EngineConfig and its sub-configs has one (a new field needs a name here)."""
    assert set(FLAT_SAMPLE) == flat_names()
    base, owner = EngineConfig(), {}
    for name, value in FLAT_SAMPLE.items():
        diff = changed(base, base.with_flat(**{name: value}))
        assert len(diff) == 1, (name, diff)
        assert diff[0] not in owner, (name, owner.get(diff[0]), diff[0])
        owner[diff[0]] = name
    assert set(owner) == set(leaves(base))


def test_from_flat_maps_the_historical_names_to_the_nested_config() -> None:
    cfg = EngineConfig.from_flat("m", block_size=8, num_kv_blocks=None, max_num_seqs=4,
                                 enable_prefix_caching=False, kv_tier="redis",
                                 redis_url="redis://r:6379/0", kv_tier_memory=5, kv_tier_ttl=9,
                                 kv_tier_write_through=True, seed=1)
    assert cfg == EngineConfig(
        model="m", cache=CacheConfig(block_size=8, num_blocks=0, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=4),
        tier=TierConfig("redis", "redis://r:6379/0", memory_bytes=5, ttl=9, write_through=True),
        seed=1)
    assert EngineConfig.from_flat() == EngineConfig()


def test_flat_keywords_are_validated_like_the_config() -> None:
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig.from_flat(dtype="int4")
    with pytest.raises(ValueError, match="redis_url"):
        EngineConfig.from_flat(kv_tier="redis")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig().with_flat(block_size=0)


def test_an_unknown_flat_keyword_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="'kv_tier_tll'") as e:
        EngineConfig.from_flat("m", kv_tier_tll=60)
    assert "kv_tier_ttl" in str(e.value)  # the known names are listed
    # the sub-configs themselves are not flat keywords (one value, one way to give it)
    with pytest.raises(TypeError, match="'tier'"):
        EngineConfig.from_flat("m", tier=TierConfig())


# -- LLM -------------------------------------------------------------------------------------


@pytest.fixture
def built(monkeypatch) -> list[EngineConfig]:
    """The configs LLM hands its engine (a stub: no model is loaded)."""
    import engine.llm

    seen: list[EngineConfig] = []

    class StubEngine:
        def __init__(self, config: EngineConfig) -> None:
            seen.append(config)
            self.config, self.tokenizer = config, None

    monkeypatch.setattr(engine.llm, "LLMEngine", StubEngine)
    return seen


REPRESENTATIVE = [  # flat keywords as the tests and benchmarks pass them, and what they mean
    (dict(dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=64,
          debug=True),
     dict(dtype="float32", debug=True, cache=CacheConfig(4, 40),
          scheduler=SchedulerConfig(max_num_batched_tokens=64))),
    (dict(dtype="float32", enable_prefix_caching=False, num_kv_blocks=None),
     dict(dtype="float32", cache=CacheConfig(enable_prefix_caching=False))),
    (dict(kv_tier="redis", redis_url="redis://r:6379/0", kv_tier_memory=0,
          kv_tier_write_through=True, kv_tier_ttl=30),
     dict(tier=TierConfig("redis", "redis://r:6379/0", 0, ttl=30, write_through=True))),
    (dict(max_num_seqs=8, attention_backend="triton-interpret", kv_tier="none",
          enforce_eager=True, quantization="int8", threads=2, kv_cache_memory=1 << 20,
          max_model_len=128, seed=3),
     dict(attention_backend="triton-interpret", scheduler=SchedulerConfig(max_num_seqs=8),
          tier=TierConfig("none"), enforce_eager=True, quantization="int8", threads=2,
          kv_cache_memory=1 << 20, max_model_len=128, seed=3)),
]


@pytest.mark.parametrize("flat,nested", REPRESENTATIVE)
def test_llm_flat_keywords_equal_an_engine_config(built, flat, nested) -> None:
    from engine import LLM

    a = LLM("some-model", **flat)
    b = LLM(config=EngineConfig(model="some-model", **nested))
    assert a.config == b.config == built[0] == built[1]
    assert LLM(model="some-model", **flat).config == a.config  # model by name, as the tests do


def test_llm_keywords_override_a_given_config(built) -> None:
    from engine import LLM

    cfg = EngineConfig(model="m", dtype="float32", cache=CacheConfig(block_size=8))
    assert LLM(config=cfg).config is cfg
    got = LLM("n", config=cfg, seed=5, kv_tier_ttl=7).config
    assert got == replace(cfg, model="n", seed=5, tier=replace(cfg.tier, ttl=7))
    assert LLM().config == EngineConfig()


def test_llm_rejects_an_unknown_keyword_before_loading_anything(built) -> None:
    from engine import LLM

    with pytest.raises(TypeError, match="'num_blocks'"):
        LLM("m", num_blocks=10)
    assert built == []


# -- named arguments -------------------------------------------------------------------------


def test_runner_and_step_output_take_their_many_arguments_by_name() -> None:
    from engine.outputs import StepOutput
    from engine.runner import ModelRunner

    params = list(inspect.signature(ModelRunner).parameters.values())
    assert [p.name for p in params[:2]] == ["arch", "weights"]
    assert all(p.kind is p.KEYWORD_ONLY for p in params[2:])
    with pytest.raises(TypeError):
        StepOutput("r", [1])  # type: ignore[misc]
    assert StepOutput(request_id="r", new_token_ids=[1]).index == 0


# -- the command line ------------------------------------------------------------------------

ENGINE_GROUPS = ("model", "engine", "KV cache and host tier")
# in those groups, but settings of the service or of the process, not of the engine
NOT_ENGINE = {"--served-model-name", "--switch-interval"}
SERVE_ONLY = {"--no-async-output"}  # the offline LLM hands out outputs when a step returns
# a base where every choice is valid (--kv-tier redis needs a URL)
BASE = {"serve": (["serve", "--redis-url", "redis://base:6379/0"], []),
        "generate": (["generate", "--redis-url", "redis://base:6379/0"], ["hi"])}


@pytest.fixture
def no_env(monkeypatch) -> None:
    """The flags' built-in defaults, whatever TIDEWIRE_* this shell has set."""
    for k in [k for k in os.environ if k.startswith("TIDEWIRE_") and k != "TIDEWIRE_CACHE"]:
        monkeypatch.delenv(k)


def _command(name: str) -> argparse.ArgumentParser:
    from service.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def engine_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The flags of the parser's engine groups, and --seed (in the sampling group: the
    engine's seed for requests that set none)."""
    acts = [a for g in parser._action_groups if g.title in ENGINE_GROUPS
            for a in g._group_actions]
    acts += [a for a in parser._actions if "--seed" in a.option_strings]
    return {a.option_strings[0]: a for a in acts if a.option_strings[0] not in NOT_ENGINE}


def other_values(action: argparse.Action, base: Any) -> list[list[str]]:
    """Command-line pieces that set the flag to something other than `base`."""
    flag = action.option_strings[0]
    if action.nargs == 0:  # a switch: given, it flips its default
        return [[flag]]
    if action.choices:
        return [[flag, str(c)] for c in action.choices if c != base]
    if action.type is int:
        return [[flag, str((base or 0) + 3)]]
    if action.type is float:
        return [[flag, str(base + 0.5)]]
    return [[flag, f"{base}-other"]]


def unreached(command: str, build: Callable[[argparse.Namespace], EngineConfig]) -> list[str]:
    """Each engine flag of `command` set alone to a non-default value must change exactly
    one field of the config `build` makes, and no two flags the same field; what breaks
    that, as "FLAG VALUE: what happened"."""
    parser = _command(command)
    head, tail = BASE[command]
    parse = lambda extra: parser.parse_args(head[1:] + extra + tail)  # noqa: E731
    base_ns = parse([])
    base, owner, problems = build(base_ns), {}, []
    for flag, action in engine_flags(parser).items():
        for extra in other_values(action, getattr(base_ns, action.dest)):
            diff = changed(base, build(parse(extra)))
            where = " ".join(extra)
            if len(diff) != 1:
                problems.append(f"{where}: changed {diff or 'no field'}")
            elif owner.setdefault(diff[0], flag) != flag:
                problems.append(f"{where}: changed {diff[0]}, as {owner[diff[0]]} does")
    return problems


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_engine_flag_reaches_the_engine_config(no_env, command) -> None:
    from service.cli.engine_flags import engine_config

    flags = engine_flags(_command(command))
    assert {"--kv-tier-ttl", "--model", "--seed", "--block-size", "--threads"} <= set(flags)
    assert unreached(command, engine_config) == []


def test_generate_has_every_engine_flag_of_serve() -> None:
    serve, generate = set(engine_flags(_command("serve"))), set(engine_flags(_command("generate")))
    assert generate == serve - SERVE_ONLY


def test_the_flag_check_catches_a_dropped_flag(no_env) -> None:
    """What `tidewire generate` built before its config came from engine_config: the
    tier's TTL dropped, whatever --kv-tier-ttl said."""
    from service.cli.engine_flags import engine_config

    def old_generate(a: argparse.Namespace) -> EngineConfig:
        cfg = engine_config(a)
        return replace(cfg, tier=replace(cfg.tier, ttl=TierConfig().ttl))

    assert unreached("generate", old_generate) == ["--kv-tier-ttl 86403: changed no field"]


def test_generate_runs_the_llm_on_that_config(no_env, monkeypatch, capsys) -> None:
    """From flags and from the environment, `generate`'s LLM gets engine_config's."""
    import engine
    from service.cli import main

    got: list[EngineConfig] = []

    class FakeLLM:
        def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                     **kw: Any) -> None:
            assert model is None and not kw
            got.append(config)

        def generate(self, prompts: list[str], params: Any) -> list[Any]:
            return [SimpleNamespace(text="ok", finish_reason="length") for _ in prompts]

        def close(self) -> None:
            pass

    monkeypatch.setattr(engine, "LLM", FakeLLM)
    assert main(["generate", "--kv-tier-ttl", "60", "--max-num-seqs", "3", "hi"]) == 0
    assert got[-1].tier.ttl == 60 and got[-1].scheduler.max_num_seqs == 3
    monkeypatch.setenv("TIDEWIRE_KV_TIER_TTL", "120")
    assert main(["generate", "hi"]) == 0
    assert got[-1].tier.ttl == 120
    assert capsys.readouterr().out == "ok\nok\n"

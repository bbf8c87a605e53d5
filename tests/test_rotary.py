"""engine/models/rotary.py against transformers' own rotary embedding classes.

Each case is a config.json's contents: the HF config class and its rotary class are
built from it, and so is our RopeSpec (from the dict and from the HF config object);
our table rows must equal the first half of HF's cos/sin (attention factor included).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen2Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from engine.models.rotary import RopeSpec, rope_tables, rope_type

MAX_PE = 512
# head_dim 64; Phi-3's cases: 96 with 0.75 rotated (72 dims, 36 frequencies)
BASE: dict[str, Any] = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                            max_position_embeddings=MAX_PE)
PHI = dict(BASE, hidden_size=192)
FAMILIES: dict[str, tuple[Any, Any]] = {
    "llama": (LlamaConfig, LlamaRotaryEmbedding),
    "qwen2": (Qwen2Config, Qwen2RotaryEmbedding),
    "phi3": (Phi3Config, Phi3RotaryEmbedding),
    "gemma3": (Gemma3TextConfig, Gemma3RotaryEmbedding),
}
LONG_FACTORS = dict(short_factor=[1.0 + 0.02 * i for i in range(36)],
                    long_factor=[1.0 + 0.25 * i for i in range(36)])


def hf_rotary(family: str, cfg: dict[str, Any]) -> tuple[Any, torch.nn.Module]:
    """HF's config object and a fresh rotary module (dynamic/longrope ones keep state)."""
    config_cls, rotary_cls = FAMILIES[family]
    hf = config_cls(**copy.deepcopy(cfg))  # HF fills in the rope dicts it is given
    return hf, rotary_cls(hf)


def hf_cos_sin(rotary: torch.nn.Module, n: int,
               layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos/sin for positions 0..n-1 in one sequence, as [n, rotary_dim // 2]."""
    x, pos = torch.zeros(1), torch.arange(n)[None]
    cos, sin = rotary(x, pos) if layer_type is None else rotary(x, pos, layer_type)
    half = cos.shape[-1] // 2
    assert torch.equal(cos[..., :half], cos[..., half:])  # the neox layout we rely on
    return cos[0, :, :half], sin[0, :, :half]


def assert_rows(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor],
                rows: slice, atol: float = 1e-6) -> None:
    for mine, hf in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine[rows], hf[rows], rtol=1e-6, atol=atol)


def specs(cfg: dict[str, Any], hf: Any, layer_type: str | None = None) -> list[RopeSpec]:
    """The spec from the config.json dict and from HF's parsed config object."""
    return [RopeSpec.from_hf_config(cfg, layer_type), RopeSpec.from_hf_config(hf, layer_type)]


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
SINGLE_REGIME: dict[str, tuple[str, dict[str, Any]]] = {
    "default": ("llama", {"rope_theta": 10000.0}),
    "no_rope_keys": ("llama", {}),
    "llama3_legacy": ("llama", {"rope_theta": 500000.0, "rope_scaling": LLAMA3}),
    "linear_v5": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 10000.0}}),
    "yarn_qwen25_legacy": ("qwen2", {"rope_theta": 1e6, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}),
    "yarn_mscale": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
        "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 64}}),
    "yarn_equal_mscales": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 0.707,
        "mscale_all_dim": 0.707, "original_max_position_embeddings": 64}}),
    "yarn_attention_factor_untruncated": ("qwen2", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "attention_factor": 1.2,
        "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False,
        "original_max_position_embeddings": 16}}),
    "yarn_empty_ramp": ("llama", {"rope_parameters": {  # beta_fast == beta_slow: a step
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0,
        "beta_slow": 8.0, "truncate": False, "original_max_position_embeddings": 128}}),
    "yarn_factor_from_lengths": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": None,
        "original_max_position_embeddings": 128}}),
    "phi3_partial": ("phi3", dict(PHI, partial_rotary_factor=0.75)),
}


@pytest.mark.parametrize("name", SINGLE_REGIME)
def test_tables_match_hf(name: str) -> None:
    family, rope = SINGLE_REGIME[name]
    cfg = {**(PHI if family == "phi3" else BASE), **rope}
    hf, rotary = hf_rotary(family, cfg)
    theirs = hf_cos_sin(rotary, MAX_PE)
    for spec in specs(cfg, hf):
        assert theirs[0].shape == (MAX_PE, spec.rotary_dim // 2)
        assert_rows(spec.tables(MAX_PE), theirs, slice(None))


def test_partial_rotary_dim() -> None:
    assert RopeSpec.from_hf_config(dict(PHI, partial_rotary_factor=0.75)).rotary_dim == 72
    assert RopeSpec.from_hf_config(dict(PHI, rope_parameters={
        "rope_type": "default", "partial_rotary_factor": 0.5})).rotary_dim == 48
    assert RopeSpec.from_hf_config(dict(BASE, rotary_dim=32)).rotary_dim == 32


def test_yarn_mscale_is_folded_into_the_tables() -> None:
    plain = rope_tables(64, 8, 10000.0)
    yarn = rope_tables(64, 8, 10000.0, {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                                        "mscale_all_dim": 0.8,
                                        "original_max_position_embeddings": 64})
    # position 0: angle 0, so cos is the attention factor itself
    log40 = torch.tensor(40.0).log()
    expected = (0.1 * 1.0 * log40 + 1) / (0.1 * 0.8 * log40 + 1)
    torch.testing.assert_close(yarn[0][0], expected.expand(32), rtol=1e-6, atol=0)
    assert torch.equal(plain[0][0], torch.ones(32))


LONGROPE = dict(PHI, partial_rotary_factor=0.75, original_max_position_embeddings=128,
                rope_scaling={"type": "longrope", **LONG_FACTORS})


@pytest.mark.parametrize(("family", "cfg"), [
    ("phi3", LONGROPE),
    # transformers 5's form: the original length inside the dict, an explicit factor (not
    # on Phi3Config, whose own original_max_position_embeddings, 4096 unless set, wins)
    ("llama", dict(PHI, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                         "partial_rotary_factor": 0.75, "factor": 4.0,
                                         "original_max_position_embeddings": 128,
                                         **LONG_FACTORS})),
], ids=["phi3_legacy", "v5"])
def test_longrope_short_below_original_long_from_it(family: str, cfg: dict[str, Any]) -> None:
    """HF picks short or long factors by the sequence's length: a sequence within the
    original 128 positions gives our rows below 128, one past it our rows from 128 on."""
    hf, rotary = hf_rotary(family, cfg)
    short = hf_cos_sin(rotary, 128)
    long = hf_cos_sin(hf_rotary(family, cfg)[1], MAX_PE)
    assert not torch.allclose(short[0], long[0][:128])  # the two sets differ
    for spec in specs(cfg, hf):
        assert spec.rope_type == "longrope" and spec.rotary_dim == 72
        ours = spec.tables(MAX_PE)
        assert_rows(ours, short, slice(0, 128))
        assert_rows(ours, long, slice(128, MAX_PE))
        # sqrt(1 + ln 4 / ln 128), from factor = 512 / 128 in both forms
        assert ours[0][0, 0].item() == pytest.approx((1 + 2 / 7) ** 0.5)


def test_dynamic_is_default_within_original_length() -> None:
    cfg = dict(BASE, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                      "rope_theta": 10000.0})
    hf, rotary = hf_rotary("llama", cfg)
    within = hf_cos_sin(rotary, MAX_PE)
    plain = hf_cos_sin(hf_rotary("llama", BASE)[1], MAX_PE)
    for spec in specs(cfg, hf):
        ours = spec.tables(2 * MAX_PE)  # a table past the original length changes nothing below
        assert_rows(ours, within, slice(0, MAX_PE))
        assert_rows(ours, plain, slice(0, MAX_PE))


def test_dynamic_past_original_length_uses_the_full_length_base() -> None:
    """From max_position_embeddings on: HF's frequencies for a sequence as long as the
    table. HF computes that base in fp32 (from a tensor seq_len), we in double: here
    cos/sin differ by 8e-6 at most (0 with factor 2 and 1024 positions)."""
    n = 1000
    cfg = dict(BASE, rope_parameters={"rope_type": "dynamic", "factor": 3.0,
                                      "rope_theta": 10000.0})
    hf, rotary = hf_rotary("llama", cfg)
    scaled = hf_cos_sin(rotary, n)
    ours = RopeSpec.from_hf_config(cfg).tables(n)
    assert_rows(ours, scaled, slice(MAX_PE, None), atol=5e-5)
    plain = hf_cos_sin(hf_rotary("llama", BASE)[1], n)
    assert_rows(ours, plain, slice(0, MAX_PE))
    assert not torch.allclose(ours[0][MAX_PE:], plain[0][MAX_PE:])


GEMMA_NESTED = dict(BASE, head_dim=64, rope_parameters={
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
GEMMA_LEGACY = dict(BASE, head_dim=64, rope_theta=1e6, rope_local_base_freq=10000.0,
                    rope_scaling={"rope_type": "linear", "factor": 8.0})


@pytest.mark.parametrize("cfg", [GEMMA_NESTED, GEMMA_LEGACY], ids=["nested", "legacy"])
@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_gemma3_per_layer_type(cfg: dict[str, Any], layer_type: str) -> None:
    hf, rotary = hf_rotary("gemma3", cfg)
    theirs = hf_cos_sin(rotary, MAX_PE, layer_type)
    for spec in specs(cfg, hf, layer_type):
        assert spec.theta == (1e6 if layer_type == "full_attention" else 10000.0)
        assert spec.rope_type == ("linear" if layer_type == "full_attention" else "default")
        assert_rows(spec.tables(MAX_PE), theirs, slice(None))


def test_per_layer_type_config_needs_a_layer_type() -> None:
    with pytest.raises(ValueError, match="per layer type"):
        RopeSpec.from_hf_config(GEMMA_NESTED)
    with pytest.raises(ValueError, match="no rope parameters for layer type 'chunked'"):
        RopeSpec.from_hf_config(GEMMA_NESTED, "chunked")
    # a flat config serves every layer type
    flat = RopeSpec.from_hf_config(dict(BASE, rope_theta=5e5), "sliding_attention")
    assert flat.theta == 5e5 and flat.scaling is None


@pytest.mark.parametrize(("scaling", "expected"), [
    (None, "default"),
    ({"type": "linear", "factor": 2.0}, "linear"),
    ({"rope_type": "llama3", "type": "linear"}, "llama3"),
    ({"type": "su", **LONG_FACTORS}, "longrope"),
    ({"type": "yarn", **LONG_FACTORS}, "longrope"),  # Phi-3's legacy spelling
    ({"type": "yarn", "factor": 4.0}, "yarn"),
])
def test_rope_type_spellings(scaling: dict[str, Any] | None, expected: str) -> None:
    assert rope_type(scaling) == expected


def test_invalid_inputs_are_value_errors() -> None:
    with pytest.raises(ValueError, match="unsupported rope type 'mrope'"):
        rope_tables(64, 8, 10000.0, {"type": "mrope"})
    with pytest.raises(ValueError, match="even"):
        rope_tables(63, 8, 10000.0)
    with pytest.raises(ValueError, match="short_factor has 36 entries, expected .* = 32"):
        rope_tables(64, 8, 10000.0, {"rope_type": "longrope", "original_max_position_embeddings": 4,
                                     **LONG_FACTORS})


def test_spec_does_not_alias_the_config() -> None:
    cfg = dict(BASE, rope_scaling={"type": "linear", "factor": 2.0})
    spec = RopeSpec.from_hf_config(cfg)
    assert spec.scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert cfg["rope_scaling"] == {"type": "linear", "factor": 2.0}

"""Rotary embedding tables for every rope variant of the supported model families.

Every variant is expressed as the same pair of tables the rotation kernels read
(kernels/reference.py `rope`, the Triton kernel, the compiled CPU kernel): cos and sin,
fp32, [max_positions, rotary_dim // 2], neox layout (the first half of the rotated dims
turns with the second); any attention ("magnitude") factor is folded into both. The
arithmetic follows transformers' rope init functions op for op, so the tables equal the
cos/sin of HF's rotary classes (tests/test_rotary.py).

HF's `dynamic` and `longrope` pick their frequencies by the current sequence length.
Tidewire caches keys already rotated, so a position's rotation cannot change as the
sequence grows; these two get a static rule instead, with frequencies set by position:

- `longrope`: positions below `original_max_position_embeddings` use the short factors,
  positions at or past it the long ones. Identical to HF while a sequence stays under the
  original length; past it, HF would re-rotate the early positions with the long factors.
- `dynamic`: the default frequencies below `max_position_embeddings` (HF's original
  length for this type: identical to HF there); at or past it, the NTK-scaled base that
  HF computes for a sequence of the table's full length (`max_positions`, the longest
  context the engine serves); vLLM rotates every position with such a base (for
  max_position_embeddings x factor).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# transformers' default base when a config names none
DEFAULT_THETA = 10000.0


@dataclass(frozen=True)
class RopeSpec:
    """What builds one layer type's rotary tables, read once from an HF config.

    `scaling` is the rope parameters dict with `rope_type` normalized (None for the
    default rope); read-only. `max_position_embeddings` is the model's, which `dynamic`
    reads as its original length and `yarn`/`longrope` use for a missing `factor`."""

    rotary_dim: int
    theta: float
    scaling: dict[str, Any] | None
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any] | Any,
                       layer_type: str | None = None) -> RopeSpec:
        """The spec of a config.json's contents (or a transformers config object) for
        `layer_type`, required where the rope parameters are keyed by layer type
        (Gemma 3's {"full_attention": {...}, "sliding_attention": {...}}).

        Reads transformers 5's `rope_parameters` and the legacy `rope_scaling` +
        `rope_theta` (+ Gemma 3's `rope_local_base_freq` for its sliding layers) with
        HF's precedence: values inside the rope dict first, except a top-level
        `original_max_position_embeddings` (Phi-3's), which wins over a flat dict's."""
        if not isinstance(cfg, Mapping):
            cfg = cfg.to_dict()
        params, nested = _layer_rope_params(cfg, layer_type)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        max_pe = int(_first(cfg.get("max_position_embeddings"), 4096))
        kind = rope_type(params)
        scaling = None if kind == "default" else {**params, "rope_type": kind}
        if scaling is not None and not nested and cfg.get("original_max_position_embeddings"):
            scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        return cls(
            rotary_dim=_rotary_dim(cfg, params, head_dim),
            theta=float(_first(params.get("rope_theta"), cfg.get("rope_theta"), DEFAULT_THETA)),
            scaling=scaling,
            max_position_embeddings=max_pe,
        )

    @property
    def rope_type(self) -> str:
        return rope_type(self.scaling)

    def tables(self, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: fp32 [max_positions, rotary_dim // 2] (see `rope_tables`)."""
        return rope_tables(self.rotary_dim, max_positions, self.theta, self.scaling,
                           self.max_position_embeddings)


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The variant a rope dict names: `rope_type`, else the legacy `type`, else
    "default". Phi-3's legacy spellings ("su", and "yarn" with short/long factors)
    mean `longrope`."""
    if not scaling:
        return "default"
    kind = str(scaling.get("rope_type") or scaling.get("type") or "default")
    if kind == "su" or (kind == "yarn" and "long_factor" in scaling):
        return "longrope"
    return kind


def rope_tables(rotary_dim: int, max_positions: int, theta: float,
                scaling: Mapping[str, Any] | None = None,
                max_position_embeddings: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, fp32, [max_positions, rotary_dim // 2] (neox layout), with the
    variant's attention factor folded into both.

    `scaling`: the rope dict (None or type "default": plain rope); `max_position_embeddings`:
    the model's (defaults to `max_positions`), which `dynamic` reads as its original length
    and `yarn`/`longrope` use for a missing `factor` (the module docstring says how the
    length-dependent variants are fixed by position). ValueError for an odd `rotary_dim`
    or a variant not supported here."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and positive, got {rotary_dim}")
    params = dict(scaling or {})
    kind = rope_type(params)
    build = _VARIANTS.get(kind)
    if build is None:
        raise ValueError(f"unsupported rope type {kind!r}; supported: {', '.join(_VARIANTS)}")
    lengths = _Lengths(max_positions, max_position_embeddings or max_positions)
    return _cos_sin(build(rotary_dim, theta, params, lengths), max_positions)


@dataclass(frozen=True)
class _Lengths:
    max_positions: int  # rows of the table: the longest context the engine serves
    max_position_embeddings: int  # the model's


@dataclass(frozen=True)
class _Frequencies:
    """One variant's frequencies: inv_freq [rotary_dim // 2] for positions below
    `switch`, `long_inv_freq` at or past it (None: inv_freq everywhere), and the
    factor that multiplies cos and sin."""

    inv_freq: torch.Tensor
    attention: float = 1.0
    long_inv_freq: torch.Tensor | None = None
    switch: int = 0


def _cos_sin(f: _Frequencies, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    inv = f.inv_freq[None, :]
    if f.long_inv_freq is not None and f.switch < max_positions:
        inv = torch.where(pos[:, None] < f.switch, inv, f.long_inv_freq[None, :])
    freqs = pos[:, None] * inv  # the same fp32 products as HF's position_ids * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    if f.attention != 1.0:
        cos, sin = cos * f.attention, sin * f.attention
    return cos, sin


def _exponents(dim: int) -> torch.Tensor:
    """2i / dim for i < dim / 2: the exponents of the base, in HF's fp32 order."""
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(dim))


def _default(dim: int, theta: float, s: dict[str, Any], n: _Lengths) -> _Frequencies:
    return _Frequencies(_default_inv_freq(dim, theta))


def _linear(dim: int, theta: float, s: dict[str, Any], n: _Lengths) -> _Frequencies:
    """Position interpolation: every position divided by `factor`, written on the
    frequencies instead."""
    return _Frequencies(_default_inv_freq(dim, theta) / s["factor"])


def _dynamic(dim: int, theta: float, s: dict[str, Any], n: _Lengths) -> _Frequencies:
    """Dynamic NTK: the base grows with the sequence past the original length; here the
    base HF uses for a sequence of `max_positions` tokens, from the original length on."""
    factor, original = s["factor"], n.max_position_embeddings
    seq_len = max(n.max_positions, original)
    base = theta * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
    return _Frequencies(_default_inv_freq(dim, theta), long_inv_freq=_default_inv_freq(dim, base),
                        switch=original)


def _original_length(s: dict[str, Any], n: _Lengths) -> int:
    return int(s.get("original_max_position_embeddings") or n.max_position_embeddings)


def _yarn(dim: int, theta: float, s: dict[str, Any], n: _Lengths) -> _Frequencies:
    """YaRN: high frequencies kept (extrapolated), low ones divided by `factor`
    (interpolated), a linear ramp between the dims turning `beta_fast` and `beta_slow`
    times over the original length; attention scaled by the mscale ratio."""
    original = _original_length(s, n)
    factor = s.get("factor") or n.max_position_embeddings / original
    powers = theta ** _exponents(dim)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (factor * powers)
    low, high = _yarn_ramp_bounds(dim, theta, original, s)
    keep = 1 - _ramp(low, high, dim // 2)  # share of the original frequency, 1 at high freqs
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    return _Frequencies(inv_freq, attention=_yarn_attention(factor, s))


def _yarn_ramp_bounds(dim: int, theta: float, original: int,
                      s: dict[str, Any]) -> tuple[float, float]:
    """The dims (in halves) where the ramp starts and ends: where a frequency turns
    `beta_fast` resp. `beta_slow` times over the original length; floored and ceiled
    unless `truncate` is false (gpt-oss)."""

    def dim_turning(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(s.get("beta_fast") or 32), dim_turning(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _ramp(low: float, high: float, size: int) -> torch.Tensor:
    """0 up to `low`, 1 from `high`, linear between (a 0.001 wide step where they meet)."""
    if low == high:
        high += 0.001
    return ((torch.arange(size, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)


def _yarn_attention(factor: float, s: dict[str, Any]) -> float:
    """`attention_factor` if given, else 0.1 ln(factor) + 1, or with both `mscale` and
    `mscale_all_dim` (DeepSeek) the ratio of the two mscales."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
    return mscale(factor)


def _longrope(dim: int, theta: float, s: dict[str, Any], n: _Lengths) -> _Frequencies:
    """LongRoPE (Phi-3, Phi-4-mini): a rescale factor per frequency, the short set below
    the original length and the long set from it on; attention scaled by
    sqrt(1 + ln(factor) / ln(original)) unless `attention_factor` is given."""
    original = _original_length(s, n)
    factor = s.get("factor") or n.max_position_embeddings / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    powers = theta ** _exponents(dim)

    def rescaled(name: str) -> torch.Tensor:
        factors = torch.tensor(s[name], dtype=torch.float32)
        if factors.shape != powers.shape:
            raise ValueError(f"longrope {name} has {factors.numel()} entries, "
                             f"expected rotary_dim // 2 = {dim // 2}")
        return 1.0 / (factors * powers)

    return _Frequencies(rescaled("short_factor"), attention=float(attention),
                        long_inv_freq=rescaled("long_factor"), switch=original)


def _llama3(dim: int, theta: float, s: dict[str, Any], n: _Lengths) -> _Frequencies:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept,
    the band between interpolated smoothly."""
    inv_freq = _default_inv_freq(dim, theta)
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = _original_length(s, n)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return _Frequencies(torch.where(medium, blended, scaled))


_VARIANTS: dict[str, Callable[[int, float, dict[str, Any], _Lengths], _Frequencies]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "longrope": _longrope,
    "llama3": _llama3,
}


# -- reading HF configs -----------------------------------------------------------------

def _first(*values: Any) -> Any:
    """The first value that is not None (configs spell "unset" as a missing key or null)."""
    return next((v for v in values if v is not None), None)


def _is_nested(rope: Mapping[str, Any]) -> bool:
    """Whether a rope dict is keyed by layer type: its values are dicts (or null, a
    layer type without rope), where a flat dict holds a type name and numbers."""
    return bool(rope) and all(v is None or isinstance(v, Mapping) for v in rope.values())


def _layer_rope_params(cfg: Mapping[str, Any],
                       layer_type: str | None) -> tuple[dict[str, Any], bool]:
    """The flat rope dict (a copy) that applies to `layer_type`, and whether the config
    keys its rope by layer type."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if _is_nested(rope):
        if layer_type is None:
            raise ValueError(f"rope parameters are per layer type ({', '.join(rope)}): "
                             "name the layer type")
        if rope.get(layer_type) is None:
            raise ValueError(f"no rope parameters for layer type {layer_type!r}")
        return dict(rope[layer_type]), True
    if layer_type == "sliding_attention" and cfg.get("rope_local_base_freq") is not None:
        # legacy Gemma 3: the rope dict is the global layers'; local ones use plain rope
        return {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}, False
    return dict(rope), False


def _rotary_dim(cfg: Mapping[str, Any], params: Mapping[str, Any], head_dim: int) -> int:
    """The rotated dims of a head: `rotary_dim` if the config names it, else head_dim x
    `partial_rotary_factor` (the rope dict's, then the config's; truncated as in HF)."""
    if cfg.get("rotary_dim"):
        return int(cfg["rotary_dim"])
    factor = _first(params.get("partial_rotary_factor"), cfg.get("partial_rotary_factor"), 1.0)
    return int(head_dim * factor)

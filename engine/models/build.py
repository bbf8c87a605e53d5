"""From an HF config to a ModelArch, and from an arch and weights to the family's model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.models import family_of
from engine.models.arch import FULL, ModelArch

if TYPE_CHECKING:
    from engine.attention.base import AttentionBackend
    from engine.models.decoder import DecoderModel
    from engine.platform import ModelPlan


def arch_from_config(cfg: dict[str, Any]) -> ModelArch:
    """ModelArch of a config.json's contents, read through transformers' config class of
    its family; the family's model class adds its own switches and refuses what it
    cannot run exactly (ValueError)."""
    from transformers import AutoConfig

    fam = family_of(cfg)
    model_type = fam.model_types[0]
    hf = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"})
    return fam.model_class().read_arch(hf, _common_fields(hf, model_type))


def _common_fields(hf: Any, model_type: str) -> dict[str, Any]:
    """The fields every decoder family spells the same way in transformers 5."""
    heads = hf.num_attention_heads
    layers = hf.num_hidden_layers
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3)
        rope = dict(rope["full_attention"])
    theta = float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    window = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", True) is False:
        window = None
    max_pos = getattr(hf, "max_position_embeddings", 4096)
    if window and window >= max_pos:  # wider than any context: full attention
        window = None
    types = getattr(hf, "layer_types", None)
    unknown = set(types or ()) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"unsupported attention layer types {sorted(unknown)}")
    windows: tuple[int, ...] = ()
    if window:
        windows = tuple(window if (types is None or types[i] == "sliding_attention") else FULL
                        for i in range(layers))
        if not any(windows):
            windows = ()
    factor = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor) if factor and factor < 1.0 else 0
    return dict(
        model_type=model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=getattr(hf, "intermediate_size", 0) or 0,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=getattr(hf, "rms_norm_eps", 1e-6),
        rope_theta=theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=bool(getattr(hf, "attention_bias", False)),
        rope_scaling=scaling,
        bos_token_id=hf.bos_token_id,
        eos_token_ids=eos_ids,
        layer_windows=windows,
        rotary_dim=rotary_dim,
        architecture=(getattr(hf, "architectures", None) or [""])[0],
        hf_config=hf,
    )


def build_model(arch: ModelArch, weights: dict[str, Any], plan: ModelPlan,
                attn: AttentionBackend, quant_cache: Path | None = None) -> DecoderModel:
    """The family's model over `weights` (HF names), run as `plan` says."""
    return family_of({"model_type": arch.model_type}).model_class()(
        arch, weights, plan, attn, quant_cache)


"""The model layer: one module per family, built from shared layers, and the registry.

- `arch`: ModelArch, what the engine's shared parts know of a model.
- `build`: a config to its ModelArch, an arch and weights to its model.
- `layers`: the building blocks (linears, norms, MLPs, attention, rotary tables).
- `decoder`: DecoderModel, the decoder stack every family is an instance of.
- a module per family (`llama`, `qwen3`, `gemma3`, `phi3`, `smollm3`, `moe_models`):
  its weight names and what departs from Llama.

This module is the registry (torch-free: `tidewire models` reads it): an HF config's
`model_type` (or its `architectures`) to a Family. `engine.models.build` parses a
config through transformers' own config class, so legacy spellings and defaults mean
what they mean there, and constructs the family's model class.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.models.decoder import DecoderModel


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # HF config `model_type`s it serves
    architectures: tuple[str, ...]  # HF `architectures` it serves
    target: str  # "module:Class" of its model class, under engine.models
    examples: str  # models people run, for `tidewire models`

    def model_class(self) -> type[DecoderModel]:
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(f"engine.models.{module}"), cls)  # type: ignore[no-any-return]  # noqa: E501


FAMILIES = (
    Family("llama", ("llama",), ("LlamaForCausalLM",), "llama:LlamaModel",
           "Llama 2, Llama 3.x (3.1 and 3.2 rope scaling), SmolLM2, TinyLlama"),
    Family("mistral", ("mistral",), ("MistralForCausalLM",), "llama:LlamaModel",
           "Mistral 7B (sliding window), Ministral"),
    Family("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), "llama:LlamaModel",
           "Qwen2, Qwen2.5 (yarn long context), DeepSeek-R1 Qwen distills"),
    Family("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), "qwen3:Qwen3Model",
           "Qwen3 0.6B-32B (q/k norms)"),
    Family("smollm3", ("smollm3",), ("SmolLM3ForCausalLM",), "smollm3:SmolLM3Model",
           "SmolLM3-3B (no rotary on every fourth layer)"),
    Family("phi3", ("phi3",), ("Phi3ForCausalLM",), "phi3:Phi3Model",
           "Phi-3, Phi-3.5-mini, Phi-4-mini (fused projections, partial rotary, longrope)"),
    Family("gemma3", ("gemma3_text",), ("Gemma3ForCausalLM",), "gemma3:Gemma3Model",
           "gemma-3-270m, gemma-3-1b (local and global layers, (1+w) norms, GeGLU)"),
    Family("qwen3_moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",), "moe_models:Qwen3MoeModel",
           "Qwen3-30B-A3B (128 experts, 8 active)"),
    Family("mixtral", ("mixtral",), ("MixtralForCausalLM",), "moe_models:MixtralModel",
           "Mixtral 8x7B (8 experts, 2 active)"),
    Family("olmoe", ("olmoe",), ("OlmoeForCausalLM",), "moe_models:OlmoeModel",
           "OLMoE-1B-7B (64 experts, 8 active)"),
)
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_ARCH = {a: f for f in FAMILIES for a in f.architectures}
SUPPORTED_MODEL_TYPES = tuple(_BY_TYPE)


def family_of(cfg: dict[str, Any]) -> Family:
    """The family of a config.json's contents, by `model_type`, else `architectures`."""
    fam = _BY_TYPE.get(cfg.get("model_type", "llama"))
    if fam is None:
        fam = next((_BY_ARCH[a] for a in cfg.get("architectures") or [] if a in _BY_ARCH), None)
    if fam is None:
        raise ValueError(
            f"unsupported model_type {cfg.get('model_type')!r} "
            f"(architectures {cfg.get('architectures')}); supported: "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))} (`tidewire models` lists them)")
    return fam


__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "Family", "family_of"]

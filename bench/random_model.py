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

# Published shapes of the families' small models (random weights), as (transformers
# config class, its arguments). Phi-4-mini and Qwen3-30B-A3B at reduced depth (noted),
# so that they fit a laptop's memory beside everything else.
SHAPES: dict[str, tuple[str, dict]] = {
    # Llama-3.2-1B (GQA 32/8, head_dim 64, tied embeddings)
    "llama-1b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0,
        bos_token_id=1, eos_token_id=2)),
    # Llama-3.2-3B (GQA 24/8, head_dim 128, tied embeddings)
    "llama-3b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0,
        bos_token_id=1, eos_token_id=2)),
    # Qwen3-1.7B (q/k norms, head_dim 128)
    "qwen3-1.7b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, tie_word_embeddings=True, rope_theta=1000000.0,
        bos_token_id=1, eos_token_id=2)),
    # gemma-3-1b (5 local layers of a 512-token window to 1 global, head_dim 256, MQA)
    "gemma3-1b": ("Gemma3TextConfig", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        query_pre_attn_scalar=256, max_position_embeddings=32768, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, bos_token_id=2, eos_token_id=1, pad_token_id=0)),
    # Phi-4-mini at 16 of its 32 layers (partial rotary 0.75, fused projections)
    "phi4-mini-16l": ("Phi3Config", dict(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75,
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)),
    # SmolLM3-3B (NoPE on every 4th layer)
    "smollm3-3b": ("SmolLM3Config", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=65536,
        tie_word_embeddings=True, rope_theta=5000000.0, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)),
    # Qwen3-30B-A3B at 6 of its 48 layers (128 experts of 768, 8 active)
    "qwen3-moe-a3b-6l": ("Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=6,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make(out: Path, config_dir: Path | None = None, shape: str | None = None,
         dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    if (config_dir is None) == (shape is None):
        raise ValueError("give exactly one of config_dir and shape")
    if config_dir is not None:
        config = AutoConfig.from_pretrained(str(config_dir))
    else:
        assert shape is not None
        config_class, kwargs = SHAPES[shape]
        config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # (fast init)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
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

from __future__ import annotations

import json
import time

import pytest

from engine.loader import REGISTRY, load_tokenizer, load_weights, resolve_model
from engine.models.arch import ModelArch


def test_registry_gguf_is_converted_once_and_cached(smollm2_dir) -> None:
    assert (smollm2_dir / "model.safetensors").exists()
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    t = time.monotonic()
    assert resolve_model("smollm2-135m") == smollm2_dir  # cached: no conversion
    assert time.monotonic() - t < 2.0
    arch = ModelArch.from_dir(smollm2_dir)
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (30, 9, 3, 64)
    assert arch.tie_word_embeddings and arch.rope_theta == 100000.0
    tok = load_tokenizer(smollm2_dir)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template


def test_hf_directory_loads(tiny_models) -> None:
    path = tiny_models("llama", 0)
    assert resolve_model(str(path)) == path
    w = load_weights(path)
    assert "model.layers.0.self_attn.q_proj.weight" in w
    assert load_tokenizer(path) is None


def test_unknown_model_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="registry name"):
        resolve_model(str(tmp_path / "nope"))
    assert "smollm2-135m" in REGISTRY


def test_unsupported_architecture_is_rejected() -> None:
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelArch.from_hf_config({"model_type": "gpt2", "num_attention_heads": 2})


def test_rope_scaling_parsed() -> None:
    cfg = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    arch = ModelArch.from_hf_config(cfg)
    assert arch.rope_theta == 500000.0 and arch.rope_scaling["rope_type"] == "llama3"

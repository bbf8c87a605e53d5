"""KV blocks a long request holds with a sliding window on every layer, against the same
model with full attention: one prompt of `--context` tokens prefilled in chunks, then a
few decodes, counting the blocks its table holds after every step.

    python -m bench.kv_window --context 16384 --window 4096

Random weights of a small Mistral shape (the counts depend on the context, the window,
the block size and the step's tokens, not on the weights); the bytes are given for the
`--bytes-shape` too (Mistral-7B's KV: 32 layers, 8 KV heads of 128, bf16).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def held_blocks(model_dir: Path, context: int, block_size: int, chunk: int) -> dict:
    """Run one request of `context` prompt tokens; the most blocks it held at once."""
    from engine import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", block_size=block_size,
              max_num_batched_tokens=chunk, num_kv_blocks=context // block_size + 64,
              kv_tier="none")
    eng = llm.engine
    prompt = torch.randint(3, 300, (context,), generator=torch.Generator().manual_seed(0))
    eng.add(eng.make_request(prompt.tolist(), SamplingParams(max_tokens=8, ignore_eos=True,
                                                             temperature=0.0), "long"))
    most, t0 = 0, time.monotonic()
    while eng.has_unfinished():
        eng.step()
        most = max(most, sum(b.ref_cnt > 0 for b in eng.kv.tables.get("long", [])))
    return {"max_blocks_held": most, "released": eng.kv.num_released,
            "seconds": round(time.monotonic() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    from transformers import MistralConfig, MistralForCausalLM

    # Mistral-7B's KV bytes a token: 32 layers x K and V x 8 heads x 128 x 2 bytes
    kv_bytes_per_token = 32 * 2 * 8 * 128 * 2
    out = {"context": a.context, "window": a.window, "block_size": a.block_size}
    with tempfile.TemporaryDirectory() as tmp:
        for name, window in (("full", None), ("sliding", a.window)):
            torch.manual_seed(0)
            cfg = MistralConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=1, max_position_embeddings=a.context + 64,
                                sliding_window=window)
            d = Path(tmp) / name
            MistralForCausalLM(cfg).save_pretrained(d)
            r = held_blocks(d, a.context, a.block_size, a.chunk)
            r["mistral_7b_kv_mib"] = round(
                r["max_blocks_held"] * a.block_size * kv_bytes_per_token / (1 << 20))
            out[name] = r
            print(f"{name:>8}: at most {r['max_blocks_held']} blocks held "
                  f"({r['mistral_7b_kv_mib']} MiB of a Mistral-7B's KV), "
                  f"{r['released']} released, {r['seconds']} s")
    print(f"sliding / full: {out['sliding']['max_blocks_held'] / out['full']['max_blocks_held']:.3f}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

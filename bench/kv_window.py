"""KV a long request holds with sliding windows, against the same model with full
attention: one prompt of `--context` tokens prefilled in chunks, then a few decodes,
counting what its block table holds after every step.

    python -m bench.kv_window --context 16384 --window 4096          # Mistral: every layer
    python -m bench.kv_window --family gemma3 --context 16384 --window 512

Random weights of a small shape of the family (the counts depend on the context, the
window, the block size and the step's tokens, not on the weights):
- mistral: a window on every layer, so the blocks behind it go back to the pool; the
  bytes are given for Mistral-7B's KV (32 layers, 8 KV heads of 128, bf16);
- gemma3: five local layers to one global, so the blocks behind the window keep only the
  global layers (block_manager.HybridPool); the bytes are given for gemma-3-1b's KV
  (22 local and 4 global layers, one KV head of 256, bf16).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

# (KV bytes a token in one layer, layers, of them global) of the models the bytes name
MISTRAL_7B = (2 * 8 * 128 * 2, 32, 32)
GEMMA3_1B = (2 * 1 * 256 * 2, 26, 4)


def held(model_dir: Path, context: int, block_size: int, chunk: int,
         num_full: int = 0) -> dict:
    """Run one request of `context` prompt tokens; the most it held at once, in blocks
    with room in every layer (`full`) and in global-only ones (`global_only`)."""
    from engine import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", block_size=block_size,
              max_num_batched_tokens=chunk, num_kv_blocks=context // block_size + 64,
              num_full_kv_blocks=num_full, kv_tier="none")
    eng = llm.engine
    nf = eng.kv.pool.num_full
    prompt = torch.randint(3, 300, (context,), generator=torch.Generator().manual_seed(0))
    eng.add(eng.make_request(prompt.tolist(), SamplingParams(max_tokens=8, ignore_eos=True,
                                                             temperature=0.0), "long"))
    full = glob = 0
    t0 = time.monotonic()
    while eng.has_unfinished():
        eng.step()
        table = [b for b in eng.kv.tables.get("long", []) if b.ref_cnt > 0]
        full = max(full, sum(b.block_id < nf for b in table))
        glob = max(glob, sum(b.block_id >= nf for b in table))
    return {"full": full, "global_only": glob, "released": eng.kv.num_released,
            "moved": eng.kv.num_moved, "seconds": round(time.monotonic() - t0, 1)}


def _model(family: str, window: int | None, context: int, path: Path) -> None:
    torch.manual_seed(0)
    small = dict(vocab_size=320, hidden_size=64, intermediate_size=128,
                 num_attention_heads=2, num_key_value_heads=1,
                 max_position_embeddings=context + 64)
    if family == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        MistralForCausalLM(MistralConfig(num_hidden_layers=2, sliding_window=window,
                                         **small)).save_pretrained(path)
        return
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    types = ["full_attention" if window is None or i % 6 == 5 else "sliding_attention"
             for i in range(6)]
    Gemma3ForCausalLM(Gemma3TextConfig(num_hidden_layers=6, head_dim=32,
                                       sliding_window=window or 512, layer_types=types,
                                       **small)).save_pretrained(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=("mistral", "gemma3"), default="mistral")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    per_layer, layers, glob_layers = MISTRAL_7B if a.family == "mistral" else GEMMA3_1B
    named = "Mistral-7B" if a.family == "mistral" else "gemma-3-1b"
    out = {"family": a.family, "context": a.context, "window": a.window,
           "block_size": a.block_size}
    with tempfile.TemporaryDirectory() as tmp:
        for name, window in (("full", None), ("sliding", a.window)):
            d = Path(tmp) / name
            _model(a.family, window, a.context, d)
            # (gemma3: full blocks for one request's window and chunk, the rest global)
            num_full = (a.window + a.chunk) // a.block_size + 4 \
                if a.family == "gemma3" and window else 0
            r = held(d, a.context, a.block_size, a.chunk, num_full)
            layer_blocks = r["full"] * layers + r["global_only"] * glob_layers
            r["kv_mib"] = round(layer_blocks * a.block_size * per_layer / (1 << 20))
            r["layer_blocks"] = layer_blocks
            out[name] = r
            print(f"{name:>8}: at most {r['full']} full blocks and {r['global_only']} "
                  f"global-only held ({r['kv_mib']} MiB of a {named}'s KV), "
                  f"{r['released']} released, {r['moved']} moved, {r['seconds']} s")
    ratio = out["sliding"]["layer_blocks"] / out["full"]["layer_blocks"]
    print(f"sliding / full (KV bytes held): {ratio:.3f}")
    out["ratio"] = round(ratio, 3)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""`tidewire bench accuracy`: what the quantized paths cost in accuracy, measured the way
llama.cpp's perplexity tool does: a text fed token by token, teacher-forced.

Each Tidewire configuration (bf16, int8 KV cache, int8 or int4 weights; --configs), and
each GGUF of the same model run as stored (--gguf: Q8_0, Q4_K_M, ... files made from it), runs
the text through its real decode path, one token a step (the compiled decode step where
it applies, the paged kernels, the quantizing cache write), and the next-token
distribution of every position is compared with HF transformers' in fp32 on the same
weights: the share of positions whose top-1 token agrees, the mean KL divergence from
the fp32 distribution, and each configuration's perplexity on the text.

--prefill-chunk N feeds the text instead as prefill chunks of N tokens, every position's
logits computed: the batched kernels (the GEMMs, GGUF's integer GEMM with its int8 x)
rather than the decode step's.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

CONFIGS = {  # name -> LLM keywords ("none": a .gguf --model dequantized, not run as stored)
    "fp32": dict(dtype="float32", quantization="none"),  # the control: equals the reference
    "bf16": dict(dtype="bfloat16", quantization="none"),
    "bf16+kv-int8": dict(dtype="bfloat16", quantization="none", kv_cache_dtype="int8"),
    "w-int8": dict(dtype="bfloat16", quantization="int8"),
    "w-int8+kv-int8": dict(dtype="bfloat16", quantization="int8", kv_cache_dtype="int8"),
    "w-int4": dict(dtype="bfloat16", quantization="int4"),
    # a .gguf --model's own blocks as stored (the reference is its dequantized values)
    "gguf": dict(dtype="bfloat16", quantization="gguf"),
    # the same in fp32: the exact sums (float32 named), and this machine's own choice
    # (auto: fp32 with x in int8 into the blocks where the CPU has no native bf16)
    "gguf-fp32": dict(dtype="float32", quantization="gguf"),
    "gguf-auto": dict(dtype="auto", quantization="gguf"),
    "fp32+kv-int8": dict(dtype="float32", quantization="none", kv_cache_dtype="int8"),
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="registry name, HF model directory or .gguf file")
    p.add_argument("--text", default=None,
                   help="a text file (default: the repository's README.md)")
    p.add_argument("--tokens", type=int, default=2000, help="tokens of the text to score")
    p.add_argument("--configs", default="bf16,bf16+kv-int8,w-int8,w-int8+kv-int8",
                   help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--gguf", nargs="*", default=[], metavar="FILE",
                   help="GGUF files of the same model (the same vocabulary: made from "
                        "--model by llama.cpp's converter and quantizer), each run as stored "
                        "(quantization gguf, bf16) and scored against --model's fp32")
    p.add_argument("--prefill-chunk", type=int, default=0, metavar="N",
                   help="score through prefill chunks of N tokens (the batched kernels) "
                        "instead of one token a step (default: 0, the decode path)")
    p.add_argument("--json", default=None, help="also write the results here")


def _text(path: str | None) -> str:
    if path:
        return Path(path).read_text()
    readme = Path(__file__).resolve().parents[1] / "README.md"
    if not readme.exists():
        raise SystemExit("no README.md next to the bench package: pass --text FILE")
    return readme.read_text()


@torch.inference_mode()
def reference_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """HF transformers, fp32, one forward: log-probabilities [len(ids), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    logits = model(torch.tensor([ids])).logits[0]
    return F.log_softmax(logits.float(), -1)


@torch.inference_mode()
def forced_logprobs(llm: Any, ids: list[int]) -> torch.Tensor:
    """The engine's decode path fed `ids` one token a step in one sequence (blocks 0..n
    of the pool, positions 0..n-1): log-probabilities [len(ids), vocab]."""
    from engine.attention.base import StepLayout

    runner = llm.engine.runner
    bs = runner.block_size
    blocks = list(range(-(-len(ids) // bs)))
    assert len(blocks) <= llm.engine.num_blocks, "the KV pool is too small for the text"
    rows = torch.zeros(1, dtype=torch.long)
    out = []
    for pos, tok in enumerate(ids):
        layout = StepLayout(slot_mapping=[pos], decode_seq_lens=[pos + 1],
                            decode_block_ids=[blocks[: pos // bs + 1]], prefills=[])
        meta = runner.attn.build_metadata(layout)
        x, p = torch.tensor([tok]), torch.tensor([pos])
        if runner.compiled_step is not None:
            logits = runner.compiled_step.run(x, p, meta)
        else:
            logits = runner.model.forward(x, p, runner.kv_caches, meta, rows)
        out.append(F.log_softmax(logits[0].float(), -1))
    return torch.stack(out)


def chunked_logprobs(llm: Any, ids: list[int], chunk: int) -> torch.Tensor:
    """The engine's prefill path fed `ids` in chunks of `chunk` tokens of one sequence
    (blocks 0..n of the pool), the logits of every row kept: log-probabilities
    [len(ids), vocab]."""
    from engine.attention.base import PrefillSpec, StepLayout

    runner = llm.engine.runner
    bs = runner.block_size
    blocks = list(range(-(-len(ids) // bs)))
    assert len(blocks) <= llm.engine.num_blocks, "the KV pool is too small for the text"
    out = []
    for c0 in range(0, len(ids), chunk):
        c1 = min(len(ids), c0 + chunk)
        layout = StepLayout(slot_mapping=list(range(c0, c1)), decode_seq_lens=[],
                            decode_block_ids=[],
                            prefills=[PrefillSpec(0, c1 - c0, c1, blocks[: -(-c1 // bs)])])
        meta = runner.attn.build_metadata(layout)
        logits = runner.model.forward(torch.tensor(ids[c0:c1]), torch.arange(c0, c1),
                                      runner.kv_caches, meta, torch.arange(c1 - c0))
        out.append(F.log_softmax(logits.float(), -1))
    return torch.cat(out)


def compare(ref: torch.Tensor, got: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """Top-1 agreement and mean KL(ref || got) over positions 0..n-2 (each predicting
    the next token), and got's perplexity of ids[1:]."""
    r, g = ref[:-1], got[:-1]
    nxt = torch.tensor(ids[1:])
    kl = (r.exp() * (r - g)).sum(-1)
    return {"top1_agreement": float((r.argmax(-1) == g.argmax(-1)).float().mean()),
            "mean_kl": float(kl.mean()),
            "perplexity": math.exp(float(-g.gather(1, nxt[:, None]).mean()))}


def main(a: argparse.Namespace) -> int:
    from engine import LLM
    from engine.loader import resolve_model

    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config {unknown}; choose from {', '.join(CONFIGS)}")
    model_dir = resolve_model(a.model)
    first = LLM(model=a.model, **CONFIGS[names[0]], enable_prefix_caching=False)
    ids = first.tokenizer(_text(a.text))["input_ids"][: a.tokens]
    first.close()
    ref = reference_logprobs(model_dir, ids)
    results: dict[str, Any] = {
        "model": a.model, "tokens": len(ids), "prefill_chunk": a.prefill_chunk,
        "fp32_perplexity": math.exp(float(-ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean())),
        "configs": {}}
    print(f"{len(ids)} tokens; HF fp32 perplexity {results['fp32_perplexity']:.3f}")
    print(f"{'config':<18} {'top-1 vs fp32':>14} {'mean KL':>10} {'perplexity':>11}")
    runs = [(name, a.model, CONFIGS[name]) for name in names]
    runs += [(Path(f).name, f, CONFIGS["gguf"]) for f in a.gguf]
    for name, model, kw in runs:
        llm = LLM(model=model, **kw, enable_prefix_caching=False,
                  max_num_seqs=1, max_model_len=len(ids) + 16)
        got = (chunked_logprobs(llm, ids, a.prefill_chunk) if a.prefill_chunk > 0
               else forced_logprobs(llm, ids))
        r = compare(ref, got, ids)
        llm.close()
        results["configs"][name] = r
        print(f"{name:<18} {100 * r['top1_agreement']:>13.2f}% {r['mean_kl']:>10.5f} "
              f"{r['perplexity']:>11.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0

"""`tidewire bench spec`: decode speed with and without speculative decoding, side by side
in one run, on one engine (a request opts out with `speculative=False`):

- a repetitive workload: the model is asked to reproduce source files of this
  repository (where prompt lookup fits), one stream at a time and 8 at once;
- chat-64: random prompts, where proposals mostly miss and the off-switch must keep
  the cost down.

Greedy, so the outputs with and without must be the same tokens (checked). Reports
decode tokens/s (the tokens after every request of a batch has its first: prefill is
not what speculation speeds up), the speed-up, acceptance (accepted over proposed) and accepted tokens per
verifying step. `--draft-model` adds the draft proposer (a second engine)."""

from __future__ import annotations

import argparse
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.workloads import chat64

ROOT = Path(__file__).resolve().parents[1]
# files the repetitive workload asks the model to reproduce (first ~60 lines each)
DOCS = ("engine/block_manager.py", "engine/request.py", "engine/scheduler.py",
        "engine/detokenizer.py", "engine/kv_io.py", "engine/progress.py",
        "engine/stats.py", "engine/sampling_params.py")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="registry name, HF model directory or .gguf file")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="weights and activations (auto: bfloat16 on a GPU or a CPU with "
                        "AVX512-BF16/AMX, else float32)")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="tokens proposed per request per step")
    p.add_argument("--draft-model", default=None,
                   help="also measure the draft proposer with this model")
    p.add_argument("--doc-lines", type=int, default=40,
                   help="lines of each source file in the repetitive prompts")
    p.add_argument("--max-tokens", type=int, default=160,
                   help="output tokens per repetitive request (at most; EOS ends it)")
    p.add_argument("--chat-requests", type=int, default=64,
                   help="requests of the chat workload (0: skip it)")
    p.add_argument("--rounds", type=int, default=2, help="repetitions; the best is kept")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: one per physical core)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")


def repetitive_prompts(llm: Any, lines: int) -> list[list[int]]:
    """One prompt per file: the file, then a request to write it out again."""
    eng = llm.engine
    out = []
    for name in DOCS:
        text = "\n".join((ROOT / name).read_text().splitlines()[:lines])
        ask = f"Here is a Python file:\n\n```python\n{text}\n```\n\nWrite the same file " \
              "out again, unchanged, in a code block."
        try:
            ids = eng.apply_chat_template([{"role": "user", "content": ask}])
        except ValueError:  # no chat template
            ids = eng.tokenize(ask + "\n\n```python\n")
        out.append(ids)
    return out


@dataclass
class Run:
    tokens: dict[str, list[int]]
    decode_tok_s: float  # output tokens after every request had its first, per second
    seconds: float
    spec: tuple[int, int, int]  # (verifying steps, proposed, accepted), summed


def _run(llm: Any, prompts: list[list[int]], max_tokens: list[int], spec: bool,
         ignore_eos: bool) -> Run:
    """Drive the engine step by step, timing every token: decode speed counts the
    tokens that come after the last request's first token (prefill excluded)."""
    from engine import SamplingParams

    eng = llm.engine
    ids = []
    for p, m in zip(prompts, max_tokens):
        params = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=ignore_eos,
                                speculative=spec)
        req = eng.make_request(p, params, f"bench-{uuid.uuid4().hex}")
        eng.add(req)
        ids.append(req.request_id)
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    stamps: list[tuple[float, int]] = []
    first: dict[str, float] = {}
    steps = proposed = accepted = 0
    t0 = time.perf_counter()
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
            first.setdefault(o.request_id, now)
            stamps.append((now, len(o.new_token_ids)))
            if o.finished and o.spec is not None:
                steps, proposed, accepted = (steps + o.spec[0], proposed + o.spec[1],
                                             accepted + o.spec[2])
    end = time.perf_counter()
    start = max(first.values())
    after = sum(n for t, n in stamps if t > start)
    rate = after / (end - start) if end > start else 0.0
    return Run(tokens, rate, end - t0, (steps, proposed, accepted))


def compare(llm: Any, prompts: list[list[int]], max_tokens: list[int], rounds: int,
            ignore_eos: bool, batch: int) -> dict[str, Any]:
    """Without and with speculation, alternating, `batch` requests at a time; the best
    round of each. Greedy: both must give the same tokens."""
    best: dict[bool, float] = {}
    runs: dict[bool, list[Run]] = {}
    for _ in range(rounds):
        for spec in (False, True):
            got = [_run(llm, prompts[i: i + batch], max_tokens[i: i + batch], spec, ignore_eos)
                   for i in range(0, len(prompts), batch)]
            # decode speed of the round: its batches' decode tokens over their decode time
            tok = sum(r.decode_tok_s * 1.0 for r in got)
            rate = tok / len(got)
            best[spec] = max(best.get(spec, 0.0), rate)
            runs[spec] = got
    toks = {s: [t for r in runs[s] for t in r.tokens.values()] for s in (False, True)}
    same = [a == b for a, b in zip(toks[False], toks[True])]
    steps = sum(r.spec[0] for r in runs[True])
    proposed = sum(r.spec[1] for r in runs[True])
    accepted = sum(r.spec[2] for r in runs[True])
    r = {"requests": len(prompts), "batch": batch,
         "output_tokens": sum(len(t) for t in toks[True]),
         "tok_s_without": best[False], "tok_s_with": best[True],
         "speedup": best[True] / best[False] if best[False] else 0.0,
         "acceptance": accepted / proposed if proposed else 0.0,
         "accepted_per_step": accepted / steps if steps else 0.0,
         "verifying_steps": steps, "identical_outputs": all(same)}
    if not all(same):
        bad = [i for i, s in enumerate(same) if not s]
        print(f"  WARNING: outputs differ with speculation for requests {bad}")
    return r


def _line(name: str, r: dict[str, Any]) -> str:
    return (f"{name:<28} {r['tok_s_without']:8.1f} {r['tok_s_with']:8.1f} {r['speedup']:6.2f}x"
            f"  acceptance {r['acceptance']:.2f}, {r['accepted_per_step']:.2f} accepted/step"
            f"{'' if r['identical_outputs'] else '  OUTPUTS DIFFER'}")


def measure(llm: Any, a: argparse.Namespace, label: str) -> dict[str, Any]:
    prompts = repetitive_prompts(llm, a.doc_lines)
    res: dict[str, Any] = {}
    n = [a.max_tokens] * len(prompts)
    res["repetitive_single"] = compare(llm, prompts[:4], n[:4], a.rounds, False, 1)
    print(_line(f"{label} repetitive, 1 stream", res["repetitive_single"]))
    res["repetitive_batch8"] = compare(llm, prompts, n, a.rounds, False, 8)
    print(_line(f"{label} repetitive, batch 8", res["repetitive_batch8"]))
    if a.chat_requests:
        work = chat64(llm.engine.arch.vocab_size, a.chat_requests, 0)
        res["chat64"] = compare(llm, [w.prompt_token_ids for w in work],
                                [w.max_tokens for w in work], 1, True, len(work))
        print(_line(f"{label} chat-{a.chat_requests}", res["chat64"]))
    return res


def main(a: argparse.Namespace) -> int:
    from engine import LLM

    common = dict(dtype=a.dtype, threads=a.threads,
                  num_speculative_tokens=a.num_speculative_tokens)
    llm = LLM(model=a.model, speculative="ngram", **common)
    print(f"model {a.model} ({llm.engine.dtype_name}), k = {a.num_speculative_tokens}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'':<28} {'without':>8} {'with':>8} {'speed-up':>7}   (decode tok/s)")
    result: dict[str, Any] = {"model": a.model, "dtype": llm.engine.dtype_name,
                              "k": a.num_speculative_tokens, "ngram": measure(llm, a, "ngram")}
    if a.draft_model:
        del llm
        llm = LLM(model=a.model, speculative="draft", draft_model=a.draft_model, **common)
        result["draft"] = measure(llm, a, "draft")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {a.json}")
    return 0

"""`tidewire bench cascade`: shared-prefix (cascade) attention on and off, side by side.

1. The kernel: decodes of `n` sequences that share `P` prefix keys and hold 64 of their
   own, timed with and without the cascade. On the CPU backend: the table its cost
   rule (engine/attention/cpu.py) was read from. On a CUDA GPU: kernels/
   cascade_attention.py with its prefix pass in one key partition and in as many as it
   picks, against what the backend runs without it (split-K decode from 2,048 keys, the
   paged kernel below).
2. The engine: chat-64 lengths behind one shared system prompt of --prefix-tokens tokens
   (cached once first, so every request holds the same prefix blocks), output tok/s with
   the cascade and without it, alternating, --rounds each.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Callable

import torch


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="registry name, HF model directory or .gguf file")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="the weights' dtype (auto: bfloat16 on a CPU with AVX512-BF16/AMX)")
    p.add_argument("--prefix-tokens", type=int, default=2000,
                   help="the shared system prompt's length")
    p.add_argument("--num-requests", type=int, default=64,
                   help="requests behind the shared prompt (chat-64's lengths after it)")
    p.add_argument("--rounds", type=int, default=2, help="engine runs per setting")
    p.add_argument("--attention-backend", default=None, choices=["cpu", "cuda"],
                   help="the engine's backend (default: cuda where a GPU is present, else cpu)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                   help="the engine's KV pool (the prefix once, plus every request's own)")
    p.add_argument("--skip-kernel", action="store_true", help="only the engine comparison")
    p.add_argument("--skip-engine", action="store_true", help="only the kernel table")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")


def _best_us(fn: Callable[[], Any], repeats: int = 30) -> float:
    from bench.kernels import best_seconds

    return best_seconds(fn, repeats) * 1e6


def kernel_case(n: int, shared: int, own: int = 64, heads: int = 9, kv_heads: int = 3,
                d: int = 64, bs: int = 16, dtype: torch.dtype = torch.bfloat16) -> dict:
    """n decodes whose block tables begin with the same shared // bs blocks."""
    from kernels import cpu_ops

    pb, ob = shared // bs, -(-own // bs)
    g = torch.Generator().manual_seed(n * 7919 + shared)
    kc = torch.randn(kv_heads, pb + n * ob, bs, d, generator=g).to(dtype)
    vc = torch.randn(kv_heads, pb + n * ob, bs, d, generator=g).to(dtype)
    table = torch.tensor([list(range(pb)) + list(range(pb + i * ob, pb + (i + 1) * ob))
                          for i in range(n)], dtype=torch.int32)
    lens = torch.full((n,), shared + own, dtype=torch.int32)
    starts = torch.arange(n + 1, dtype=torch.int32)
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    out = torch.empty_like(q)
    groups = (torch.arange(n, dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
              torch.tensor([shared], dtype=torch.int32))

    def run(cascade: Any) -> Callable[[], None]:
        return lambda: cpu_ops.paged_attention(out, q, kc, vc, table, lens, starts, d**-0.5, n,
                                               cascade=cascade)
    plain, cascade = _best_us(run(None)), _best_us(run(groups))
    return {"members": n, "shared_keys": shared, "plain_us": plain, "cascade_us": cascade,
            "speedup": plain / cascade}


def cuda_kernel_case(n: int, shared: int, heads: int, kv_heads: int, own: int = 64,
                     d: int = 64, bs: int = 16, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The same decodes on the GPU: plain (the backend's choice without a cascade),
    cascade with the prefix in one partition, and with the partitions it picks."""
    from bench.kernels import _time
    from engine.attention.triton import SPLIT_K_MIN_CONTEXT, SPLIT_K_PARTITION_BLOCKS
    from kernels.cascade_attention import CascadePrefix, cascade_attention
    from kernels.paged_attention import paged_attention
    from kernels.paged_decode_splitk import paged_decode_splitk

    dev = "cuda"
    pb, ob = shared // bs, -(-own // bs)
    kc = torch.randn(pb + n * ob, bs, kv_heads, d, dtype=dtype, device=dev)
    vc = torch.randn_like(kc)
    table = torch.tensor([list(range(pb)) + list(range(pb + i * ob, pb + (i + 1) * ob))
                          for i in range(n)], dtype=torch.int32, device=dev)
    ctx = shared + own
    lens = torch.full((n,), ctx, dtype=torch.int32, device=dev)
    starts = torch.arange(n + 1, dtype=torch.int32, device=dev)
    q = torch.randn(n, heads, d, dtype=dtype, device=dev)
    scale = d**-0.5
    # planned once per step in the engine (build_metadata), so outside the timed calls
    plans = {p: CascadePrefix.build(table[0, :pb], shared, bs, n, heads, kv_heads, dev, parts=p)
             for p in (1, None)}

    def plain() -> Any:
        if ctx >= SPLIT_K_MIN_CONTEXT:
            return paged_decode_splitk(q, kc, vc, table, lens, scale, ctx,
                                       SPLIT_K_PARTITION_BLOCKS)
        return paged_attention(q, kc, vc, table, lens, starts, scale, 1)

    def cascade(parts: int | None) -> Callable[[], Any]:
        return lambda: cascade_attention(q, kc, vc, plans[parts], table, lens, starts, scale,
                                         1, validate=False)
    torch.testing.assert_close(cascade(None)().float(), plain().float(), atol=2e-2, rtol=2e-2)
    parts = plans[None].parts
    t = {k: _time(f, 50) * 1e6 for k, f in
         (("plain", plain), ("one_part", cascade(1)), ("parts", cascade(None)))}
    return {"members": n, "shared_keys": shared, "heads": heads, "kv_heads": kv_heads,
            "plain_us": t["plain"], "one_part_us": t["one_part"], "cascade_us": t["parts"],
            "parts": parts, "speedup": t["plain"] / t["parts"]}


def engine_case(a: argparse.Namespace) -> dict:
    from bench.offline import run_tidewire
    from bench.workloads import BenchRequest, chat64
    from engine import LLM, SamplingParams

    backend = a.attention_backend or ("cuda" if torch.cuda.is_available() else "cpu")
    llm = LLM(model=a.model, dtype=a.dtype, max_num_seqs=a.num_requests,
              attention_backend=backend, kv_cache_memory=int(a.kv_cache_memory_gb * (1 << 30)))
    attn = llm.engine.runner.attn
    if not hasattr(attn, "cascade"):
        raise SystemExit(f"the {attn.name} backend has no shared-prefix switch")
    vocab = llm.engine.arch.vocab_size
    system = [100 + (j * 7919) % (vocab - 100) for j in range(a.prefix_tokens)]
    llm.generate([system + [5]], SamplingParams(max_tokens=1))  # the prefix, cached once
    work = [BenchRequest(system + r.prompt_token_ids, r.max_tokens)
            for r in chat64(vocab, a.num_requests, prompt_range=(20, 300),
                            output_range=(16, 256))]
    run_tidewire(llm, work)  # untimed: the first pass pays one-time costs (oneDNN kernels
    # for each batch size, page faults), which would count against whichever setting ran first
    runs: dict[bool, list[float]] = {True: [], False: []}
    steps: list[int] = []  # steps that took the cascade per run with it (the Triton backend)
    for _ in range(a.rounds):
        for setting in (True, False):
            attn.cascade = setting
            before = getattr(attn, "cascade_steps", 0)
            runs[setting].append(run_tidewire(llm, work)["output_tok_s"])
            if setting and hasattr(attn, "cascade_steps"):
                steps.append(attn.cascade_steps - before)
            print(f"  cascade {'on' if setting else 'off'}: {runs[setting][-1]:.1f} tok/s"
                  + (f", {steps[-1]} steps took it" if setting and steps else ""), flush=True)
    attn.cascade = True
    on, off = statistics.median(runs[True]), statistics.median(runs[False])
    return {"model": a.model, "attention_backend": backend, "prefix_tokens": a.prefix_tokens,
            "requests": a.num_requests,
            "cascade_tok_s": on, "plain_tok_s": off, "speedup": on / off,
            "runs": {"cascade": runs[True], "plain": runs[False]}, "cascade_steps": steps}


def main(a: argparse.Namespace) -> int:
    result: dict[str, Any] = {"threads": torch.get_num_threads()}
    if not a.skip_kernel and torch.cuda.is_available():
        rows = [cuda_kernel_case(n, p, h, kvh) for h, kvh in ((9, 3), (32, 8))
                for n in (8, 16, 64, 256) for p in (256, 2048, 8192)]
        result["cuda_kernel"] = rows
        print(f"kernel ({torch.cuda.get_device_name()}): decodes sharing a prefix, d64 bf16, "
              "64 own keys each")
        for r in rows:
            print(f"  {r['heads']:2d}/{r['kv_heads']} heads, {r['members']:3d} sequences, "
                  f"{r['shared_keys']:5d} shared keys: plain {r['plain_us']:7.1f} us, "
                  f"cascade in 1 part {r['one_part_us']:7.1f} us, in {r['parts']:2d} parts "
                  f"{r['cascade_us']:7.1f} us, {r['speedup']:.2f}x")
    elif not a.skip_kernel:
        from kernels import cpu_ops

        result["amx"] = cpu_ops.amx()
        if not cpu_ops.available():
            print("the compiled CPU kernels are unavailable here: no kernel table")
        else:
            rows = [kernel_case(n, p) for n in (2, 4, 8, 16, 64) for p in (64, 256, 2048)]
            result["kernel"] = rows
            print(f"kernel (AMX {cpu_ops.amx()}): decodes sharing a prefix, 9/3 heads d64 bf16")
            for r in rows:
                print(f"  {r['members']:3d} sequences, {r['shared_keys']:5d} shared keys: "
                      f"plain {r['plain_us']:8.1f} us, cascade {r['cascade_us']:8.1f} us, "
                      f"{r['speedup']:.2f}x")
    if not a.skip_engine:
        e = engine_case(a)
        result["engine"] = e
        print(f"engine: {e['requests']} requests behind a {e['prefix_tokens']}-token shared "
              f"prompt ({e['model']}, {e['attention_backend']} backend): cascade "
              f"{e['cascade_tok_s']:.1f} tok/s, without "
              f"{e['plain_tok_s']:.1f} tok/s, {e['speedup']:.2f}x"
              + (f"; steps that took it, per run: {e['cascade_steps']}" if e["cascade_steps"]
                 else ""))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2))
    return 0

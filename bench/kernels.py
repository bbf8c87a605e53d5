"""`tidewire bench kernels`: each Triton kernel against its torch reference and the
roofline, across shapes, on a CUDA GPU. Without one it says so and exits 0 (the kernels
are proven on CPU by the parity tests under TRITON_INTERPRET=1, not timed).

`--cpu`: the compiled CPU paged attention (kernels/cpu/) on prefill shapes against torch's
scaled_dot_product_attention on the same queries and keys held contiguously (the flash
attention HF transformers runs on a CPU), with the matrix unit (AMX) and without it
where the CPU has one.

Reported per case: kernel and reference time (median of CUDA-event timings), speedup,
achieved GB/s (bytes that must move: q, the K/V actually attended, out) and TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Callable

import torch


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="dtype of q, K, V and the output")
    p.add_argument("--repeats", type=int, default=20,
                   help="CUDA-event timings per kernel (the median is reported)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--cpu", action="store_true",
                   help="time the CPU attention kernel against torch SDPA instead")
    p.add_argument("--context", type=int, nargs="*", default=[2048, 8192],
                   help="with --cpu: prompt lengths to prefill")


def _time(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def _attention_case(name: str, num_seqs: int, q_len: int, ctx: int, heads: int, kv_heads: int,
                    d: int, dtype: torch.dtype, repeats: int, split_k: bool = False) -> dict:
    from kernels import reference as ref
    from kernels.paged_attention import paged_attention
    from kernels.paged_decode_splitk import paged_decode_splitk

    bs, dev = 16, "cuda"
    blocks_per_seq = -(-ctx // bs)
    nb = num_seqs * blocks_per_seq
    kc = torch.randn(nb, bs, kv_heads, d, dtype=dtype, device=dev)
    vc = torch.randn_like(kc)
    table = torch.randperm(nb, device=dev).int().view(num_seqs, blocks_per_seq)
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device=dev)
    starts = torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32, device=dev)
    q = torch.randn(num_seqs * q_len, heads, d, dtype=dtype, device=dev)
    scale = d**-0.5
    if split_k:
        def kern() -> Any:
            return paged_decode_splitk(q, kc, vc, table, lens, scale, ctx, 32)
    else:
        def kern() -> Any:
            return paged_attention(q, kc, vc, table, lens, starts, scale, q_len)
    t_k = _time(kern, repeats)
    t_r = _time(lambda: ref.paged_attention(q, kc, vc, table, lens, starts, scale), 3)
    elem = torch.finfo(dtype).bits // 8
    moved = (2 * q.numel() + 2 * num_seqs * ctx * kv_heads * d) * elem
    flops = 4 * num_seqs * q_len * ctx * heads * d / (2 if q_len > 1 else 1)  # causal ~half
    return {"case": name, "kernel_s": t_k, "reference_s": t_r, "speedup": t_r / t_k,
            "GB_s": moved / t_k / 1e9, "TFLOP_s": flops / t_k / 1e12}


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn on the CPU, after three untimed ones."""
    import time

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _cpu_prefill_case(heads: int, kv_heads: int, d: int, n: int, chunk: int,
                      repeats: int) -> dict:
    """A causal prefill of `n` tokens in chunks of `chunk` (as the engine runs it: each
    chunk's queries against every key before and within it, read from the paged cache),
    against one SDPA call over the whole prompt."""
    from kernels import cpu_ops

    bs, dtype = 16, torch.bfloat16
    nb = -(-n // bs)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(kv_heads, nb * bs, d, generator=g).to(dtype)
    v = torch.randn(kv_heads, nb * bs, d, generator=g).to(dtype)
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    kc = torch.empty(kv_heads, nb, bs, d, dtype=dtype)
    vc = torch.empty_like(kc)
    kc[:, perm] = k.view(kv_heads, nb, bs, d)
    vc[:, perm] = v.view(kv_heads, nb, bs, d)
    table = perm.int().view(1, nb)
    out = torch.empty_like(q)
    scale = d**-0.5

    def ours() -> None:
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            cpu_ops.paged_attention(out[c0:c1], q[c0:c1], kc, vc, table,
                                    torch.tensor([c1], dtype=torch.int32),
                                    torch.tensor([0, c1 - c0], dtype=torch.int32), scale)

    qs = q.transpose(0, 1).unsqueeze(0)
    ks = k[:, :n].repeat_interleave(heads // kv_heads, 0).unsqueeze(0)
    vs = v[:, :n].repeat_interleave(heads // kv_heads, 0).unsqueeze(0)

    def sdpa() -> None:
        torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)

    row = {"case": f"{heads}/{kv_heads} heads d{d}, {n} tokens by {chunk}",
           "sdpa_s": best_seconds(sdpa, repeats)}
    row["kernel_s"] = best_seconds(ours, repeats)
    if cpu_ops.amx():  # the same with the AVX-512 path
        cpu_ops.amx(False)
        try:
            row["kernel_no_amx_s"] = best_seconds(ours, repeats)
        finally:
            cpu_ops.amx(True)
    return row


def cpu_main(a: argparse.Namespace) -> int:
    from kernels import cpu_ops

    if not cpu_ops.available():
        print("tidewire bench kernels --cpu: the compiled CPU kernels are unavailable here")
        return 1
    shapes = [(9, 3, 64), (32, 8, 64), (32, 8, 128)]  # SmolLM2-135M, Llama-3.2-1B, 8B
    rows = [_cpu_prefill_case(h, kvh, d, n, 512, max(1, a.repeats // 10))
            for n in a.context for h, kvh, d in shapes]
    print(f"amx: {cpu_ops.amx()}, threads: {torch.get_num_threads()}")
    print(f"{'case':40s} {'ours ms':>9s} {'no AMX':>9s} {'SDPA ms':>9s} {'SDPA/ours':>9s}")
    for r in rows:
        no_amx = f"{r['kernel_no_amx_s'] * 1e3:9.1f}" if "kernel_no_amx_s" in r else f"{'-':>9s}"
        print(f"{r['case']:40s} {r['kernel_s'] * 1e3:9.1f} {no_amx} {r['sdpa_s'] * 1e3:9.1f} "
              f"{r['sdpa_s'] / r['kernel_s']:9.2f}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"amx": cpu_ops.amx(), "rows": rows}, indent=2))
    return 0


def main(a: argparse.Namespace) -> int:
    if getattr(a, "cpu", False):
        return cpu_main(a)
    if not torch.cuda.is_available():
        print("tidewire bench kernels: no CUDA GPU here; the kernels are checked for "
              "correctness by tests/test_kernels.py under TRITON_INTERPRET=1.")
        return 0
    dtype = getattr(torch, a.dtype)
    cases = [
        ("decode b64 ctx1k GQA8 d128", 64, 1, 1024, 32, 8, 128, False),
        ("decode b8 ctx16k split-K d128", 8, 1, 16384, 32, 8, 128, True),
        ("decode b8 ctx16k no split d128", 8, 1, 16384, 32, 8, 128, False),
        ("prefill b4 512x2k GQA4 d128", 4, 512, 2048, 32, 8, 128, False),
        ("prefill b16 128x512 MHA d64", 16, 128, 512, 16, 16, 64, False),
    ]
    rows = [_attention_case(*c[:7], dtype, a.repeats, split_k=c[7]) for c in cases]
    print(f"{'case':34s} {'kernel ms':>10s} {'ref ms':>9s} {'x':>6s} {'GB/s':>8s} {'TFLOP/s':>8s}")
    for r in rows:
        print(f"{r['case']:34s} {r['kernel_s'] * 1e3:10.3f} {r['reference_s'] * 1e3:9.2f} "
              f"{r['speedup']:6.1f} {r['GB_s']:8.0f} {r['TFLOP_s']:8.1f}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                     indent=2))
    return 0

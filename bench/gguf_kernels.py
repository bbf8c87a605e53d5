"""The GGUF block kernels' decode speed against this machine's memory bandwidth.

    python -m bench.gguf_kernels [--rows 1] [--out 8192] [--in 2048] [--x int8|exact]
    python -m bench.gguf_kernels --tiled [--out 8192] [--in 2048]

For each block type, x W^T for a few rows of x (cpu_ops.gguf_linear_small, and where the
CPU multiplies packed tiles cpu_ops.gguf_packed_linear on the same matrices repacked) on
matrices far larger than the caches, as GB/s of weight bytes streamed and as a fraction of a
plain streaming read of memory on the same threads (a sum over a 1 GiB fp32 tensor);
bf16 and int8 weights through cpu_ops.linear_small beside them. Random blocks (the
speed does not depend on the values).

--tiled: batches of 1-512 rows, each block type through cpu_ops.gguf_linear_small (up to
8 rows), the integer GEMM (gguf_linear_tiled with int8_x, where cpu_ops.gguf_gemm_int8),
cpu_ops.gguf_linear_tiled and the dequantized-tiles GEMM (GGUFLinear._dense),
against the packed bf16 GEMM (engine Linear) of a matrix of the same shape: ms per call,
and each quantized path's ratio to bf16 (speed: above 1 is faster). The thresholds in
engine/models/layers.py GGUFLinear come from this table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kernels import cpu_ops

NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def _best(fn, bytes_read: int, repeat: int) -> float:
    """GB/s of the fastest of `repeat` runs (after one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return bytes_read / best / 1e9


def read_bandwidth(repeat: int = 5) -> float:
    """GB/s of a streaming read: the sum of a 1 GiB fp32 tensor."""
    big = torch.ones(1 << 28)
    return _best(lambda: big.sum(), big.numel() * 4, repeat)


def tiled_table(out_f: int, in_f: int, repeat: int) -> dict:
    """ms per call of the small and tiled kernels and of packed bf16, by rows."""
    from engine.gguf_weights import QuantWeight
    from engine.models.layers import GGUFLinear, Linear
    from tests.gguf_tools import random_blocks

    g = torch.Generator().manual_seed(0)
    dense = Linear(torch.randn(out_f, in_f, generator=g).to(torch.bfloat16))
    weights = {qtype: QuantWeight(qtype, torch.from_numpy(
        random_blocks(qtype, out_f, in_f, seed=qtype, scale=1e-3)), in_f) for qtype in NAMES}
    table: dict = {}

    def ms(fn) -> float:
        return 1e3 / _best(fn, 1, repeat) / 1e9

    for rows in (1, 2, 4, 6, 8, 16, 32, 64, 128, 256, 512):
        x = torch.randn(rows, in_f, generator=g).to(torch.bfloat16)
        line = {"bf16": ms(lambda x=x: dense(x))}
        for qtype, name in NAMES.items():
            w = weights[qtype]
            lin = GGUFLinear([w], None, torch.bfloat16)
            y = torch.empty(rows, out_f, dtype=torch.bfloat16)
            if rows <= 8:
                line[f"{name} small"] = ms(
                    lambda x=x, w=w, t=qtype: cpu_ops.gguf_linear_small(x, w.data, t))
            if cpu_ops.gguf_gemm_int8(qtype, in_f):
                line[f"{name} int8"] = ms(lambda x=x, w=w, t=qtype: cpu_ops.gguf_linear_tiled(
                    x, w.data, t, int8_x=True))
            if rows <= 256:
                line[f"{name} tiled"] = ms(
                    lambda x=x, w=w, t=qtype: cpu_ops.gguf_linear_tiled(x, w.data, t))
            if rows >= 4:
                line[f"{name} dense"] = ms(lambda x=x, w=w, lin=lin, y=y: lin._dense(x, w, y))
        table[rows] = {k: round(v, 3) for k, v in line.items()}
        print(f"rows {rows:3d}: " + "  ".join(
            f"{k} {v:.2f}" + ("" if k == "bf16" else f" ({line['bf16'] / v:.2f}x)")
            for k, v in line.items()), flush=True)
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1, help="rows of x (1-8: decode batches)")
    p.add_argument("--out", type=int, default=8192)
    p.add_argument("--in", dest="inp", type=int, default=2048)
    p.add_argument("--copies", type=int, default=8,
                   help="distinct weight matrices cycled through (beyond the caches)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--x", choices=["int8", "exact"], default="int8",
                   help="x into the block kernels: quantized to int8 where the CPU has a "
                        "path for it (the engine's default), or the exact fp32 sums")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--tiled", action="store_true",
                   help="ms per call by rows: small and tiled kernels against packed bf16")
    a = p.parse_args()
    from tests.gguf_tools import random_blocks

    if not cpu_ops.available():
        raise SystemExit("the compiled CPU kernels are unavailable")
    if a.tiled:
        if not cpu_ops.gguf_tiled():
            raise SystemExit("gguf_linear_tiled needs a CPU with AVX512-BF16")
        table = tiled_table(a.out, a.inp, a.repeat)
        if a.json:
            a.json.write_text(json.dumps(table, indent=2))
        return
    bw = read_bandwidth(a.repeat)
    print(f"streaming read: {bw:.1f} GB/s on {torch.get_num_threads()} threads")
    x = torch.randn(a.rows, a.inp).to(torch.bfloat16)
    out: dict = {"read_gb_s": round(bw, 2), "rows": a.rows, "shape": [a.out, a.inp],
                 "x": a.x}
    for qtype, name in NAMES.items():
        ws = [torch.from_numpy(random_blocks(qtype, a.out, a.inp, seed=i, scale=1e-3))
              for i in range(a.copies)]
        nbytes = sum(w.numel() for w in ws)

        def run(ws=ws, qtype=qtype) -> None:
            for w in ws:
                cpu_ops.gguf_linear_small(x, w, qtype, int8_x=a.x == "int8")
        gb = _best(run, nbytes, a.repeat)
        bits = 8 * ws[0].numel() / (a.out * a.inp)
        out[name] = {"gb_s": round(gb, 2), "of_read": round(gb / bw, 3),
                     "bits_per_weight": bits,
                     "ms_per_1b_weights": round(1e9 * bits / 8 / gb / 1e6, 2)}
        print(f"{name}: {gb:5.1f} GB/s ({gb / bw:4.0%} of the read), {bits:.2f} bits a weight, "
              f"{out[name]['ms_per_1b_weights']} ms per 1e9 weights")
        if a.x == "int8" and cpu_ops.gguf_packs(qtype) and a.out % 16 == 0 and a.inp % 256 == 0:
            # the same matrices as packed tiles (what GGUFLinear multiplies here)
            packed = [cpu_ops.gguf_pack(w, qtype) for w in ws]
            del ws

            def run_packed(packed=packed, qtype=qtype) -> None:
                for w in packed:
                    cpu_ops.gguf_packed_linear(x, w, qtype)
            pnb = sum(w.numel() for w in packed)
            gb = _best(run_packed, pnb, a.repeat)
            bits = 8 * packed[0].numel() / (a.out * a.inp)
            key = f"{name} packed"
            out[key] = {"gb_s": round(gb, 2), "of_read": round(gb / bw, 3),
                        "bits_per_weight": bits,
                        "ms_per_1b_weights": round(1e9 * bits / 8 / gb / 1e6, 2)}
            print(f"{key}: {gb:5.1f} GB/s ({gb / bw:4.0%} of the read), {bits:.2f} bits a "
                  f"weight, {out[key]['ms_per_1b_weights']} ms per 1e9 weights")
    g = torch.Generator().manual_seed(0)
    for name, ws, scale in (
            ("bf16", [torch.randn(a.out, a.inp, generator=g).to(torch.bfloat16)
                      for _ in range(a.copies)], None),
            ("int8", [torch.randint(-127, 127, (a.out, a.inp), dtype=torch.int8, generator=g)
                      for _ in range(a.copies)], torch.ones(a.out))):
        nbytes = sum(w.numel() * w.element_size() for w in ws)

        def run_dense(ws=ws, scale=scale) -> None:
            for w in ws:
                cpu_ops.linear_small(x, w, scale)
        gb = _best(run_dense, nbytes, a.repeat)
        bits = 8 * ws[0].element_size()
        out[name] = {"gb_s": round(gb, 2), "of_read": round(gb / bw, 3),
                     "bits_per_weight": bits,
                     "ms_per_1b_weights": round(1e9 * bits / 8 / gb / 1e6, 2)}
        print(f"{name}: {gb:5.1f} GB/s ({gb / bw:4.0%} of the read), {bits} bits a weight, "
              f"{out[name]['ms_per_1b_weights']} ms per 1e9 weights")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

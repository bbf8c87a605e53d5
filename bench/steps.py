"""Where a decode step's time goes, and output tok/s against batch size (for `tidewire
bench offline --profile / --plot`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

ATTENTION_OPS = ("tidewire::paged_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::index_select")
LINEAR_OPS = ("mkldnn::_linear_pointwise", "tidewire::linear_small", "tidewire::gguf_linear_small",
              "tidewire::gguf_dequant", "tidewire::gguf_linear_tiled", "aten::addmm", "aten::mm",
              "aten::linear")


class _Timed:
    """Wraps an instance's method, adding its wall time to a shared total."""

    def __init__(self, obj: Any, name: str, totals: dict[str, float], phase: str) -> None:
        self.obj, self.name, self.fn = obj, name, getattr(obj, name)
        self.totals, self.phase = totals, phase

    def __call__(self, *a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.totals[self.phase] += time.perf_counter() - t

    def __enter__(self) -> _Timed:
        setattr(self.obj, self.name, self)
        return self

    def __exit__(self, *exc: object) -> None:
        delattr(self.obj, self.name)  # the class's method shows through again


def fill_batch(llm: Any, batch: int, ctx: int, tag: str) -> None:
    """`batch` requests with distinct `ctx`-token prompts, prefilled, one decode done."""
    from engine import SamplingParams

    eng = llm.engine
    vocab = eng.arch.vocab_size
    # long enough that the first admitted outlive the others' prefill and the measured steps
    params = SamplingParams(max_tokens=min(4096, eng.max_model_len - ctx - 1), temperature=0.0,
                            ignore_eos=True)
    for i in range(batch):
        prompt = [100 + (i * 7919 + j * 31) % (vocab - 100) for j in range(ctx)]
        eng.add(eng.make_request(prompt, params, f"{tag}-{i}"))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()
    eng.step()


def linears_alone_ms(llm: Any, batch: int, rounds: int = 5) -> float:
    """The model's matmuls at `batch` rows, one after another as in a step (same kernels,
    weights read from memory as in a step): the floor a decode step stands on. (An MLP of
    experts counts none of its matmuls: which experts a step reads depends on the routing.)"""
    model = llm.engine.runner.model
    mats = [m for layer in model.layers
            for m in (layer.qkv, layer.o, getattr(layer.mlp, "gate_up", None),
                      getattr(layer.mlp, "down", None)) if m is not None]
    mats.append(model.lm_head)
    dev = llm.engine.runner.device  # (a GGUF linear has no .weight)
    xs = {n: torch.randn(batch, n, device=dev).to(model.dtype)
          for n in {m.in_features for m in mats}}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times = []
    with torch.inference_mode():
        for _ in range(rounds + 1):
            sync()
            t = time.perf_counter()
            for m in mats:
                m(xs[m.in_features])
            sync()
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[1:])


def step_breakdown(llm: Any, batch: int, ctx: int, rounds: int = 5) -> dict[str, Any]:
    """Median wall time of a decode step at `batch` x `ctx`, split into scheduler and
    sampler (wrappers on the engine's own objects), attention and linears (their ops'
    shares of three profiled steps' wall time, applied to the median) and the rest. The
    compiled small-batch step is one op: its split is shown by an eager step, its cost
    against the linears alone."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    runner = eng.runner
    fill_batch(llm, batch, ctx, f"bd{batch}x{ctx}")
    totals = dict.fromkeys(("scheduler", "sampler", "model"), 0.0)
    wraps = [_Timed(eng.scheduler, n, totals, "scheduler") for n in ("schedule", "advance", "commit")]
    wraps.append(_Timed(runner, "_sample", totals, "sampler"))
    wraps.append(_Timed(runner, "_forward", totals, "model"))
    if runner.compiled_step is not None:
        wraps.append(_Timed(runner.compiled_step, "run", totals, "model"))
    steps: list[float] = []
    for w in wraps:
        w.__enter__()
    try:
        for _ in range(rounds):
            t = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t)
    finally:
        for w in reversed(wraps):
            w.__exit__()
    profiled_steps = 3  # the op shares of one profiled step moved by ~5 points run to run
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(profiled_steps):
            eng.step()
        profiled = (time.perf_counter() - t) / profiled_steps
    running = len(eng.scheduler.running)
    eng.abort(eng.request_ids())
    ms = {k: 1000 * v / rounds for k, v in totals.items()}
    self_ms: dict[str, float] = {}
    for e in prof.key_averages():
        self_ms[e.key] = e.self_cpu_time_total / 1000.0 / profiled_steps
    compiled = "tidewire::decode_step" in self_ms
    out: dict[str, Any] = {"batch": batch, "context": ctx, "running": running,
                           "device": runner.device.type,
                           "step_ms": 1000 * statistics.median(steps),
                           "compiled_step": compiled, "scheduler_ms": ms["scheduler"],
                           "sampler_ms": ms["sampler"], "model_ms": ms["model"]}
    if not compiled:  # the profiled steps' op times, as shares of their wall time
        prof_ms = 1000 * profiled
        out["profiled_step_ms"] = prof_ms
        out["attention_share"] = sum(self_ms.get(k, 0.0) for k in ATTENTION_OPS) / prof_ms
        out["linears_share"] = sum(self_ms.get(k, 0.0) for k in LINEAR_OPS) / prof_ms
        rest = 1 - (out["sampler_ms"] + out["scheduler_ms"]) / out["step_ms"]
        out["attention_ms"] = out["attention_share"] * out["step_ms"]
        out["linears_ms"] = out["linears_share"] * out["step_ms"]
        out["other_ms"] = max(0.0, rest * out["step_ms"] - out["attention_ms"]
                              - out["linears_ms"])
    out["linears_alone_ms"] = linears_alone_ms(llm, batch)
    out["step_over_linears"] = out["step_ms"] / out["linears_alone_ms"]
    out["top_ops"] = dict(sorted(self_ms.items(), key=lambda kv: -kv[1])[:8])
    return out


def format_breakdown(b: dict[str, Any]) -> str:
    head = (f"decode step, batch {b['batch']}, context {b['context']}"
            f"{' (compiled step)' if b['compiled_step'] else ''}: {b['step_ms']:.1f} ms = ")
    if b["compiled_step"]:
        parts = [("model", b["model_ms"])]
    else:
        parts = [("attention", b["attention_ms"]), ("linears", b["linears_ms"])]
    parts += [("sampler", b["sampler_ms"]), ("scheduler", b["scheduler_ms"])]
    if not b["compiled_step"]:
        parts.append(("other", b["other_ms"]))
    body = ", ".join(f"{k} {v:.1f} ({100 * v / b['step_ms']:.0f}%)" for k, v in parts)
    tail = (f"; linears alone {b['linears_alone_ms']:.1f} ms, step/linears "
            f"{b['step_over_linears']:.2f}x")
    if b.get("device", "cpu") != "cpu":  # the profiler sees the host side only
        tail += " (GPU: the op split counts host time, the sampler's share includes the wait)"
    return head + body + tail


def batch_sweep(run_tidewire: Callable[[int], float], run_hf: Callable[[int], float] | None,
                sizes: tuple[int, ...] = (1, 4, 16, 64)) -> dict[str, dict[int, float]]:
    """Output tok/s of each system at each batch size (callables return tok/s)."""
    res: dict[str, dict[int, float]] = {"tidewire": {}, "hf": {}}
    for b in sizes:
        res["tidewire"][b] = run_tidewire(b)
        if run_hf is not None:
            res["hf"][b] = run_hf(b)
        print(f"batch {b:3d}: tidewire {res['tidewire'][b]:7.1f} tok/s"
              + (f", hf {res['hf'][b]:7.1f} tok/s" if run_hf is not None else ""))
    return res


def plot(path: Any, sweep: dict[str, dict[int, float]], breakdowns: list[dict[str, Any]],
         title: str) -> None:
    """Two panels: output tok/s against batch size (log-log), and each profiled step's
    split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, pts in sweep.items():
        if pts:
            xs = sorted(pts)
            ax1.plot(xs, [pts[x] for x in xs], marker="o", label=name)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("batch size (concurrent sequences)")
    ax1.set_ylabel("output tok/s")
    ax1.set_title("decode throughput")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend()
    phases = ("attention", "linears", "model", "sampler", "scheduler", "other")
    labels = [f"b{b['batch']} ctx{b['context']}{' compiled' if b['compiled_step'] else ''}"
              for b in breakdowns]
    bottom = [0.0] * len(breakdowns)
    for ph in phases:
        vals = [b.get(f"{ph}_ms", 0.0) if (ph != "model" or b["compiled_step"]) else 0.0
                for b in breakdowns]
        if any(vals):
            ax2.bar(labels, vals, bottom=bottom, label=ph)
            bottom = [x + y for x, y in zip(bottom, vals)]
    ax2.set_ylabel("ms per decode step")
    ax2.set_title("where a step's time goes")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

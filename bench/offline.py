"""`tidewire bench offline`: the chat-64 workload through Tidewire's offline LLM and
through HF transformers `generate` in static batches, side by side in one run, plus
single-stream decode, a 2,000-token prefill, and (--profile, --plot) where decode steps
spend their time and throughput against batch size."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.workloads import BenchRequest, chat64


def add_sampling_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--temperature", type=float, default=0.0,
                   help=f"sample {what} (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: sample within this probability mass (1: all)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k likeliest tokens (0: all)")


def sampling_args(a: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields those flags give (for run_tidewire, run_hf_static)."""
    return {"temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="registry name, HF model directory or .gguf file (see `tidewire models`)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="both systems' weights (auto: bfloat16 on a GPU or a CPU with "
                        "AVX512-BF16/AMX, else float32)")
    p.add_argument("--attention-backend", default=None, choices=["cpu", "cuda"],
                   help="default: cuda where a GPU is present, else cpu; the HF baseline "
                        "runs on the same device")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs, no compiled CPU decode step")
    p.add_argument("--quantization", default="auto",
                   choices=["auto", "none", "int8", "int4", "gguf"],
                   help="Tidewire's weights, as `tidewire serve --quantization` (the HF "
                        "baseline stays in --dtype)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="Tidewire's KV cache (int8: the CPU backend's one-byte cache)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for both systems (0: one per physical core)")
    p.add_argument("--num-requests", type=int, default=64,
                   help="requests in the chat-64 workload (other values change it)")
    p.add_argument("--hf-batch-size", type=int, default=16,
                   help="the HF baseline's static batch size")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="Tidewire: sequences one engine step may batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="Tidewire: tokens one engine step may process")
    p.add_argument("--single-stream-tokens", type=int, default=128,
                   help="decode steps timed in the batch-1 comparison")
    p.add_argument("--prefill-tokens", type=int, nargs="+", default=[2000],
                   help="prompt lengths of the time-to-first-token comparison (each up to "
                        "the model's context)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's prompts and lengths")
    add_sampling_args(p, "the throughput run's tokens, in both systems")
    p.add_argument("--skip-hf", action="store_true", help="Tidewire only")
    p.add_argument("--skip-throughput", action="store_true",
                   help="only the single-stream decode comparison")
    p.add_argument("--profile", action="store_true",
                   help="split decode steps (batch 64 and 1, context 200) into attention, "
                        "linears, sampler, scheduler and other")
    p.add_argument("--profile-long", action="store_true",
                   help="with --profile, also batch 64 at context 2,000 (prefills 128k "
                        "tokens first: minutes; sizes the KV pool to fit)")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG: output tok/s against batch size (1, 4, 16, 64) for both "
                        "systems, and the step breakdowns (runs the sweep; matplotlib)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                   help="GiB for Tidewire's KV block pool (--profile-long raises it to fit)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--response-format", default=None, metavar="JSON",
                   help="also run the workload with every request constrained to this "
                   "response_format (e.g. json_object, or a JSON object in OpenAI's shape) "
                   "and print its throughput against the unconstrained run, plus the compile "
                   "time of a 20-property JSON schema (first and cached)")


def _hf_model(model_dir: Path, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()


def _sync(model: Any) -> None:
    """HF generate may return before a GPU finishes: time only finished work."""
    if model.device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def run_hf_static(model: Any, work: list[BenchRequest], batch_size: int, pad_id: int,
                  sampling: dict | None = None) -> dict:
    """Static batching: each batch is left-padded and runs until its longest output.
    `sampling` as for run_tidewire (HF's warpers: temperature, top_p, top_k)."""
    sampling = sampling or {}
    sample = sampling.get("temperature", 0.0) > 0
    extra = ({"do_sample": True, "temperature": sampling["temperature"],
              "top_p": sampling.get("top_p", 1.0), "top_k": sampling.get("top_k", 0) or None}
             if sample else {"do_sample": False})
    t0 = time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i : i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(batch):
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        n = max(r.max_tokens for r in batch)
        model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                       max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id, **extra)
    _sync(model)
    dt = time.perf_counter() - t0
    useful = sum(r.max_tokens for r in work)
    return {"seconds": dt, "output_tokens": useful, "output_tok_s": useful / dt}


def run_tidewire(llm: Any, work: list[BenchRequest], sampling: dict | None = None,
                 lengths: list[int] | None = None) -> dict:
    """`sampling`: SamplingParams fields (temperature, top_p, top_k, response_format);
    default greedy. A constrained output ends at its constraint's end (ignore_eos
    notwithstanding), so it may be shorter than the request's max_tokens."""
    from engine import SamplingParams

    sampling = {"temperature": 0.0, **(sampling or {})}
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, **sampling)
              for r in work]
    steps0 = llm.engine.num_steps
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in work], params)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    if lengths is not None:
        lengths[:] = [len(o.token_ids) for o in outs]
    if sampling.get("response_format") is None:
        assert n == sum(r.max_tokens for r in work), "tidewire produced a different token count"
    return {"seconds": dt, "output_tokens": n, "output_tok_s": n / dt,
            "steps": llm.engine.num_steps - steps0}


def constrained_run(llm: Any, work: list[BenchRequest], sampling: dict, fmt: str,
                    result: dict[str, Any], rounds: int = 5) -> None:
    """The workload constrained to `fmt` against the unconstrained figure already in
    `result`, and a 20-property schema's compile time (first use, then cached)."""
    from engine.structured import ResponseFormat

    rf = ResponseFormat.parse({"type": fmt} if not fmt.startswith("{") else json.loads(fmt))
    props = {f"field_{i}": {"type": ("string", "integer", "boolean", "number")[i % 4]}
             for i in range(20)}
    schema = ResponseFormat.parse({"type": "json_schema", "json_schema": {
        "name": "twenty", "schema": {"type": "object", "properties": props,
                                     "required": list(props)}}})
    grammars = llm.engine.grammars
    t0 = time.perf_counter()
    grammars.compile(schema)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammars.compile(schema)
    cached = time.perf_counter() - t0
    run_tidewire(llm, work[:4], {**sampling, "response_format": rf})  # warm up
    lengths: list[int] = []
    runs = [run_tidewire(llm, work, {**sampling, "response_format": rf}, lengths)]
    # the same requests unconstrained, each held to the length its constrained output
    # reached (a constraint ends outputs early: equal work is what compares); the two
    # alternate, five rounds each, and the fastest of each is kept (2-second runs on
    # a shared machine are noisy)
    same = [dataclasses.replace(r, max_tokens=n) for r, n in zip(work, lengths)]
    frees = []
    for i in range(rounds):
        frees.append(run_tidewire(llm, same, sampling))
        if i + 1 < rounds:
            runs.append(run_tidewire(llm, work, {**sampling, "response_format": rf}))
    con = min(runs, key=lambda r: r["seconds"])
    free = min(frees, key=lambda r: r["seconds"])
    con["unconstrained_same_lengths"] = free
    con["ratio_to_unconstrained"] = con["output_tok_s"] / free["output_tok_s"]
    # each constrained round against the unconstrained one run right before it
    con["round_ratios"] = [f["seconds"] / c["seconds"] for c, f in zip(runs[1:], frees)]
    con["compile_20_properties_s"] = {"first": first, "cached": cached}
    result["constrained"] = con
    print(f"constrained {con['output_tok_s']:7.1f} output tok/s ({con['seconds']:.1f}s, "
          f"{con['output_tokens']} tokens, {con['steps']} steps, every request {rf.kind}); "
          f"unconstrained at the same lengths {free['output_tok_s']:.1f} "
          f"({free['seconds']:.1f}s): {con['ratio_to_unconstrained']:.3f}x (fastest of {rounds} "
          f"each; median of paired rounds {statistics.median(con['round_ratios']):.3f}x)")
    print(f"compile of a 20-property JSON schema: first {first * 1e3:.1f} ms, cached "
          f"{cached * 1e6:.0f} us")


def single_stream(llm: Any, hf: Any, prompt: list[int], n: int, rounds: int = 3) -> dict:
    """Batch-1 decode speed. The time of (n + 1) new tokens minus that of 1 new token
    isolates n decode steps from the prefill; the two systems alternate for `rounds`
    rounds and the medians are compared, so machine noise hits both alike."""
    from engine import SamplingParams

    def tw(k: int) -> float:
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t

    def hf_gen(k: int) -> float:
        ids = torch.tensor([prompt], device=hf.device)
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,
                        min_new_tokens=k, do_sample=False, pad_token_id=0)
        _sync(hf)
        return time.perf_counter() - t

    systems = {"tidewire": tw} | ({"hf": hf_gen} if hf is not None else {})
    times: dict[str, list[float]] = {name: [] for name in systems}
    for fn in systems.values():
        fn(2)  # warm up
    for _ in range(rounds):
        for name, fn in systems.items():
            times[name].append(fn(n + 1) - fn(1))
    res: dict[str, float] = {}
    for name, ts in times.items():
        dt = statistics.median(ts)
        res[f"{name}_decode_tok_s"] = n / dt
        res[f"{name}_ms_per_token"] = 1000 * dt / n
    if "hf_decode_tok_s" in res:
        res["ratio"] = res["tidewire_decode_tok_s"] / res["hf_decode_tok_s"]
    return res


def prefill_ttft(llm: Any, hf: Any, n: int = 2000, rounds: int = 2) -> dict:
    """Time to the first token of an `n`-token prompt (max_tokens=1), a fresh prompt each
    round (no prefix-cache hit); HF's forward over the same prompt beside it."""
    from engine import SamplingParams

    vocab = llm.engine.arch.vocab_size
    n = min(n, llm.engine.max_model_len - 1)
    res: dict[str, float] = {"prompt_tokens": n}
    times, hf_times = [], []
    for r in range(rounds + 1):  # the first round warms up
        prompt = [100 + (r * 104729 + j * 7919) % (vocab - 100) for j in range(n)]
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        times.append(time.perf_counter() - t)
        if hf is not None:
            ids = torch.tensor([prompt], device=hf.device)
            t = time.perf_counter()
            with torch.inference_mode():
                hf(ids)
            _sync(hf)
            hf_times.append(time.perf_counter() - t)
    res["tidewire_ttft_s"] = statistics.median(times[1:])
    res["tidewire_prompt_tok_s"] = n / res["tidewire_ttft_s"]
    if hf_times:
        res["hf_ttft_s"] = statistics.median(hf_times[1:])
        res["hf_prompt_tok_s"] = n / res["hf_ttft_s"]
    return res


def sweep_batches(llm: Any, hf: Any, pad: int, sizes: tuple[int, ...], new: int = 32) -> dict:
    """Output tok/s at each batch size: `b` requests of 64-token prompts and `new` output
    tokens, through Tidewire and through HF static batching."""
    from bench.steps import batch_sweep

    vocab = llm.engine.arch.vocab_size

    def work(b: int) -> list[BenchRequest]:
        return [BenchRequest([100 + (i * 31 + j * 7) % (vocab - 100) for j in range(64)], new)
                for i in range(b)]

    def tw(b: int) -> float:
        return run_tidewire(llm, work(b))["output_tok_s"]

    def hf_run(b: int) -> float:
        return run_hf_static(hf, work(b), b, pad)["output_tok_s"]

    return batch_sweep(tw, hf_run if hf is not None else None, sizes)


def _profiles(llm: Any, long: bool) -> list[dict]:
    """Step breakdowns: batch 64 at context 200 (and 2,000 with --profile-long), batch 1
    eagerly (its split) and through the compiled step (its cost against the linears)."""
    from bench.steps import format_breakdown, step_breakdown

    runner = llm.engine.runner
    out = [step_breakdown(llm, 64, 200)]
    if long:
        out.append(step_breakdown(llm, 64, 2000))
    compiled, runner.compiled_step = runner.compiled_step, None
    try:
        out.append(step_breakdown(llm, 1, 200))
    finally:
        runner.compiled_step = compiled
    if compiled is not None:
        out.append(step_breakdown(llm, 1, 200))
    for b in out:
        print(format_breakdown(b))
    return out


def main(a: argparse.Namespace) -> int:
    from engine import LLM

    backend = a.attention_backend or ("cuda" if torch.cuda.is_available() else "cpu")
    kv_bytes = int(a.kv_cache_memory_gb * (1 << 30))
    if a.profile_long:  # 64 sequences of 2,000 tokens and their decodes
        from engine.loader import resolve_model
        from engine.models.arch import ModelArch

        arch = ModelArch.from_dir(resolve_model(a.model))
        dt = torch.float32 if a.dtype == "float32" else torch.bfloat16
        kv_bytes = max(kv_bytes, 64 * 2600 * arch.kv_bytes_per_block(1, dt, a.kv_cache_dtype))
    llm = LLM(model=a.model, dtype=a.dtype, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, attention_backend=backend,
              enforce_eager=a.enforce_eager, quantization=a.quantization, threads=a.threads,
              kv_cache_memory=kv_bytes, kv_cache_dtype=a.kv_cache_dtype)
    dtype = llm.engine.dtype  # what "auto" resolved to: the baseline runs the same
    work = chat64(llm.engine.arch.vocab_size, a.num_requests, a.seed)
    print(f"workload: {len(work)} requests, prompts {min(len(r.prompt_token_ids) for r in work)}-"
          f"{max(len(r.prompt_token_ids) for r in work)} tokens, outputs "
          f"{sum(r.max_tokens for r in work)} tokens total; torch threads {torch.get_num_threads()}")
    device = "cuda" if backend == "cuda" else "cpu"
    quantization = llm.engine.config.quantization  # what "auto" resolved to
    hf_dir = llm.engine.model_dir
    if quantization == "gguf" and not a.skip_hf:  # HF runs the file dequantized
        from engine.loader import resolve_model

        hf_dir = resolve_model(a.model)
    hf = None if a.skip_hf else _hf_model(hf_dir, dtype, device)
    result: dict[str, Any] = {"workload": "chat-64", "dtype": llm.engine.dtype_name,
                              "quantization": quantization,
                              "model": a.model, "attention_backend": backend,
                              "kv_cache_dtype": a.kv_cache_dtype,
                              "cuda_graphs": llm.engine.runner.graphs is not None
                              and backend == "cuda",
                              "device": torch.cuda.get_device_name() if device == "cuda"
                              else "cpu"}
    if not a.skip_throughput:
        _throughput(llm, hf, work, a, result)
    ss = single_stream(llm, hf, work[0].prompt_token_ids[:32], a.single_stream_tokens)
    result["single_stream"] = ss
    print("single stream: " + ", ".join(f"{k}={v:.2f}" for k, v in ss.items()))
    result["prefills"] = []  # one a prompt length; "prefill": the first
    for n in a.prefill_tokens:
        pf = prefill_ttft(llm, hf, n)
        result["prefills"].append(pf)
        print("prefill: " + ", ".join(f"{k}={v:.2f}" for k, v in pf.items()))
    result["prefill"] = result["prefills"][0]
    breakdowns = _profiles(llm, a.profile_long) if a.profile or a.plot else []
    result["profile"] = breakdowns
    if a.plot:
        pad = llm.engine.arch.eos_token_ids[0] if llm.engine.arch.eos_token_ids else 0
        sweep = sweep_batches(llm, hf, pad, (1, 4, 16, 64))
        result["batch_sweep"] = sweep
        from bench.steps import plot

        plot(a.plot, sweep, breakdowns, f"Tidewire vs HF transformers, {a.model} "
             f"({llm.engine.dtype_name}"
             f"{'' if quantization == 'none' else ', ' + quantization}"
             f"{', int8 KV' if a.kv_cache_dtype == 'int8' else ''})")
        print(f"wrote {a.plot}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {a.json}")
    return 0


def _throughput(llm: Any, hf: Any, work: list[BenchRequest], a: argparse.Namespace,
                result: dict[str, Any]) -> None:
    sampling = sampling_args(a)
    result["sampling"] = sampling
    run_tidewire(llm, work[:4], sampling)  # warm up
    result["tidewire"] = run_tidewire(llm, work, sampling)
    print(f"tidewire   {result['tidewire']['output_tok_s']:8.1f} output tok/s "
          f"({result['tidewire']['seconds']:.1f}s, {result['tidewire']['steps']} steps)")
    if a.response_format:
        constrained_run(llm, work, sampling, a.response_format, result)
    if hf is not None:
        pad = llm.engine.arch.eos_token_ids[0] if llm.engine.arch.eos_token_ids else 0
        result["hf_static"] = run_hf_static(hf, work, a.hf_batch_size, pad, sampling)
        result["hf_static"]["batch_size"] = a.hf_batch_size
        result["throughput_ratio"] = (result["tidewire"]["output_tok_s"]
                                      / result["hf_static"]["output_tok_s"])
        print(f"hf static  {result['hf_static']['output_tok_s']:8.1f} output tok/s "
              f"({result['hf_static']['seconds']:.1f}s, batches of {a.hf_batch_size})")
        print(f"ratio      {result['throughput_ratio']:8.2f}x")

"""`tidewire bench NAME`: the benchmarks, each a module of the bench package with its
own flags (`add_args`, added on first use: those modules import torch) and `main`."""

from __future__ import annotations

import argparse
from typing import Any, Callable


def run(a: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"bench.{a.bench}").main(a)


BENCHES = {  # subcommand -> one-line help
    "offline": "chat-64 workload: Tidewire LLM vs HF static batches",
    "ws": "64 WebSocket streams vs the engine alone, same requests",
    "prefix": "TTFT of a 2,000-token shared prefix: cold, device hit, Redis after a restart, "
              "memory tier; no-hit overhead of the tier",
    "kernels": "Triton kernels vs torch references and the roofline (CUDA; exits 0 without "
               "a GPU); --cpu: the CPU attention kernel vs torch SDPA on prefill shapes",
    "cascade": "shared-prefix (cascade) attention on and off: the kernel's table (CPU or GPU) and "
               "chat-64 behind one shared 2,000-token system prompt",
    "http": "chat-64 against any OpenAI-compatible server (Tidewire, llama.cpp, vLLM): TTFT, "
            "inter-chunk gaps, output tok/s",
    "load": "mixed WebSocket/SSE load from separate processes: sockets held, outcomes, "
            "TTFT and delivery, server RSS/fds over time, KV blocks back (--duration: a soak)",
    "sampling": "judged questions at several temperatures: how a model's default sampling "
                "was chosen",
    "spec": "speculative decoding on and off side by side: a repetitive workload (one "
            "stream and batch 8) and chat-64; tok/s, speed-up, acceptance",
    "accuracy": "teacher-forced agreement with HF fp32 of bf16, int8 KV cache and int8 "
                "weights (top-1, KL, perplexity on a text)",
}


def lazy_args(name: str) -> Callable[[Any], None]:
    """Adds the benchmark's flags when its parser is first used (see flags.Parser)."""
    def add(p: Any) -> None:
        import importlib

        importlib.import_module(f"bench.{name}").add_args(p)
    return add

"""The `tidewire` command line."""

from __future__ import annotations

import argparse
import sys

from engine.loader import DEFAULT_MODEL


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name or HF directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", default="cpu")


def _llm(a: argparse.Namespace):  # noqa: ANN202 - engine.LLM
    from engine import LLM

    return LLM(model=a.model, dtype=a.dtype, block_size=a.block_size,
               num_kv_blocks=a.num_kv_blocks, max_num_batched_tokens=a.max_num_batched_tokens,
               max_num_seqs=a.max_num_seqs, enable_prefix_caching=not a.no_prefix_caching,
               attention_backend=a.attention_backend)


def cmd_generate(a: argparse.Namespace) -> int:
    from engine import SamplingParams

    llm = _llm(a)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                            top_p=a.top_p, seed=a.seed, ignore_eos=a.ignore_eos)
    if a.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in a.prompts], params)
    else:
        outs = llm.generate(list(a.prompts), params)
    for o in outs:
        print(o.text if len(outs) == 1 else f"--- [{o.finish_reason}]\n{o.text}")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from bench import offline

    return offline.main(a)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidewire", description="Tidewire LLM server")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline for one or more prompts")
    _engine_args(g)
    g.add_argument("prompts", nargs="+")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmarks (Tidewire vs a baseline, side by side)")
    bsub = b.add_subparsers(dest="bench", required=True)
    off = bsub.add_parser("offline", help="chat-64 workload: Tidewire LLM vs HF static batches")
    from bench.offline import add_args

    add_args(off)
    off.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"tidewire: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

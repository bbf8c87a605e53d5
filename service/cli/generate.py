"""`tidewire generate`: text for one or more prompts, offline (the LLM class)."""

from __future__ import annotations

import argparse

from service.cli.engine_flags import engine_args, engine_config, kv_args, model_args


def run(a: argparse.Namespace) -> int:
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
    llm.close()  # flush cached prefix blocks to the host tier (a later run reuses them)
    return 0


def add_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("prompts", nargs="+", metavar="PROMPT",
                   help="prompt text; several prompts run as one batch")
    model_args(g.add_argument_group("model"))
    s = g.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    s.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    s.add_argument("--top-p", type=float, default=1.0,
                   help="sample within this probability mass (1: all)")
    s.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible runs)")
    s.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token up to --max-tokens")
    s.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    engine_args(g.add_argument_group("engine"))
    kv_args(g.add_argument_group("KV cache and host tier"))


def _llm(a: argparse.Namespace):  # noqa: ANN202 - engine.LLM
    from engine import LLM

    return LLM(config=engine_config(a))

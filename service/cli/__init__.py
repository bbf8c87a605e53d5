"""The `tidewire` command line: `build_parser` assembles the commands, each in a module
of its own (generate, serve, models, benchmarks) over the flag machinery of
service.cli.flags and the engine flags of service.cli.engine_flags; `main` runs one.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from engine import runtime

runtime.tune_openmp()  # before anything imports torch

from service.cli import benchmarks, generate, models, serve  # noqa: E402 - after tune_openmp
from service.cli.flags import ENV_EPILOG, Parser  # noqa: E402 - after tune_openmp


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tidewire", description="Tidewire LLM server",
                    epilog="`tidewire COMMAND --help` lists a command's flags, their "
                           "defaults and the TIDEWIRE_* environment variables they read.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of:")

    def command(name: str, text: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, **kw)

    g = command("generate", "generate text offline for one or more prompts", epilog=ENV_EPILOG)
    generate.add_args(g)
    g.set_defaults(func=generate.run)

    sv = command("serve", "serve WebSocket + OpenAI-compatible HTTP", epilog=ENV_EPILOG)
    serve.add_args(sv)
    sv.set_defaults(func=serve.run)

    md = command("models", "list the model registry, and what else --model takes")
    md.set_defaults(func=models.run)

    b = command("bench", "benchmarks (Tidewire vs a baseline, side by side)")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH", help="one of:")
    for name, text in benchmarks.BENCHES.items():
        bp = bsub.add_parser(name, help=text, description=text,
                             add_args=benchmarks.lazy_args(name))
        bp.set_defaults(func=benchmarks.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    runtime.tune_malloc()
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"tidewire: error: {e}", file=sys.stderr)
        return 2

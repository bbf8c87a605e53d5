"""`tidewire-chat`: a streaming chat with a Tidewire server in the terminal."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional

from tidewire_client._errors import TidewireError
from tidewire_client._sync import Client
from tidewire_client._types import DeltaEvent


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="tidewire-chat", description=__doc__)
    p.add_argument("--url", default=os.environ.get("TIDEWIRE_URL", "ws://127.0.0.1:8000/v1/ws"))
    p.add_argument("--api-key", default=os.environ.get("TIDEWIRE_API_KEY"))
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the model's (the server's ready frame lists it)")
    a = p.parse_args(argv)
    history: List[Dict[str, str]] = [{"role": "system", "content": a.system}] if a.system else []
    with Client(a.url, api_key=a.api_key) as client:
        try:
            client.connect()
        except TidewireError as e:
            print(f"tidewire-chat: {e}", file=sys.stderr)
            return 1
        print(f"connected to {client.ready.get('model') if client.ready else a.url}; "
              "Ctrl-C stops an answer, Ctrl-D quits", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                return 0
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            history.append({"role": "assistant", "content": _answer(client, history, a)})


def _answer(client: Client, history: List[Dict[str, str]], a: argparse.Namespace) -> str:
    parts: List[str] = []
    sampling = {} if a.temperature is None else {"temperature": a.temperature}
    stream = client.chat.stream(history, max_tokens=a.max_tokens, **sampling)
    thinking = False
    try:
        for ev in stream:
            if not isinstance(ev, DeltaEvent):
                continue
            if ev.reasoning:  # a thinking model's thoughts: dimmed, on stderr, not kept
                thinking = True
                print(f"\x1b[2m{ev.reasoning}\x1b[0m", end="", file=sys.stderr, flush=True)
            if ev.text:
                if thinking:  # the answer starts on a line of its own
                    thinking = False
                    print(file=sys.stderr, flush=True)
                parts.append(ev.text)
                print(ev.text, end="", flush=True)
    except KeyboardInterrupt:
        stream.close()
        print(" [stopped]", end="")
    except TidewireError as e:
        print(f"\n[error: {e}]", end="")
    done = stream.done
    if done is not None:
        print(f"\n[{done.usage.completion_tokens} tokens, {done.timings.tokens_per_s:.1f} tok/s, "
              f"ttft {done.timings.ttft_ms:.0f} ms]", file=sys.stderr)
    else:
        print()
    return "".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())

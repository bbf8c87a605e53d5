"""Choose a model's default sampling parameters by measurement.

A small judged set of one-line questions with known answers is asked as chat, each
answered `--samples` times under every candidate setting (seeds 0..samples-1, so runs
are reproducible). An answer is judged correct when it matches the question's pattern;
"looping" counts answers whose last 24 words hold fewer than 8 distinct ones (the
repetition a small model falls into at low temperature). The best setting answers
correctly most often without looping.

    tidewire bench sampling --model smollm2-135m
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass

# (question, accepted answer pattern, case-insensitive)
JUDGED: list[tuple[str, str]] = [
    ("What is the capital of France?", r"\bparis\b"),
    ("What is 2 + 2?", r"\b4\b|\bfour\b"),
    ("What color is the sky on a clear day?", r"\bblue\b"),
    ("How many days are there in a week?", r"\bseven\b|\b7\b"),
    ("What is the largest planet in our solar system?", r"\bjupiter\b"),
    ("Who wrote Romeo and Juliet?", r"\bshakespeare\b"),
    ("At what temperature in Celsius does water boil at sea level?", r"\b100\b"),
    ("What is the opposite of hot?", r"\bcold\b"),
    ("Which farm animal says 'moo'?", r"\bcows?\b"),
    ("What is the chemical formula of water?", r"\bh2o\b|\bh₂o\b"),
    ("How many legs does a spider have?", r"\beight\b|\b8\b"),
    ("What is the capital of Japan?", r"\btokyo\b"),
    ("What language is mainly spoken in Spain?", r"\bspanish\b"),
    ("Which gas do plants take in from the air for photosynthesis?",
     r"carbon dioxide|\bco2\b|\bco₂\b"),
    ("How do you say 'hello' in French?", r"\bbonjour\b"),
    ("How many minutes are in an hour?", r"\bsixty\b|\b60\b"),
]

CANDIDATES: list[dict[str, float]] = [
    {"temperature": 0.0},
    {"temperature": 0.2, "top_p": 0.9},
    {"temperature": 0.3, "top_p": 0.9},
    {"temperature": 0.5, "top_p": 0.9},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.0, "top_p": 1.0},  # OpenAI's defaults: what a client gets unset
]


@dataclass
class Score:
    setting: dict[str, float]
    correct: int = 0
    looping: int = 0
    total: int = 0
    tokens: int = 0


def looping(text: str, window: int = 24, distinct: int = 8) -> bool:
    words = re.findall(r"\w+", text.lower())[-window:]
    return len(words) == window and len(set(words)) < distinct


def judge(llm, setting: dict[str, float], samples: int, max_tokens: int) -> Score:  # noqa: ANN001
    from engine import SamplingParams

    convs, params, patterns = [], [], []
    for q, pattern in JUDGED:
        for seed in range(samples):
            convs.append([{"role": "user", "content": q}])
            params.append(SamplingParams(max_tokens=max_tokens, seed=seed, **setting))
            patterns.append(pattern)
    score = Score(setting)
    for out, pattern in zip(llm.chat(convs, params), patterns):
        score.total += 1
        score.tokens += len(out.token_ids)
        score.correct += bool(re.search(pattern, out.text, re.IGNORECASE))
        score.looping += looping(out.text)
    return score


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="registry name, HF directory or .gguf (default: smollm2-135m)")
    p.add_argument("--samples", type=int, default=8,
                   help="answers per question and setting, seeds 0..N-1 (default: 8)")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="tokens per answer (default: 64)")
    p.add_argument("--settings", default=None,
                   help="settings to judge instead of the built-in list, e.g. "
                        "'temperature=0;temperature=0.3,top_p=0.9'")


def parse_settings(text: str) -> list[dict[str, float]]:
    """'a=1,b=2;c=3' -> [{'a': 1.0, 'b': 2.0}, {'c': 3.0}]"""
    return [{k.strip(): float(v) for k, v in (kv.split("=") for kv in part.split(","))}
            for part in text.split(";") if part.strip()]


def main(a: argparse.Namespace) -> int:
    from engine import LLM

    with LLM(model=a.model, kv_tier="none") as llm:
        print(f"{len(JUDGED)} questions x {a.samples} samples, {a.max_tokens} tokens max")
        print(f"{'setting':<36} {'correct':>8} {'looping':>8} {'tokens':>7} {'s':>6}")
        for setting in parse_settings(a.settings) if a.settings else CANDIDATES:
            t0 = time.monotonic()
            s = judge(llm, setting, a.samples, a.max_tokens)
            name = ", ".join(f"{k}={v}" for k, v in setting.items())
            print(f"{name:<36} {s.correct / s.total:>8.1%} {s.looping / s.total:>8.1%} "
                  f"{s.tokens / s.total:>7.1f} {time.monotonic() - t0:>6.1f}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    raise SystemExit(main(parser.parse_args()))

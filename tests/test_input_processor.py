"""InputProcessor (engine/input_processor.py) without a model: token ids are checked
against the vocabulary, and a request must fit the context window and the KV pool."""

from __future__ import annotations

import pytest

from engine.input_processor import InputProcessor, ModelLimits, PromptTooLongError
from engine.sampling_params import SamplingParams

LIMITS = ModelLimits(vocab_size=100, max_model_len=64, block_size=16, num_blocks=3)


def inputs(limits: ModelLimits = LIMITS) -> InputProcessor:
    return InputProcessor(None, limits, frozenset({2}), None, lambda skip: None)


def test_a_request_from_token_ids() -> None:
    req = inputs().make_request([5, 6, 7], SamplingParams(max_tokens=4), "r", b"salt",
                                output_token_ids=[8])
    assert (req.request_id, req.prompt_token_ids, req.output_token_ids, req.salt,
            req.eos_token_ids) == ("r", [5, 6, 7], [8], b"salt", frozenset({2}))
    assert req.grammar is None
    assert len(inputs().make_request([5], SamplingParams()).request_id) == 32  # uuid4 hex


@pytest.mark.parametrize("prompt, params, out, message", [
    ([], SamplingParams(), (), "prompt is empty"),
    ([5, 100], SamplingParams(), (), r"prompt_token_ids must be integers in \[0, 100\)"),
    ("text", SamplingParams(), (), "no tokenizer"),
    ([5], SamplingParams(logit_bias={100: 1.0}), (), "token id 100"),
    ([5], SamplingParams(stop_token_ids=[120]), (), "token id 120"),
    ([5], SamplingParams(n=2), [1], "n = 1"),
    ([5], SamplingParams(max_tokens=1), [1, 2], "more than max_tokens"),
    ([5], SamplingParams(), [100], r"token ids must be integers in \[0, 100\)"),
    ([5], SamplingParams(response_format={"type": "json_object"}), (), "needs a model"),
])
def test_what_the_model_cannot_take_is_refused(prompt, params, out, message) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        inputs().make_request(prompt, params, output_token_ids=out)


def test_a_request_must_fit_the_window_and_the_pool() -> None:
    inputs().make_request([5] * 32, SamplingParams(max_tokens=16))  # 48 tokens: 3 blocks
    with pytest.raises(PromptTooLongError, match="context window of 64"):
        inputs().make_request([5] * 60, SamplingParams(max_tokens=5))
    with pytest.raises(PromptTooLongError, match=r"3 x 16 tokens"):
        inputs().make_request([5] * 40, SamplingParams(max_tokens=9))


def test_without_a_tokenizer_there_is_no_template_nor_byte_bound() -> None:
    i = inputs()
    assert not i.template_renders_tools and i.max_prompt_bytes is None
    with pytest.raises(ValueError, match="no chat template"):
        i.apply_chat_template([{"role": "user", "content": "hi"}])

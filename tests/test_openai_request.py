"""service/openai_request.py without a server: an OpenAI body's sampling fields, types,
tools and prompts, and the errors a client reads."""

from __future__ import annotations

from typing import Any

import pytest

from service.openai_request import (MAX_PROMPT_SAMPLES, check_types, inputs, prompts,
                                    sampling_params, tools_of)
from service.protocol import ProtocolError


def refused(fn, *args: Any) -> str:  # noqa: ANN001
    with pytest.raises(ProtocolError) as e:
        fn(*args)
    assert e.value.code == "invalid_request"
    return e.value.message


def test_sampling_fields_map_onto_sampling_params_with_defaults_under_them() -> None:
    p = sampling_params({"max_completion_tokens": 7, "temperature": None, "top_p": 0.5},
                        True, {"temperature": 0.3, "top_p": 0.9})
    assert (p.max_tokens, p.temperature, p.top_p) == (7, 0.3, 0.5)
    assert sampling_params({}, True).max_tokens == 512
    assert sampling_params({}, False).max_tokens == 16


def test_logprobs_take_their_chat_and_legacy_shapes() -> None:
    assert sampling_params({"logprobs": True, "top_logprobs": 3}, True).logprobs == 3
    assert sampling_params({"logprobs": True}, True).logprobs == 0
    assert sampling_params({"logprobs": 2}, False).logprobs == 2
    assert sampling_params({"logprobs": True}, False).logprobs is None


def test_unknown_and_invalid_fields_are_invalid_requests() -> None:
    assert refused(sampling_params, {"temprature": 1, "zz": 2}, True) == \
        "unknown parameter(s): temprature, zz"
    refused(sampling_params, {"temperature": -1}, True)
    assert "not both" in refused(sampling_params, {"response_format": {"type": "json_object"},
                                                   "structured_outputs": {"json": {}}}, True)


def test_fields_read_directly_must_have_their_json_type() -> None:
    check_types({"stream": True, "user": "u", "stream_options": {"include_usage": True}}, True)
    assert refused(check_types, {"stream": 1}, False) == "stream must be a boolean"
    assert refused(check_types, {"top_logprobs": True}, True) == "top_logprobs must be an integer"
    check_types({"logprobs": 3}, False)  # legacy logprobs is an integer, read elsewhere
    refused(check_types, {"stream_options": {"include_usage": "yes"}}, True)


def test_prompts_as_openai_takes_them() -> None:
    assert prompts({"prompt": "hi"}) == ["hi"]
    assert prompts({"prompt": [1, 2]}) == [[1, 2]]
    assert prompts({"prompt": ["a", [3]]}) == ["a", [3]]
    for bad in ("", [], [True], ["a", ""], None, 5):
        refused(prompts, {"prompt": bad})
    assert MAX_PROMPT_SAMPLES == 256


def test_inputs_are_one_prompt_or_the_messages() -> None:
    assert inputs({"prompt": ["only"]}, False) == ("only", None)
    assert inputs({"prompt": [1, 2]}, False) == ([1, 2], None)
    assert inputs({"messages": [{"role": "user", "content": "x"}]}, True) == \
        (None, [{"role": "user", "content": "x"}])
    refused(inputs, {"prompt": ["a", "b"]}, False)


def test_tools_are_chat_parameters() -> None:
    assert tools_of({}, False) is None
    assert refused(tools_of, {"tool_choice": "none"}, False) == \
        "tool_choice is a /v1/chat/completions parameter"

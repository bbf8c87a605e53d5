"""service/openai_shapes.py: the chunk and logprobs objects OpenAI's clients parse."""

from __future__ import annotations

import json

from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from service.openai_shapes import chunk, finish_of, logprobs_of


class Tok:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_finish_reasons_as_openai_names_them() -> None:
    assert [finish_of(r) for r in ("stop", "length", "abort", "error", None, "x")] == \
        ["stop", "length", "stop", "error", None, None]


def test_a_chunk_is_one_server_sent_event() -> None:
    meta = {"id": "cmpl-1", "created": 1, "model": "m"}
    text = chunk(meta, True, [{"index": 0, "delta": {"content": "é"}}], {"total_tokens": 2})
    assert text.startswith("data: ") and text.endswith("\n\n") and "é" in text
    assert json.loads(text[6:]) == {**meta, "object": "chat.completion.chunk",
                                    "choices": [{"index": 0, "delta": {"content": "é"}}],
                                    "usage": {"total_tokens": 2}}
    assert json.loads(chunk(meta, False, [])[6:])["object"] == "text_completion"


def test_logprobs_in_the_chat_and_the_legacy_shape() -> None:
    lps = [TokenLogprob(0, -0.5, [(0, -0.5), (1, -1.0)]), TokenLogprob(2, -0.25, [(2, -0.25)])]
    out = RequestOutput("r", [9], [CompletionOutput(0, [0, 2], logprobs=lps)])
    chat = logprobs_of(out, 0, 1, True, Tok(), [b"A", b"B", b"C"])
    assert chat == {"content": [{"token": "c", "logprob": -0.25, "bytes": [67],
                                 "top_logprobs": [{"token": "c", "logprob": -0.25,
                                                   "bytes": [67]}]}]}
    legacy = logprobs_of(out, 0, 2, False, Tok())
    assert legacy == {"tokens": ["a", "c"], "token_logprobs": [-0.5, -0.25],
                      "top_logprobs": [{"a": -0.5, "b": -1.0}, {"c": -0.25}]}
    assert logprobs_of(out, 0, 0, False, None) == {"tokens": [], "token_logprobs": [],
                                                   "top_logprobs": []}
    out.outputs[0].logprobs = None
    assert logprobs_of(out, 0, 1, True, Tok()) is None

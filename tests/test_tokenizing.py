"""service/tokenizing.py over a fake engine: the size check before tokenizing, which
prompts go off the event loop, and the tokenizer's errors as the client's."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from service import tokenizing
from service.protocol import ProtocolError
from service.tokenizing import INLINE_PROMPT_BYTES, PromptTokenizer, _text_bytes


def fake_engine(max_prompt_bytes: int | None = 100) -> Any:
    calls: list[tuple[str, bool]] = []

    def tokenize(prompt: str | list[int], any_thread: bool = False) -> list[int]:
        calls.append((threading.current_thread().name, any_thread))
        if prompt == "bad":
            raise ValueError("cannot tokenize that")
        return list(range(len(prompt)))

    def apply_chat_template(messages: list[dict[str, Any]], generation_prompt: bool,
                            tools: Any, any_thread: bool) -> list[int]:
        raise KeyError("no template variable")

    return SimpleNamespace(max_prompt_bytes=max_prompt_bytes, max_model_len=32,
                           tokenize=tokenize, apply_chat_template=apply_chat_template,
                           calls=calls)


def test_text_bytes_is_exact_up_to_the_bound_and_over_it_past() -> None:
    assert _text_bytes("héllo", None, 100) == 6
    assert _text_bytes([1, 2, 3], [{"role": "u", "content": "ab"}, {"content": None}], 100) == 2
    assert _text_bytes("x" * 300, None, 100) > 100
    assert _text_bytes(None, [{"content": "é" * 60}] * 3, 100) > 100


def test_only_prompts_over_the_inline_size_go_off_the_loop(monkeypatch) -> None:  # noqa: ANN001
    tok = PromptTokenizer(fake_engine())
    assert not tok.off_loop("x" * INLINE_PROMPT_BYTES, None)
    assert tok.off_loop("x" * (INLINE_PROMPT_BYTES + 1), None)
    monkeypatch.setattr(tokenizing, "INLINE_PROMPT_BYTES", 10)  # read at each call
    assert tok.off_loop("x" * 11, None) and not tok.off_loop([1] * 100, None)
    tok.close()


def test_a_prompt_too_large_for_the_context_is_refused_before_tokenizing() -> None:
    eng = fake_engine(max_prompt_bytes=100)
    tok = PromptTokenizer(eng)
    with pytest.raises(ProtocolError) as e:
        tok.ids("x" * 101, None, "r1")
    assert e.value.code == "context_length_exceeded" and e.value.request_id == "r1"
    assert eng.calls == []
    assert tok.ids("x" * 100, None, "r1") == list(range(100))
    PromptTokenizer(fake_engine(max_prompt_bytes=None)).check_size("x" * 10**6, None, None)
    tok.close()


def test_tokenizer_and_template_errors_are_invalid_requests() -> None:
    tok = PromptTokenizer(fake_engine())
    with pytest.raises(ProtocolError) as e:
        tok.ids("bad", None, "r1")
    assert (e.value.code, e.value.message) == ("invalid_request", "cannot tokenize that")
    with pytest.raises(ProtocolError) as e:
        tok.ids(None, [{"role": "user", "content": "hi"}], "r2")
    assert e.value.code == "invalid_request"
    assert e.value.message.startswith("cannot apply the chat template")
    tok.close()


def test_prompt_ids_run_on_the_tokenizing_thread() -> None:
    eng = fake_engine()
    tok = PromptTokenizer(eng)

    async def run() -> list[int]:
        return await tok.prompt_ids("abc", None, "r1")

    assert asyncio.run(run()) == [0, 1, 2]
    assert eng.calls[-1][0].startswith("tidewire-tokenize") and eng.calls[-1][1]
    tok.close()

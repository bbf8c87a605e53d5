"""A request's prompt as token ids: small prompts tokenized on the event loop, large ones
on one tokenizing thread (the Rust tokenizer releases the GIL: the loop keeps streaming
meanwhile), after a check of their size in bytes against the context window."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

from engine import AsyncEngine
from service.protocol import ProtocolError

T = TypeVar("T")

# prompts up to this size (UTF-8 bytes of the text or of the messages' contents) are
# tokenized on the event loop (~20 us a KiB); larger ones on the tokenizing thread
INLINE_PROMPT_BYTES = 16 * 1024


class PromptTokenizer:
    """Tokenizes prompts and chat messages for the Gateway, on or off the event loop."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="tidewire-tokenize")

    def off_loop(self, prompt: str | list[int] | None,
                 messages: list[dict[str, Any]] | None) -> bool:
        """Whether this prompt is large enough to be tokenized off the event loop."""
        return _text_bytes(prompt, messages, INLINE_PROMPT_BYTES) > INLINE_PROMPT_BYTES

    async def prompt_ids(self, prompt: str | list[int] | None,
                         messages: list[dict[str, Any]] | None, request_id: str | None,
                         generation_prompt: bool = True,
                         tools: list[dict[str, Any]] | None = None,
                         template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt's token ids, tokenized on the tokenizing thread (a large prompt)
        after a check of its size in bytes against the context window: one that cannot
        fit is refused before any tokenizing."""
        self.check_size(prompt, messages, request_id)
        return await self.off_the_loop(self.ids, prompt, messages, request_id or "",
                                       generation_prompt, tools, True, template_kwargs)

    async def off_the_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the tokenizing thread (tokenizer work on a large input)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def check_size(self, prompt: str | list[int] | None,
                   messages: list[dict[str, Any]] | None, request_id: str | None) -> None:
        """Refuse (context_length_exceeded) a prompt whose bytes are more than the
        context window can hold with this tokenizer."""
        most = self.engine.max_prompt_bytes
        if most is None:
            return
        size = _text_bytes(prompt, messages, most)
        if size > most:
            raise ProtocolError(
                "context_length_exceeded", f"the prompt's {size} bytes are more than "
                f"{self.engine.max_model_len} tokens, the context window, can hold "
                f"(at most {most} bytes with this tokenizer)", request_id)

    def ids(self, prompt: str | list[int] | None, messages: list[dict[str, Any]] | None,
            rid: str, generation_prompt: bool = True,
            tools: list[dict[str, Any]] | None = None,
            any_thread: bool = False,
            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt's token ids, tokenized now. `any_thread`: use only what is safe
        off the event loop (Rust encode). `template_kwargs`: the chat template's extra
        variables (service.reasoning.ThinkOptions)."""
        eng = self.engine
        if not any_thread:
            self.check_size(prompt, messages, rid)
        try:
            if messages is not None and template_kwargs:
                return self._render(messages, generation_prompt, tools, any_thread,
                                    template_kwargs)
            if messages is not None:
                return eng.apply_chat_template(messages, generation_prompt, tools, any_thread)
            assert prompt is not None
            return eng.tokenize(prompt, any_thread)
        except (ValueError, TypeError) as e:
            raise ProtocolError("invalid_request", str(e), rid) from None
        except Exception as e:  # noqa: BLE001 - a template error is the client's input
            raise ProtocolError("invalid_request", f"cannot apply the chat template: {e}",
                                rid) from None

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool,
                tools: list[dict[str, Any]] | None, any_thread: bool,
                template_kwargs: dict[str, Any]) -> list[int]:
        """A conversation rendered with extra template variables, then tokenized as the
        engine's own any-thread path does (the engine's apply_chat_template takes none)."""
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        kw = {"tools": tools} if tools else {}
        text = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                       tokenize=False, **kw, **template_kwargs)
        return self.engine.tokenize(text, any_thread)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def _text_bytes(prompt: str | list[int] | None, messages: list[dict[str, Any]] | None,
                above: int) -> int:
    """The UTF-8 size of a prompt's text (0 for token ids), exact up to `above` and more
    than `above` past it (a string longer than that in characters is not encoded)."""
    texts = ([prompt] if isinstance(prompt, str) else []) + [
        m["content"] for m in messages or () if isinstance(m.get("content"), str)]
    size = 0
    for t in texts:
        size += len(t) if len(t) > above else len(t.encode("utf-8", "surrogatepass"))
        if size > above:
            break
    return size

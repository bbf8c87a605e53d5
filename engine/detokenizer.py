"""Incremental detokenization: text deltas that never split a UTF-8 character."""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside, so word-initial spaces survive
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.num_context = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the new text that is safe to show."""
        if self.tok is None:
            return ""
        self.ids.extend(new_ids)
        if final:
            full = self._decode(self.ids[self.num_context:])
            delta = full[len(self.text):] if full.startswith(self.text) else ""
            self.text += delta
            return delta
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new = self._decode(self.ids[self.prefix_offset :])
        if len(new) <= len(prefix) or new.endswith(_REPLACEMENT):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        delta = new[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

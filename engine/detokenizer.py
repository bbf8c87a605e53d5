"""Incremental detokenization with stop strings.

Text deltas never split a UTF-8 character (a decode ending in U+FFFD waits for the next
token) and never run past a stop string: text that could still become the start of a
stop string is held back until the next tokens decide it.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside, so word-initial spaces survive
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True, stop: tuple[str, ...] = ()) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.stop = stop
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.num_context = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all decoded output text (may include held-back text)
        self.emitted = 0  # characters of self.text already handed out
        self.stop_hit: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the text that became safe to show. After a stop string
        is found (`stop_hit`), the text ends just before it and nothing more comes."""
        if self.tok is None or self.stop_hit is not None:
            return ""
        before = len(self.text)
        self.ids.extend(new_ids)
        if final:
            self._decode_all()
        else:
            self._decode_new()
        if self.stop and self._find_stop(before):
            return self._take(len(self.text))
        if final:
            return self._take(len(self.text))
        return self._take(len(self.text) - self._holdback())

    def _decode_new(self) -> None:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new = self._decode(self.ids[self.prefix_offset :])
        if len(new) > len(prefix) and not new.endswith(_REPLACEMENT):
            self.text += new[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _decode_all(self) -> None:
        """At the end, whatever is still pending (an incomplete character) is decoded."""
        pending = self.ids[self.prefix_offset :]
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new = self._decode(pending)
        if len(new) > len(prefix):
            self.text += new[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)

    def _find_stop(self, before: int) -> bool:
        """Search only where a stop string could newly end; truncate at the first hit."""
        longest = max(len(s) for s in self.stop)
        start = max(0, before - longest + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        self.text = self.text[: best[0]]
        self.stop_hit = best[1]
        return True

    def _holdback(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        tail_max = min(len(self.text) - self.emitted, max((len(s) for s in self.stop), default=0))
        for n in range(tail_max, 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _take(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta

    @property
    def output_text(self) -> str:
        """The text handed out so far (the final text once finished)."""
        return self.text[: self.emitted]

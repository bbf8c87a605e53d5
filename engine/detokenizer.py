"""Incremental detokenization with stop strings.

Text deltas never split a UTF-8 character (a decode ending in U+FFFD waits for the next
token) and never run past a stop string: text that could still become the start of a
stop string is held back until the next tokens decide it.
"""

from __future__ import annotations

import codecs
import functools
import random
from typing import Any

from engine.outputs import join_chunks

_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside, so word-initial spaces survive
_REPLACEMENT = "\ufffd"
_CHECK_SAMPLE = 2048  # vocabulary entries cross-checked against tokenizer.decode


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable stand-in character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def byte_level_table(tokenizer: Any, skip_special_tokens: bool = True) -> list[bytes] | None:
    """The raw bytes of every token id, for tokenizers whose decoder is plain ByteLevel
    (GPT-2, SmolLM2, Qwen2, Llama 3), or None when that does not hold.

    With it, detokenizing a step is a table lookup and an incremental UTF-8 decode
    (about 1 us a token) instead of two `tokenizer.decode` calls (about 8 us). The
    ByteLevel decoder maps each character of a token through the byte alphabet and
    takes a token with any character outside it as its UTF-8 text, so this is exact;
    the table is still cross-checked against `decode` on a sample of the vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel" \
            or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    alphabet = _byte_decoder()
    special = set()
    if skip_special_tokens:  # decode skips added tokens flagged special, listed or not
        special = {i for i, a in tokenizer.added_tokens_decoder.items() if a.special}
        special |= set(tokenizer.all_special_ids)
    table = []
    for i, t in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in special or t is None:
            table.append(b"")
        elif all(c in alphabet for c in t):
            table.append(bytes(alphabet[c] for c in t))
        else:
            table.append(t.encode())
    ids = random.Random(0).sample(range(len(table)), min(_CHECK_SAMPLE, len(table)))
    for i in [*ids, *special]:
        want = tokenizer.decode([i], skip_special_tokens=skip_special_tokens)
        if table[i].decode("utf-8", "replace") != want:
            return None
    return table


@functools.lru_cache(maxsize=256)
def failure_tables(stops: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each stop string's KMP failure table: entry i is the length of the longest proper
    prefix of s[: i + 1] that is also a suffix of it (cached: requests repeat stops)."""
    tables = []
    for s in stops:
        t = [0] * len(s)
        m = 0
        for i in range(1, len(s)):
            while m and s[i] != s[m]:
                m = t[m - 1]
            if s[i] == s[m]:
                m += 1
            t[i] = m
        tables.append(tuple(t))
    return tuple(tables)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True, stop: tuple[str, ...] = (),
                 table: list[bytes] | None = None) -> None:
        """`table` (from `byte_level_table`, built for the same skip_special_tokens)
        switches to the byte-level fast path."""
        self.tok = tokenizer
        self.table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if table else None
        self.skip = skip_special_tokens
        self.stop = stop
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.num_context = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        # What was handed out, as a list: one string grown per token would be a copy of
        # all of it per token (quadratic in the output's length).
        self._pieces: list[str] = []
        # The working text: decoded text not handed out yet (held back: it may be the
        # start of a stop string), after the last `_keep` characters handed out (where a
        # stop string ending in new text may begin). The byte-level path without stop
        # strings holds nothing back and leaves it empty.
        self.text = ""
        self.emitted = 0  # characters of self.text already handed out
        self._keep = max((len(s) for s in stop), default=1) - 1
        # per stop string: its KMP failure table, and how much of it the text's tail
        # matches now (memory and time linear in the stop strings' lengths, where a set
        # of every prefix of every stop string was quadratic)
        self._tables = failure_tables(stop)
        self._matched = [0] * len(stop)
        self.stop_hit: str | None = None

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tok.decode(ids, skip_special_tokens=self.skip)
        return text

    def _bytes(self, ids: list[int]) -> bytes:
        """The tokens' bytes; an id the tokenizer does not have (a model's lm_head can be
        padded past its vocabulary) has none."""
        t = self.table
        assert t is not None
        return b"".join([t[i] if i < len(t) else b"" for i in ids])

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the text that became safe to show. After a stop string
        is found (`stop_hit`), the text ends just before it and nothing more comes."""
        if self.tok is None or self.stop_hit is not None:
            return ""
        if self.table is not None and not self.stop:  # the common case, per token per step
            t = self.table
            try:
                raw = b"".join([t[i] for i in new_ids])
            except IndexError:  # an id past the tokenizer's vocabulary (a padded lm_head)
                raw = self._bytes(new_ids)
            piece = self._utf8.decode(raw, final)  # type: ignore[union-attr]
            if piece:
                self._pieces.append(piece)
            return piece
        before = len(self.text)
        if self.table is not None:
            self._decode_bytes(new_ids, final)
        else:
            self.ids.extend(new_ids)
            self._decode_all() if final else self._decode_new()
        if self.stop and self._find_stop(before):
            return self._take(len(self.text))
        if final:
            return self._take(len(self.text))
        return self._take(len(self.text) - self._holdback(before))

    def _decode_bytes(self, new_ids: list[int], final: bool) -> None:
        """An incomplete UTF-8 sequence at the end stays in the decoder until the bytes
        that complete it arrive (or, at the end, comes out as U+FFFD, as decode does)."""
        assert self._utf8 is not None
        self.text += self._utf8.decode(self._bytes(new_ids), final)

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
        start = max(0, before - self._keep)
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

    def _holdback(self, before: int) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string
        (never more than what is not handed out yet). Scans only the characters added
        since `before`, carrying each stop string's match length from one call to the
        next."""
        new = self.text[before:]
        matched = self._matched
        for k, (stop, table) in enumerate(zip(self.stop, self._tables)):
            m = matched[k]
            for c in new:
                while m and (m == len(stop) or stop[m] != c):
                    m = table[m - 1]
                if stop[m] == c:
                    m += 1
            matched[k] = m if m < len(stop) else table[m - 1]
        limit, hold = len(self.text) - self.emitted, 0
        for m, table in zip(matched, self._tables):
            while m > limit:  # a shorter match that starts in the text not handed out
                m = table[m - 1]
            hold = max(hold, m)
        return hold

    def _take(self, upto: int) -> str:
        """Hand out the working text up to `upto`; keep only its last `_keep` handed-out
        characters."""
        upto = max(upto, self.emitted)
        delta = self.text[self.emitted : upto]
        if delta:
            self._pieces.append(delta)
        cut = upto - self._keep
        if cut > 0:
            self.text = self.text[cut:]
            upto -= cut
        self.emitted = upto
        return delta

    @property
    def output_text(self) -> str:
        """The text handed out so far (the final text once finished)."""
        return join_chunks(self._pieces)

"""What a structured-output constraint may cost and produce, beside xgrammar.

Checked before any compile: JSON schemas (keywords xgrammar would not enforce, and how
deep the document nests) and regular expressions (how deep their groups nest: xgrammar's
regex converter recurses per group and overflows the C stack near 50,000 levels).

Bounded so that every JSON output ends: an integer the schema leaves unbounded gets the
signed 64-bit range (xgrammar enforces minimum/maximum exactly), and every string and
number is held to a length by a per-sample guard over xgrammar's token mask (JsonGuard):
xgrammar's own maxLength rule costs seconds to compile and refuses escapes, so a
default length cannot be written into the grammar (docs/structured-outputs.md).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_SCHEMA_DEPTH = 64  # levels of objects and arrays in a JSON schema document
MAX_REGEX_DEPTH = 64  # levels of nested groups in a regex (response_format or pattern)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # an integer's range when the schema sets none
# A string's default length, in characters (an escape is one): ~1,000 tokens of prose,
# past what a field of a structured answer holds, short of what a looping model burns
# before a typical max_tokens. A schema's own maxLength (or minLength, const, enum)
# raises it.
STRING_CHARS = 4096
INT_DIGITS = 20  # a number's integer digits: int64 and uint64 fit
FRACTION_DIGITS = 20  # past float64's 17 significant digits
EXPONENT_DIGITS = 3  # float64's exponents reach 308

# Keywords xgrammar accepts but does not enforce (checked: an output that breaks them
# passes its matcher). A schema using one is refused rather than silently loosened.
UNENFORCED = ("not", "if", "then", "else", "uniqueItems", "dependentRequired",
              "dependentSchemas", "dependencies")
_SUBSCHEMA = ("additionalProperties", "items", "contains", "propertyNames",
              "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


# -- checks -----------------------------------------------------------------------------

def json_depth(value: Any, limit: int) -> int:
    """How many levels of objects and arrays `value` nests, counted without recursion
    and only up to limit + 1 (so a 10,000-deep or cyclic value costs little)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if not isinstance(v, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            break
        stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def check_depth(value: Any, what: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """ValueError when `value` nests objects and arrays more than `limit` levels."""
    if json_depth(value, limit) > limit:
        raise ValueError(f"{what} is nested more than {limit} levels deep (objects and arrays)")


def regex_depth(pattern: str) -> int:
    """The deepest nesting of groups in `pattern` (escaped characters and character
    classes skipped; a close paren too many is not counted below zero)."""
    depth = deepest = i = 0
    in_class = False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:  # (a class ends at its first "]", even "[]": counting too deep is safe)
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(depth - 1, 0)
        i += 1
    return deepest


def check_regex_depth(pattern: str, what: str) -> None:
    depth = regex_depth(pattern)
    if depth > MAX_REGEX_DEPTH:
        raise ValueError(f"{what} nests groups {depth} levels deep (the most is "
                         f"{MAX_REGEX_DEPTH})")


def check_regex(pattern: str) -> None:
    """A response_format regex: its nesting, then Python's parser for the common
    mistakes (xgrammar checks the rest). Every failure is a ValueError."""
    check_regex_depth(pattern, "response_format.regex")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"invalid regex: {e}") from None
    except (RecursionError, MemoryError, OverflowError) as e:
        raise ValueError(f"invalid regex: too complex to parse ({type(e).__name__})") from None


_EBNF_REGEX = re.compile(r'Regex\(\s*"((?:[^"\\]|\\.)*)"')


def check_grammar(text: str) -> None:
    """An EBNF grammar's Regex("...") rules nest no deeper than a regex may (xgrammar's
    EBNF parser bounds the nesting of the grammar itself)."""
    for m in _EBNF_REGEX.finditer(text):
        check_regex_depth(re.sub(r"\\([\\\"])", r"\1", m.group(1)), "a Regex in the grammar")


def subschemas(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in `schema` with its location ("#/properties/x"), found
    without recursion."""
    stack = [("#", schema)]
    while stack:
        where, s = stack.pop()
        if not isinstance(s, dict):
            continue
        yield where, s
        for key in _SUBSCHEMA:
            if isinstance(s.get(key), list):  # "items" in its old tuple form
                stack.extend((f"{where}/{key}/{i}", v) for i, v in enumerate(s[key]))
            elif key in s:
                stack.append((f"{where}/{key}", s[key]))
        for key in _SUBSCHEMA_MAPS:
            if isinstance(s.get(key), dict):
                stack.extend((f"{where}/{key}/{n}", v) for n, v in s[key].items())
        for key in _SUBSCHEMA_LISTS:
            if isinstance(s.get(key), list):
                stack.extend((f"{where}/{key}/{i}", v) for i, v in enumerate(s[key]))


def check_schema(schema: Any) -> None:
    """Raise ValueError for a schema nested past MAX_SCHEMA_DEPTH, a pattern nested past
    MAX_REGEX_DEPTH, or a part the constraint would not enforce: an UNENFORCED keyword,
    allOf over several schemas, or a $ref outside the schema."""
    check_depth(schema, "the JSON schema")
    for where, s in subschemas(schema):
        _check_keywords(s, where)
        if isinstance(s.get("pattern"), str):
            check_regex_depth(s["pattern"], f"the JSON schema's pattern at {where}")
        if isinstance(s.get("patternProperties"), dict):
            for p in s["patternProperties"]:
                check_regex_depth(p, f"the JSON schema's patternProperties at {where}")


def _check_keywords(s: dict[str, Any], where: str) -> None:
    for key in UNENFORCED:
        if key in s:
            raise ValueError(f'invalid JSON schema: "{key}" (at {where}) is not supported: '
                             "the output could not be held to it")
    if isinstance(s.get("allOf"), list) and len(s["allOf"]) > 1:
        raise ValueError(f'invalid JSON schema: "allOf" over several schemas (at {where}) is '
                         "not supported: merge them into one")
    ref = s.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise ValueError(f"invalid JSON schema: $ref {ref!r} (at {where}) is not supported: "
                         "only references inside the schema (#/...)")


# -- bounds -----------------------------------------------------------------------------

def _is_number(v: Any) -> bool:
    """A finite JSON number (Python's json also reads NaN and Infinity)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def with_int64_bounds(schema: Any) -> Any:
    """A copy of `schema` in which every integer without a minimum (maximum) gets
    INT64_MIN (INT64_MAX); a side the schema bounds is left as it is (xgrammar refuses
    an integer bound outside int64)."""
    schema = json.loads(json.dumps(schema))  # (depth-checked: no recursion limit near)
    for _, s in subschemas(schema):
        types = s.get("type")
        types = types if isinstance(types, list) else [types]
        if "integer" not in types or "number" in types:
            continue
        if not (_is_number(s.get("minimum")) or _is_number(s.get("exclusiveMinimum"))):
            s["minimum"] = INT64_MIN
        if not (_is_number(s.get("maximum")) or _is_number(s.get("exclusiveMaximum"))):
            s["maximum"] = INT64_MAX
    return schema


@dataclass(frozen=True)
class JsonLimits:
    """The lengths JsonGuard holds a JSON output's strings and numbers to."""

    string_chars: int = STRING_CHARS
    int_digits: int = INT_DIGITS
    fraction_digits: int = FRACTION_DIGITS
    exponent_digits: int = EXPONENT_DIGITS


def limits_for(schema: Any) -> JsonLimits:
    """The defaults, raised to whatever the schema itself allows: its maxLength and
    minLength, the strings and numbers of its const and enum values and property names,
    the digits of its numeric bounds. (One limit per schema: a field's own maxLength
    of 10,000 lets every string of that schema run to 10,000.)"""
    strings, numbers = [STRING_CHARS], []
    for _, s in subschemas(schema):
        strings += [int(s[k]) for k in ("maxLength", "minLength") if _is_number(s.get(k))]
        props = s.get("properties")
        strings += [len(k) for k in props] if isinstance(props, dict) else []
        numbers += [s[k] for k in _BOUNDS if _is_number(s.get(k))]
        for v in _scalars([s.get("const"), s.get("enum")]):
            strings += [len(v)] if isinstance(v, str) else []
            numbers += [v] if _is_number(v) else []
    parts = [_digits(n) for n in numbers]
    return JsonLimits(max(strings),
                      max([INT_DIGITS] + [p[0] for p in parts]),
                      max([FRACTION_DIGITS] + [p[1] for p in parts]),
                      max([EXPONENT_DIGITS] + [p[2] for p in parts]))


def _scalars(value: Any) -> Iterator[Any]:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        else:
            yield v


def _digits(n: float) -> tuple[int, int, int]:
    """(integer, fraction, exponent) digits of n as JSON writes it, the integer digits
    at least those of n written out in full (a bound of 1e30 allows 31 digits)."""
    m = re.fullmatch(r"-?(\d+)(?:\.(\d+))?(?:[eE][+-]?(\d+))?", json.dumps(n))
    assert m is not None  # (n is finite)
    return (max(len(m.group(1)), len(str(int(abs(n))))), len(m.group(2) or ""),
            len(m.group(3) or ""))


# -- the guard --------------------------------------------------------------------------

# lexer modes: outside strings and numbers; in a string; in a number's integer part,
# fraction, exponent (its sign still allowed: EXP_SIGN)
OUTSIDE, STRING, INT, FRACTION, EXP_SIGN, EXP = range(6)
_DIGITS = b"0123456789"
_CONTINUATION = bytes(range(0x80, 0xC0))  # UTF-8 continuation bytes: part of a character


class VocabTables:
    """Per tokenizer: for each token, the string characters it adds before closing the
    string it starts in, and the digits it starts with (after a sign: `signed`); and
    bitmasks (xgrammar's int32 layout) of the tokens within a budget, built on first use.
    Special and stop tokens count 0 (xgrammar decides on them)."""

    def __init__(self, vocab: list[bytes], special: set[int]) -> None:
        self.vocab = vocab
        self.special = special
        self.leads: dict[str, list[int]] = {k: [0] * len(vocab)
                                            for k in ("string", "digit", "signed")}
        # tokens that stay inside a string as plain characters (no quote, no escape)
        self.plain = [t not in special and b'"' not in tok and b"\\" not in tok
                      for t, tok in enumerate(vocab)]
        for t, tok in enumerate(vocab):
            if t not in special:
                self._measure(t, tok)
        self.most = {k: max(v, default=0) for k, v in self.leads.items()}
        self._masks: dict[tuple[str, int], Any] = {}

    def _measure(self, t: int, tok: bytes) -> None:
        self.leads["string"][t] = _string_lead(tok)
        self.leads["digit"][t] = len(tok) - len(tok.lstrip(_DIGITS))
        signed = tok[1:] if tok[:1] in (b"+", b"-") else tok
        self.leads["signed"][t] = len(signed) - len(signed.lstrip(_DIGITS))

    def fits(self, table: str, budget: int, token: int) -> bool:
        return budget >= self.most[table] or self.leads[table][token] <= budget

    def mask(self, table: str, budget: int) -> Any:
        """The tokens whose `table` lead is within `budget`, as a [words] int32 tensor;
        None when every token is."""
        if budget >= self.most[table]:
            return None
        key = (table, budget)
        if key not in self._masks:  # (a race builds the same tensor twice: harmless)
            import torch

            ok = np.asarray(self.leads[table]) <= budget
            ok = np.concatenate([ok, np.zeros(-len(ok) % 32, bool)])
            self._masks[key] = torch.from_numpy(
                np.packbits(ok, bitorder="little").view("<i4").copy())
        return self._masks[key]


def _string_lead(tok: bytes) -> int:
    """Characters `tok` adds to a string (at no pending escape) before a closing quote."""
    if b"\\" not in tok:
        end = tok.find(b'"')
        return len((tok if end < 0 else tok[:end]).translate(None, _CONTINUATION))
    state = (STRING, 0, 0)
    for b in tok:
        state = _lex(state, b)
        if state[0] != STRING:
            break
    return state[1]


def _lex(state: tuple[int, int, int], b: int) -> tuple[int, int, int]:
    """One byte of JSON text. state: (mode, count, escape): count is the string's
    characters or the number part's digits; escape (in a string) 0, 1 after a backslash,
    2-5 while the hex digits of a \\u escape remain."""
    mode, count, esc = state
    if mode == STRING:
        if esc == 1:  # the byte after a backslash: "u" starts four hex digits
            return (STRING, count, 5 if b == 0x75 else 0)
        if esc:  # a hex digit: 5 -> 4 -> 3 -> 2 -> 0
            return (STRING, count, esc - 1 if esc > 2 else 0)
        if b == 0x22:  # the closing quote
            return (OUTSIDE, 0, 0)
        return (STRING, count + int(not 0x80 <= b < 0xC0), 1 if b == 0x5C else 0)
    digit = 0x30 <= b <= 0x39
    if mode in (INT, FRACTION, EXP) and digit:
        return (mode, count + 1, 0)
    if mode == EXP_SIGN and (digit or b in (0x2B, 0x2D)):
        return (EXP, int(digit), 0)
    if mode in (INT, FRACTION) and b in (0x65, 0x45):  # e E
        return (EXP_SIGN, 0, 0)
    if mode == INT and b == 0x2E:  # .
        return (FRACTION, 0, 0)
    if b == 0x22:
        return (STRING, 0, 0)
    if digit or b == 0x2D:  # a number starts (outside, or after a number ended: never)
        return (INT, int(digit), 0)
    return (OUTSIDE, 0, 0)


class JsonGuard:
    """One sample's lengths so far: the characters of the string it is in, the digits of
    the number part it is in. When one nears its limit, only tokens that stay within it
    are allowed (a token that completes an escape may run past it by its own length,
    after which the string must close). `allows` and `restrict` ask the same question."""

    __slots__ = ("_t", "_limits", "_state", "_past")

    def __init__(self, tables: VocabTables, limits: JsonLimits) -> None:
        self._t = tables
        self._limits = limits
        self._state = (OUTSIDE, 0, 0)
        self._past: list[tuple[int, int, int]] = []

    def _budget(self) -> tuple[str, int] | None:
        """The lead table that applies to the next token, and how much it may add."""
        mode, count, esc = self._state
        lim = self._limits
        if mode == STRING:
            return None if esc else ("string", lim.string_chars - count)
        if mode == OUTSIDE:  # a token may start a number, with its sign
            return "signed", lim.int_digits
        if mode == EXP_SIGN:
            return "signed", lim.exponent_digits
        return "digit", (lim.int_digits if mode == INT else lim.fraction_digits
                         if mode == FRACTION else lim.exponent_digits) - count

    def allows(self, token: int) -> bool:
        b = self._budget()
        return b is None or self._t.fits(b[0], max(b[1], 0), token)

    def restrict(self, bitmask: Any, row: int) -> None:
        """AND row `row` of the [rows, words] int32 bitmask with the tokens `allows`
        (untouched while no length is near its limit)."""
        b = self._budget()
        if b is None or b[1] >= self._t.most[b[0]]:
            return
        mask = self._t.mask(b[0], max(b[1], 0))
        bitmask[row, :len(mask)] &= mask

    def advance(self, token: int) -> None:
        self._past.append(self._state)
        mode, count, esc = state = self._state
        t = self._t
        if mode == STRING and not esc and t.plain[token]:  # the common case, in one step
            self._state = (STRING, count + t.leads["string"][token], 0)
        elif token not in t.special:
            for b in t.vocab[token]:
                state = _lex(state, b)
            self._state = state

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._state = self._past[-num_tokens]
            del self._past[-num_tokens:]

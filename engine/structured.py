"""Structured outputs: constraints on what a request may generate, compiled by xgrammar.

A request's `response_format` (SamplingParams) names a constraint: a JSON schema, any
JSON object, a regular expression, a choice among strings, or an EBNF grammar. The
engine's GrammarCompiler turns it into a token automaton on a worker thread (never the
engine thread), once per distinct constraint: compiles are cached by the constraint's
text (and the compiler belongs to one tokenizer). Each constrained sample then gets a
matcher: before each sampling step it fills the row's bitmask of allowed tokens, which
the sampler applies before anything else touches the logits; after the step it accepts
the sampled token. A matcher that has accepted a stop token (EOS) is terminated and the
request ends ("stop"), with ignore_eos too. JSON outputs are bounded so that each ends:
integers to int64 unless the schema says otherwise, strings and numbers to a length
(engine/json_bounds.py).

Why xgrammar: it is what vLLM and SGLang use, its CPU wheels need nothing but torch, and
measured here (SmolLM2's 49k vocabulary, 2-core CPU) a JSON-schema mask costs a few
microseconds a row and a 20-property schema compiles in ~5 ms.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from engine.json_bounds import (JsonGuard, JsonLimits, VocabTables, check_depth, check_grammar,
                                check_regex, check_schema, limits_for, with_int64_bounds)

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 * 1024  # a schema, regex or grammar longer than this is refused
MAX_CHOICES = 1024
COMPILE_TIMEOUT = 30.0  # seconds a request waits for its constraint to compile
_CACHE_ENTRIES = 512
# Compiled grammars kept, by xgrammar's own measure (memory_size_bytes): from a few kB
# (a regex) to a few MB (a schema with long maxLength strings), so some hundreds to
# tens of thousands of constraints.
CACHE_BYTES = 256 * 1024 * 1024


class GrammarError(ValueError):
    """A constraint that cannot be compiled (invalid, unsupported or too slow)."""


@dataclass(frozen=True)
class ResponseFormat:
    """A normalized constraint: `kind` (one of KINDS) and its text: the schema as
    canonical JSON, the regex, the choices as a JSON list, the grammar. Hashable: it is
    the compile cache's key."""

    kind: str
    spec: str = ""
    name: str = ""  # a json_schema's name (OpenAI requires one; informational)

    @staticmethod
    def parse(value: Any) -> ResponseFormat | None:
        """From what a client sends (OpenAI's `response_format` shapes plus `regex`,
        `choice` and `grammar` types), a Pydantic model class, or a ResponseFormat.
        None (or {"type": "text"}) means unconstrained. Raises ValueError naming the
        problem."""
        if value is None or isinstance(value, ResponseFormat):
            return value
        if isinstance(value, type) and hasattr(value, "model_json_schema"):  # Pydantic
            return ResponseFormat("json_schema", _canonical(value.model_json_schema()),
                                  value.__name__)
        if not isinstance(value, dict):
            raise ValueError("response_format must be an object with a type")
        kind = value.get("type")
        fields = {"text": (), "json_object": ("schema",), "json_schema": ("json_schema",),
                  "regex": ("regex",), "choice": ("choice",), "grammar": ("grammar",)}
        if kind not in fields:
            raise ValueError(f"response_format.type must be one of {', '.join(fields)}, "
                             f"got {kind!r}")
        extra = sorted(set(value) - {"type", *fields[kind]})
        if extra:
            raise ValueError(f"unknown response_format field(s) for type {kind}: "
                             f"{', '.join(extra)}")
        if kind == "text":
            return None
        if kind == "json_object":  # vLLM-style: an optional schema narrows it
            schema = value.get("schema")
            return (ResponseFormat("json_object") if schema is None
                    else ResponseFormat("json_schema", _schema_text(schema)))
        if kind == "json_schema":
            js = value.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise ValueError("response_format.json_schema must be an object with a schema")
            extra = sorted(set(js) - {"name", "schema", "strict", "description"})
            if extra:
                raise ValueError(f"unknown response_format.json_schema field(s): "
                                 f"{', '.join(extra)}")
            name = js.get("name", "")
            if not isinstance(name, str):
                raise ValueError("response_format.json_schema.name must be a string")
            return ResponseFormat("json_schema", _schema_text(js["schema"]), name)
        if kind == "choice":
            choices = value.get("choice")
            if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in choices)):
                raise ValueError(f"response_format.choice must be a list of 1-{MAX_CHOICES} "
                                 "non-empty strings")
            return ResponseFormat("choice", _bounded(json.dumps(choices, ensure_ascii=False)))
        text = value.get(kind)
        if not isinstance(text, str) or not text:
            raise ValueError(f"response_format.{kind} must be a non-empty string")
        text = _bounded(text)
        if kind == "regex":
            check_regex(text)
        else:
            check_grammar(text)
        return ResponseFormat(kind, text)

    def to_dict(self) -> dict[str, Any]:
        """Back to the wire shape (what `parse` takes)."""
        if self.kind == "json_schema":
            js: dict[str, Any] = {"schema": json.loads(self.spec)}
            if self.name:
                js["name"] = self.name
            return {"type": "json_schema", "json_schema": js}
        if self.kind == "json_object":
            return {"type": "json_object"}
        if self.kind == "choice":
            return {"type": "choice", "choice": json.loads(self.spec)}
        return {"type": self.kind, self.kind: self.spec}


def from_structured_outputs(value: Any) -> dict[str, Any]:
    """vLLM's `structured_outputs` request field ({json | json_object | regex | choice |
    grammar}: exactly one) as the response_format it stands for."""
    kinds = ("json", "json_object", "regex", "choice", "grammar")
    if not isinstance(value, dict):
        raise ValueError("structured_outputs must be an object")
    extra = sorted(set(value) - set(kinds))
    given = [k for k in kinds if value.get(k) not in (None, False)]
    if extra or len(given) != 1:
        raise ValueError(f"structured_outputs takes exactly one of {', '.join(kinds)}"
                         + (f" (unknown: {', '.join(extra)})" if extra else ""))
    kind = given[0]
    if kind == "json":
        return {"type": "json_schema", "json_schema": {"schema": value["json"]}}
    if kind == "json_object":
        return {"type": "json_object"}
    return {"type": kind, kind: value[kind]}


def _bounded(text: str) -> str:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"response_format is over {MAX_SPEC_CHARS} characters")
    return text


def _canonical(schema: Any) -> str:
    # keys keep their order: a schema's property order is the order the output follows
    check_depth(schema, "the JSON schema")  # (before json.dumps, which recurses)
    return _bounded(json.dumps(schema, separators=(",", ":"), ensure_ascii=False))


def _schema_text(schema: Any) -> str:
    if isinstance(schema, str):  # a schema sent as JSON text
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError("the JSON schema nests too deep to read") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("a JSON schema must be an object")
    check_schema(schema)
    return _canonical(schema)


_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")  # "[12:00:00] /path/file.cc:83: "


def _message(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _XGR_PREFIX.sub("", text)


@dataclass(frozen=True)
class Compiled:
    """A compiled constraint: xgrammar's CompiledGrammar and, for JSON, the lengths its
    strings and numbers are held to (JsonGuard)."""

    grammar: Any
    limits: JsonLimits | None = None

    @property
    def nbytes(self) -> int:
        return int(self.grammar.memory_size_bytes)


@dataclass
class _Entry:
    future: Future[Compiled]
    nbytes: int = 0  # once compiled
    waiters: int = 0  # submits not yet released, while the compile is pending


class GrammarCompiler:
    """Compiles constraints for one tokenizer on worker threads, caching the results
    (least recently used out past _CACHE_ENTRIES constraints or `cache_bytes` of
    compiled grammars). Thread-safe: `submit` and `release` are called from the event
    loop and the engine thread.

    A compile that no one waits for any more is cancelled if it has not started
    (`release`); one already running in xgrammar cannot be interrupted: it runs to its
    end on its worker and its result is cached."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int],
                 timeout: float = COMPILE_TIMEOUT, cache_bytes: int = CACHE_BYTES) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.timeout = timeout
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[ResponseFormat, _Entry] = OrderedDict()
        self._cached_bytes = 0  # of the compiled entries in _cache
        # two workers: one pathological compile (cut off by the timeout, but not
        # interruptible) does not hold up every other request's
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="tidewire-grammar")
        self._xgr: Any = None  # the xgrammar compiler, built by the first compile
        self._tables: VocabTables | None = None  # the JSON guard's, built with it
        # (its own lock: building them takes ~0.5 s, which `submit` must not wait out)
        self._init_lock = threading.Lock()

    def submit(self, fmt: ResponseFormat) -> Future[Compiled]:
        """The compiled constraint, or its compile under way. A failed compile raises
        GrammarError from the future (and is not cached). While the compile is pending
        each call counts as one waiter, until it calls `release(fmt)`."""
        with self._lock:
            entry = self._cache.get(fmt)
            new = entry is None
            if entry is None:
                entry = self._cache[fmt] = _Entry(self._pool.submit(self._compile, fmt))
            else:
                self._cache.move_to_end(fmt)
            if not entry.future.done():
                entry.waiters += 1
            self._evict()
        if new:  # (outside the lock: a future already done runs it here and now)
            entry.future.add_done_callback(partial(self._landed, fmt))
        return entry.future

    def peek(self, fmt: ResponseFormat) -> Future[Compiled] | None:
        """The constraint's compile if it is cached or under way (None: never submitted,
        or evicted), without starting one or counting a waiter."""
        with self._lock:
            entry = self._cache.get(fmt)
            return None if entry is None else entry.future

    def release(self, fmt: ResponseFormat) -> None:
        """One caller of `submit(fmt)` no longer waits for its compile (its request was
        aborted, its client left, its wait timed out). When no waiter is left and the
        compile has not started, it is cancelled and leaves the cache; a running or
        finished compile is left alone. Pair each submit with at most one release."""
        with self._lock:
            entry = self._cache.get(fmt)
            if entry is None or entry.future.done():
                return
            entry.waiters = max(entry.waiters - 1, 0)
            if entry.waiters or entry.future.running():
                return
            # out of the cache first: a submit from now on starts a fresh compile rather
            # than joining one about to be cancelled
            del self._cache[fmt]
        entry.future.cancel()  # (outside the lock: it runs _landed, which takes it)

    @property
    def cached_bytes(self) -> int:
        """The memory the cached compiled grammars hold (xgrammar's measure)."""
        with self._lock:
            return self._cached_bytes

    def compile(self, fmt: ResponseFormat) -> Compiled:
        """submit() and wait, up to the timeout (GrammarError past it)."""
        fut = self.submit(fmt)
        try:
            return fut.result(self.timeout)
        except TimeoutError:
            raise GrammarError(f"the {fmt.kind} constraint took over {self.timeout:g}s to "
                               "compile; simplify it") from None

    def _landed(self, fmt: ResponseFormat, fut: Future[Compiled]) -> None:
        """A compile ended: a failed (or cancelled) one leaves the cache, so the next
        request retries; a compiled one counts its bytes, evicting others past the
        budget."""
        failed = fut.cancelled() or fut.exception() is not None
        with self._lock:
            entry = self._cache.get(fmt)
            if entry is None or entry.future is not fut:
                return
            if failed:
                del self._cache[fmt]
                return
            entry.nbytes, entry.waiters = fut.result().nbytes, 0
            self._cached_bytes += entry.nbytes
            self._evict()

    def _evict(self) -> None:
        """(lock held) Least recently used out, past either bound."""
        over = (len(self._cache) - _CACHE_ENTRIES, self._cached_bytes - self.cache_bytes)
        for fmt in [f for f, e in self._cache.items() if e.future.done()]:  # LRU first
            if over[0] <= 0 and over[1] <= 0:
                break
            old = self._cache.pop(fmt)  # (a pending compile stays: its waiters hold it)
            self._cached_bytes -= old.nbytes
            over = (over[0] - 1, over[1] - old.nbytes)

    def _compiler(self) -> Any:
        with self._init_lock:
            if self._xgr is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer,
                                                          vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                # no cache of xgrammar's own: it would keep every grammar this one evicts
                self._tables = VocabTables(
                    info.decoded_vocab, {*info.special_token_ids, *self.stop_token_ids})
                self._xgr = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._xgr

    def _compile(self, fmt: ResponseFormat) -> Compiled:
        c = self._compiler()
        try:
            if fmt.kind in ("json_schema", "json_object"):
                schema = json.loads(fmt.spec) if fmt.kind == "json_schema" else {"type": "object"}
                # compact JSON (no free whitespace): a sampled model cannot wander into
                # unbounded runs of spaces and newlines before max_tokens
                return Compiled(c.compile_json_schema(json.dumps(with_int64_bounds(schema)),
                                                      any_whitespace=False), limits_for(schema))
            if fmt.kind == "regex":
                return Compiled(c.compile_regex(fmt.spec))
            if fmt.kind == "choice":
                return Compiled(c.compile_grammar("root ::= " + " | ".join(
                    json.dumps(s, ensure_ascii=False) for s in json.loads(fmt.spec))))
            return Compiled(c.compile_grammar(fmt.spec))
        except Exception as e:  # xgrammar raises RuntimeError (and others) on bad input
            what = {"json_schema": "JSON schema", "grammar": "grammar (EBNF)"}.get(fmt.kind,
                                                                                  fmt.kind)
            raise GrammarError(f"invalid {what}: {_message(e)}") from None

    def matcher(self, compiled: Compiled) -> Matcher:
        guard = (JsonGuard(self._tables, compiled.limits)
                 if compiled.limits is not None and self._tables is not None else None)
        return Matcher(compiled.grammar, self.stop_token_ids, guard)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Matcher:
    """One sample's position in its constraint's automaton (and, for JSON, in the
    lengths of its strings and numbers: JsonGuard)."""

    __slots__ = ("_m", "_guard", "stop_token")

    def __init__(self, grammar: Any, stop_token_ids: list[int],
                 guard: JsonGuard | None = None) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(grammar, override_stop_tokens=stop_token_ids)
        self._guard = guard
        self.stop_token = stop_token_ids[0] if stop_token_ids else 0

    def fill(self, bitmask: Any, row: int) -> None:
        """Row `row` of the [rows, words] int32 bitmask: the tokens allowed next."""
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._guard is not None:
            self._guard.restrict(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by the token; False (nothing changes) when the constraint refuses it."""
        if self._guard is not None and not self._guard.allows(token_id):
            return False
        if not self._m.accept_token(token_id):
            return False
        if self._guard is not None:
            self._guard.advance(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative proposals)."""
        self._m.rollback(num_tokens)
        if self._guard is not None:
            self._guard.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())


def new_bitmask(rows: int, vocab: int) -> Any:
    """An all-allowed [rows, ceil(vocab / 32)] int32 token bitmask."""
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab)


def apply_masks(logits: Any, matchers: list[Matcher | None]) -> None:
    """Mask (to -inf, in place) every token that row i's matcher does not allow next;
    rows without a matcher are untouched. logits: contiguous fp32 or bf16 [rows, vocab]
    on the CPU. (xgrammar's own CPU apply took ~10 ms for 64 rows of a 49k vocabulary here;
    Tidewire's CPU op takes a fraction of that: kernels/cpu/ops.cpp.)"""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    bitmask = new_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matchers[i].fill(bitmask, i)  # type: ignore[union-attr]  # rows have matchers
    apply_bitmask(logits, bitmask, rows,
                  {i: matchers[i].stop_token for i in rows})  # type: ignore[union-attr]


def apply_bitmask(logits: Any, bitmask: Any, rows: list[int], stop_tokens: dict[int, int]) -> None:
    """Mask logits' `rows` by their bitmask rows (filled by matchers), in place."""
    from kernels import cpu_ops, reference

    if cpu_ops.available():
        cpu_ops.apply_token_bitmask(logits, bitmask, rows)
    else:
        reference.apply_token_bitmask(logits, bitmask, rows)
    # A constraint that allows no token at all here (an unsatisfiable schema, say) would
    # leave nothing to sample: its row gets the stop token instead, which its matcher
    # then refuses, and the engine ends the request with an error.
    # (read from the bitmask, [rows, vocab / 32] words, not from the logits)
    import torch

    idx = torch.tensor(rows)
    dead = idx[(bitmask[idx] == 0).all(dim=-1)].tolist()
    for i in dead:
        logits[i, stop_tokens[i]] = 0.0

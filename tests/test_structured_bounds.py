"""Bounds on structured outputs (engine/json_bounds.py, engine/structured.py): every JSON
output ends (integers within int64 unless the schema says otherwise, strings and numbers
of bounded length, enforced by the matcher), and what a constraint may cost to check and
compile (nesting, the compile cache's bytes, compiles nobody waits for)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine import json_bounds as jb
from engine.structured import GrammarCompiler, ResponseFormat, new_bitmask

VOCAB = 49152  # SmolLM2's


def _js(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _field(schema: dict[str, Any]) -> dict[str, Any]:
    return _js({"type": "object", "properties": {"v": schema}, "required": ["v"]})


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):  # noqa: ANN001, ANN201 - a transformers tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> Iterator[GrammarCompiler]:  # noqa: ANN001
    c = GrammarCompiler(tokenizer, VOCAB, frozenset({tokenizer.eos_token_id}))
    yield c
    c.close()


def walk(compiler: GrammarCompiler, tokenizer: Any, fmt: Any, text: str) -> bool:
    """Feed `text`'s tokens, then EOS, to a fresh matcher: whether it took them all and
    ended. Before each token, the mask the matcher fills must agree with `accept`."""
    parsed = ResponseFormat.parse(fmt)
    assert parsed is not None
    m = compiler.matcher(compiler.compile(parsed))
    bitmask = new_bitmask(1, VOCAB)
    for t in [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]:
        m.fill(bitmask, 0)
        allowed = bool((int(bitmask[0, t // 32]) >> (t % 32)) & 1)
        accepted = m.accept(t)
        assert allowed == accepted, (text[:40], t)
        if not accepted:
            return False
    return m.terminated


# -- what a JSON output may hold ------------------------------------------------------------

def test_an_unbounded_integer_stays_within_int64(compiler, tokenizer) -> None:  # noqa: ANN001
    """Today's xgrammar would take digits for ever (`"age": 1000000000...` to max_tokens)."""
    fmt = _field({"type": "integer"})
    for v in (0, -7, 2**63 - 1, -(2**63), 10**18):
        assert walk(compiler, tokenizer, fmt, json.dumps({"v": v})), v
    for v in (2**63, -(2**63) - 1, 10**19, 12345678901234567890):
        assert not walk(compiler, tokenizer, fmt, json.dumps({"v": v})), v


def test_a_schema_s_own_integer_bounds_are_kept(compiler, tokenizer) -> None:  # noqa: ANN001
    lower = _field({"type": "integer", "minimum": 0})  # the upper side gets int64's
    assert walk(compiler, tokenizer, lower, json.dumps({"v": 2**63 - 1}))
    assert not walk(compiler, tokenizer, lower, json.dumps({"v": -1}))
    assert not walk(compiler, tokenizer, lower, json.dumps({"v": 2**63}))
    upper = _field({"type": ["integer", "null"], "exclusiveMaximum": 10})
    for v, ok in [(9, True), (10, False), (None, True), (-(2**63), True), (-(2**63) - 1, False)]:
        assert walk(compiler, tokenizer, upper, json.dumps({"v": v})) == ok, v
    # the rewrite itself: bounded sides untouched
    assert jb.with_int64_bounds({"type": "integer", "minimum": 3, "exclusiveMaximum": 9}) == {
        "type": "integer", "minimum": 3, "exclusiveMaximum": 9}
    assert jb.with_int64_bounds({"type": "number"}) == {"type": "number"}
    assert jb.with_int64_bounds({"items": {"type": "integer"}})["items"] == {
        "type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}


def test_strings_have_a_default_length_a_schema_can_raise(compiler, tokenizer) -> None:  # noqa: ANN001
    fmt = _field({"type": "string"})
    n = jb.STRING_CHARS
    assert walk(compiler, tokenizer, fmt, json.dumps({"v": "word " * (n // 5) + "x" * (n % 5)}))
    assert not walk(compiler, tokenizer, fmt, json.dumps({"v": "word " * (n // 5 + 1)}))
    # an escape is one character, as in the string it stands for; characters, not bytes
    assert walk(compiler, tokenizer, fmt, json.dumps({"v": 'a"\n\\é' * (n // 5)}))
    assert walk(compiler, tokenizer, fmt,
                json.dumps({"v": "日本" * (n // 2)}, ensure_ascii=False))
    assert not walk(compiler, tokenizer, fmt,
                    json.dumps({"v": "日本" * (n // 2) + "x"}, ensure_ascii=False))
    # the schema's own maxLength raises it (xgrammar holds that field to its maxLength)
    own = _field({"type": "string", "maxLength": n + 1000})
    assert walk(compiler, tokenizer, own, json.dumps({"v": "x" * (n + 500)}))
    # ... as does any longer string the schema itself holds (one limit for the schema)
    assert jb.limits_for({"type": "object"}) == jb.JsonLimits()
    big = {"properties": {"a": {"maxLength": 9000}, "b": {"enum": ["z" * 7000, 1.5e-40]},
                          "c": {"type": "integer", "maximum": 10**25}, "k" * 5000: {}}}
    assert jb.limits_for(big) == jb.JsonLimits(string_chars=9000, int_digits=26,
                                               fraction_digits=20, exponent_digits=3)


def test_numbers_have_bounded_digits(compiler, tokenizer) -> None:  # noqa: ANN001
    fmt = _field({"type": "number"})
    ok = ["-" + "9" * 20, "1." + "5" * 20, "1e-308", "-0.5E+123", "1" * 20 + "." + "2" * 20]
    for text in ok:
        assert walk(compiler, tokenizer, fmt, f'{{"v": {text}}}'), text
    for text in ["1" * 21, "1." + "5" * 21, "1e1234", "2E+0001"]:
        assert not walk(compiler, tokenizer, fmt, f'{{"v": {text}}}'), text


def test_json_object_gets_the_same_bounds(compiler, tokenizer) -> None:  # noqa: ANN001
    fmt = {"type": "json_object"}
    ok = {"k": [1, -2.5e10, None, True, {"s": "é\"\\"}], "x" * 100: "y" * 4000}
    assert walk(compiler, tokenizer, fmt, json.dumps(ok, ensure_ascii=False))
    for bad in [{"k" * 5000: 1}, {"k": ["s" * 5000]}, {"k": {"n": 10**25}}]:
        assert not walk(compiler, tokenizer, fmt, json.dumps(bad))


def test_the_guard_rolls_back_with_the_matcher(compiler, tokenizer) -> None:  # noqa: ANN001
    """Speculative proposals are walked and rolled back: the guard's count with them."""
    m = compiler.matcher(compiler.compile(ResponseFormat.parse(_field({"type": "number"}))))
    head = tokenizer.encode('{"v": ' + "1" * 19, add_special_tokens=False)
    one, two = tokenizer.encode("1", add_special_tokens=False)[0], tokenizer.encode(
        "2", add_special_tokens=False)[0]
    assert all(m.accept(t) for t in head)
    assert m.accept(one) and not m.accept(two)  # the 21st digit
    m.rollback(1)
    assert m.accept(two) and not m.accept(one)


@pytest.mark.slow
def test_sampled_integers_always_stop(tiny_chat_model) -> None:  # noqa: ANN001
    """A random model at temperature 1.0, also one that never wants to stop (EOS biased
    to -100, as a model that loves digits): the integer ends within int64's 20
    characters and the request with "stop"."""
    llm = LLM(str(tiny_chat_model), dtype="float32")
    fmt = _js({"type": "integer"})
    never = {t: -100.0 for t in llm.engine.eos_token_ids}
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=s, response_format=fmt,
                             logit_bias=bias) for bias in ({}, never) for s in range(8)]
    for out in llm.generate(["a b c"] * len(params), params):
        o = out.outputs[0]
        assert o.finish_reason == "stop" and len(o.token_ids) <= 21, o.text
        assert -(2**63) <= int(o.text) < 2**63


# -- what a constraint may cost -------------------------------------------------------------

def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("fmt, message", [
    # Python's re raised RecursionError (not re.error) here, which escaped validation
    ({"type": "regex", "regex": "(" * 500 + "a" + ")" * 500}, "nests groups 500 levels deep"),
    # xgrammar's regex converter recursed per group and crashed the process (SIGSEGV)
    # on a pattern or Regex(...) 50,000 groups deep
    (_field({"type": "string", "pattern": "(" * 100 + "a" + ")" * 100}),
     "pattern at #/properties/v nests groups 100"),
    (_js({"type": "object", "patternProperties": {"(" * 70 + "a" + ")" * 70: {}}}),
     "patternProperties at # nests groups 70"),
    ({"type": "grammar", "grammar": 'root ::= Regex("' + "(" * 80 + "a" + ")" * 80 + '")'},
     "a Regex in the grammar nests groups 80"),
    # a schema 10,000 levels deep: check_schema's recursion raised RecursionError
    (_js(_nested(10_000)), "nested more than 64 levels deep"),
    ({"type": "json_schema", "json_schema": {"schema": '{"items":' * 10_000 + "{}" + "}" * 10_000}},
     "nest"),
])
def test_costly_constraints_are_refused_by_name(fmt: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ResponseFormat.parse(fmt)


def test_the_depth_bounds_are_exact() -> None:
    assert ResponseFormat.parse({"type": "regex", "regex": "(" * 64 + "a" + ")" * 64})
    with pytest.raises(ValueError, match=r"regex nests groups 65 levels deep \(the most is 64\)"):
        ResponseFormat.parse({"type": "regex", "regex": "(" * 65 + "a" + ")" * 65})
    assert ResponseFormat.parse({"type": "regex", "regex": r"[(((]\(\(\((a)"})  # not groups
    assert jb.regex_depth(r"(a(b)[)(]\)(c))") == 2
    assert ResponseFormat.parse(_js(_nested(63)))  # 64 levels of objects
    with pytest.raises(ValueError, match="the JSON schema is nested more than 64 levels deep"):
        ResponseFormat.parse(_js(_nested(64)))


def test_a_regex_too_complex_for_python_is_a_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """RecursionError, MemoryError or OverflowError from Python's parser (not re.error)
    escaped validation."""
    def overflow(*_: object) -> None:
        raise MemoryError

    monkeypatch.setattr(jb, "re", SimpleNamespace(compile=overflow, error=re.error))
    with pytest.raises(ValueError, match=r"invalid regex: too complex to parse \(MemoryError\)"):
        ResponseFormat.parse({"type": "regex", "regex": "a+"})


def test_the_cache_is_bounded_by_bytes(compiler, tokenizer) -> None:  # noqa: ANN001
    fmts = [ResponseFormat("regex", f"[a-z]{{{n}}}x") for n in range(1, 7)]
    sizes = [compiler.compile(f).nbytes for f in fmts]
    c = GrammarCompiler(tokenizer, VOCAB, frozenset({tokenizer.eos_token_id}),
                        cache_bytes=sum(sizes[-3:]))  # room for the last three
    try:
        done = [c.compile(f) for f in fmts]
        deadline = time.monotonic() + 10  # (a compile's bytes count just after its result)
        while c.cached_bytes != sum(sizes[-3:]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.cached_bytes == sum(sizes[-3:])
        assert c.submit(fmts[-1]).result() is done[-1]  # kept
        assert c.submit(fmts[0]).result(30) is not done[0]  # evicted: compiled again
        assert c.cached_bytes <= c.cache_bytes
        # xgrammar's own cache is off: it would keep every grammar evicted here
        assert c._compiler().get_cache_size_bytes() == 0
    finally:
        c.close()


def test_a_compile_nobody_waits_for_is_cancelled(tokenizer, monkeypatch) -> None:  # noqa: ANN001
    c = GrammarCompiler(tokenizer, VOCAB, frozenset({tokenizer.eos_token_id}))
    gate, started = threading.Event(), threading.Semaphore(0)
    compile_now = c._compile

    def held(fmt: ResponseFormat) -> Any:
        started.release()
        assert gate.wait(30)
        return compile_now(fmt)

    monkeypatch.setattr(c, "_compile", held)
    try:
        running = [c.submit(ResponseFormat("regex", f"run{i}")) for i in range(2)]
        for _ in running:  # both workers busy
            assert started.acquire(timeout=30)
        queued, shared = ResponseFormat("regex", "queued"), ResponseFormat("regex", "shared")
        fut, kept = c.submit(queued), c.submit(shared)
        assert c.submit(shared) is kept  # two waiters
        c.release(queued)
        c.release(shared)
        c.release(ResponseFormat("regex", "running0"))  # unknown: nothing happens
        c.release(ResponseFormat("regex", "run0"))  # running: left to finish
        assert fut.cancelled() and not kept.cancelled()
        assert c.submit(queued) is not fut  # it left the cache: a new submit compiles
        gate.set()
        assert running[0].result(30) is not None and kept.result(30) is not None
        assert c.submit(queued).result(30) is not None
    finally:
        gate.set()
        c.close()

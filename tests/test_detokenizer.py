"""Incremental detokenization and stop strings on the real SmolLM2 tokenizer
(byte-level BPE: emoji and CJK characters span several tokens)."""

from __future__ import annotations


import random

import pytest

from engine import AsyncEngine, EngineConfig, LLM, SamplingParams
from engine.detokenizer import IncrementalDetokenizer, byte_level_table

TEXTS = [
    "Hello, world! The sea is calm tonight.",
    "Emoji time: 🌊🐳🎉 and a family 👨‍👩‍👧 too.",
    "中文字符测试：潮汐与电线。日本語もあります。",
    "Mixed: café naïve — “quotes” ✓ 😀END",
]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def tables(tok) -> dict[bool, list[bytes] | None]:
    return {skip: byte_level_table(tok, skip) for skip in (True, False)}


@pytest.fixture(params=["decode", "bytes"])
def table(request, tables) -> list[bytes] | None:
    """Both paths: two tokenizer.decode calls a step, and the byte-level table."""
    return tables[True] if request.param == "bytes" else None


def stream(tok, text: str, stop: tuple[str, ...] = (),
           table: list[bytes] | None = None) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode("User says:", add_special_tokens=False), True, stop,
                               table)
    deltas = [d.push([t]) for t in ids[:-1]] + [d.push(ids[-1:], final=True)]
    return deltas, d


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_text_and_never_split_a_character(tok, table, text: str) -> None:
    deltas, d = stream(tok, text, table=table)
    assert "".join(deltas) == text == d.output_text
    assert all("\ufffd" not in x for x in deltas)
    assert sum(1 for x in deltas if x) > 1  # it really streams


@pytest.mark.parametrize("text,stop,expect", [
    ("Hello, world! The sea is calm tonight.", ("sea is",), "Hello, world! The "),
    ("Emoji time: 🌊🐳🎉 and more", ("🐳",), "Emoji time: 🌊"),
    ("中文字符测试：潮汐与电线。", ("潮汐",), "中文字符测试："),
    ("a b c d e f", ("x", "d e"), "a b c "),
    ("no stop here at all", ("zzz",), "no stop here at all"),
])
def test_stop_strings_across_tokens(tok, table, text: str, stop: tuple[str, ...],
                                    expect: str) -> None:
    deltas, d = stream(tok, text, stop, table)
    assert "".join(deltas) == expect == d.output_text
    for s in stop:
        assert s not in "".join(deltas)
    assert d.stop_hit == (None if expect == text else next(s for s in stop if s in text))


def test_text_that_may_start_a_stop_string_is_held_back(tok, table) -> None:
    d = IncrementalDetokenizer(tok, [], True, ("the end",), table)
    shown = d.push(tok.encode("We reached the", add_special_tokens=False))
    assert not shown.endswith("the")  # "the" could begin "the end"
    shown += d.push(tok.encode(" beginning", add_special_tokens=False))
    assert shown == "We reached the beginning"  # decided: not a stop string


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_in_long_random_text_cut_at_the_first_occurrence(tok, table,
                                                                       seed: int) -> None:
    """The detokenizer keeps only a window of the text it handed out; stop strings of
    several lengths (some straddling many tokens, some never present) must still cut
    the text exactly where the first of them begins, and hold back nothing else."""
    rng = random.Random(seed)
    words = ["tide", "wire", "sea", "🌊", "潮汐", " ", " ", ", ", "the", "end", "é", "\n"]
    text = "".join(rng.choice(words) for _ in range(rng.randint(200, 600)))
    a = rng.randrange(len(text) // 3, len(text) - 20)
    stops = tuple({text[a : a + rng.randint(2, 12)], "zz-never", rng.choice(words) + "¤"})
    first = min((text.find(x) for x in stops if x in text), default=-1)
    expect = text[:first]
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], True, stops, table)
    out, i = [], 0
    while i < len(ids) and d.stop_hit is None:
        n = rng.randint(1, 3)
        out.append(d.push(ids[i:i + n], final=i + n >= len(ids)))
        i += n
    assert "".join(out) == expect == d.output_text
    assert d.stop_hit is not None and text[first:].startswith(d.stop_hit)
    assert len(d.text) < max(len(x) for x in stops)  # a window, not the whole text


@pytest.mark.parametrize("skip", [True, False])
def test_byte_table_matches_decode_on_every_token(tok, tables, skip: bool) -> None:
    table = tables[skip]
    assert table is not None and len(table) == len(tok)
    for i in range(len(tok)):
        assert table[i].decode("utf-8", "replace") == tok.decode([i], skip_special_tokens=skip), i


@pytest.mark.parametrize("seed", range(4))
def test_byte_path_on_random_ids_equals_decode(tok, tables, seed: int) -> None:
    """Random ids split characters anywhere and include special tokens; the streamed
    text must still equal one decode of all the ids, U+FFFD placement included."""
    rng = random.Random(seed)
    pool = [*range(0, 20), *range(200, 260), *rng.sample(range(len(tok)), 300)]  # specials, bytes
    ids = [rng.choice(pool) for _ in range(400)]
    for skip in (True, False):
        d = IncrementalDetokenizer(tok, [], skip, (), tables[skip])
        out, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 4)
            out.append(d.push(ids[i:i + n], final=i + n >= len(ids)))
            i += n
        assert "".join(out) == tok.decode(ids, skip_special_tokens=skip)


def test_engine_stop_string_truncates_and_finishes(smollm2_dir) -> None:
    llm = LLM(model="smollm2-135m", dtype="float32")
    msgs = [{"role": "user", "content": "Write two sentences about the ocean."}]
    free = llm.chat(msgs, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    words = free.text.split()
    stop = " ".join(words[4:6])  # two words from the middle, spanning tokens
    cut = llm.chat(msgs, SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))[0]
    assert cut.text == free.text[: free.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert stop not in cut.text and len(cut.token_ids) < len(free.token_ids)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


async def test_streamed_deltas_equal_the_final_text(smollm2_dir) -> None:
    engine = AsyncEngine(EngineConfig(model="smollm2-135m", dtype="auto"))
    await engine.start()
    try:
        ids = engine.engine.apply_chat_template(
            [{"role": "user", "content": "Say hello in Chinese, Japanese and with an emoji."}])
        params = SamplingParams(max_tokens=40, temperature=0.7, seed=1, stop=["\n\n"])
        outs = [o async for o in engine.generate(ids, params, "s")]
        text = "".join(o.delta_text for o in outs)
        assert text == outs[-1].text and outs[-1].finished
        assert "\n\n" not in text
        # no delta ends inside a character; only the last one may flush a cut one as
        # U+FFFD (the sample stopped at max_tokens mid-emoji), exactly as decode does
        assert all("\ufffd" not in o.delta_text for o in outs[:-1])
        if outs[-1].finish_reason == "length":
            assert text == engine.tokenizer.decode(outs[-1].token_ids, skip_special_tokens=True)
        else:
            assert outs[-1].finish_reason == "stop" and "\ufffd" not in text
    finally:
        await engine.shutdown()


def test_an_id_past_the_tokenizer_has_no_text(tok, tables) -> None:
    """A model's lm_head can be wider than its tokenizer (padded vocabularies): such an
    id decodes to nothing instead of failing the step (found by fuzzing the API)."""
    hi = tok.encode("Hi", add_special_tokens=False)
    for stop in ((), ("zz",)):
        d = IncrementalDetokenizer(tok, [], True, stop, tables[True])
        assert d.push(hi) + d.push([len(tables[True]) + 7]) + d.push(hi, final=True) == "HiHi"

"""service/reasoning.py without a server: the split of a thinking model's text into
reasoning and content at every chunking, the request fields, the policy
(--reasoning-parser) and the budget's ids read from the chat template, and the socket's
frames and resume replay of a split stream."""

from __future__ import annotations

import random
import sys

import pytest

from engine import SamplingParams
from engine.outputs import StepOutput
from engine.request import Request
from engine.request_stream import RequestStream
from service.config import ServiceConfig
from service.delivery import Live, Timings, done_frame, replay, step_frames
from service.gateway import Admission, Principal
from service.protocol import ProtocolError, parse_generate
from service.reasoning import (Reasoning, ThinkOptions, ThinkPolicy, ThinkSplitter, split,
                               template_tags, think_options)

# (text, the prompt opened <think>) -> (reasoning, content)
CASES = [
    ("\nLet me think.\n</think>\n\nParis.", True, ("Let me think.", "Paris.")),
    ("<think>\nhmm, 2+2\n</think>\n\n4", False, ("hmm, 2+2", "4")),
    ("  \n<think>a</think>b", False, ("a", "b")),
    ("Just an answer.", False, ("", "Just an answer.")),
    ("  Just an answer.", False, ("", "  Just an answer.")),
    ("Hi <think>no</think>", False, ("", "Hi <think>no</think>")),  # not at the start
    ("never closes", True, ("never closes", "")),
    ("cut inside the tag </thi", True, ("cut inside the tag </thi", "")),
    ("cut after the tag's start <", True, ("cut after the tag's start <", "")),
    ("<thi", False, ("", "<thi")),  # a <think> never completed is content
    ("<think>", False, ("", "")),
    ("</think>answer", True, ("", "answer")),
    ("<think>again</think>x", True, ("<think>again", "x")),  # the prompt's was the opening
    ("a </think> b </think> c", True, ("a", "b </think> c")),
    ("x<</think>y", True, ("x<", "y")),
    ("x </ think> y", True, ("x </ think> y", "")),
    ("\n\n", True, ("", "")),
    ("a\n\nb\n</think>", True, ("a\n\nb", "")),
    ("r</think>\n\n  \n", True, ("r", "")),
    ("", True, ("", "")),
    ("", False, ("", "")),
    ("é😀</think>ü", True, ("é😀", "ü")),
]


@pytest.mark.parametrize("text, inside, want", CASES)
def test_split_a_whole_text(text: str, inside: bool, want: tuple[str, str]) -> None:
    assert split(text, inside) == want


def _streamed(pieces: list[str], inside: bool) -> tuple[str, str, list[tuple[str, str]]]:
    s = ThinkSplitter(inside)
    out = [s.push(p) for p in pieces] + [s.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out), out


@pytest.mark.parametrize("text, inside, want", CASES)
def test_every_split_point_gives_the_same_split(text: str, inside: bool,
                                                want: tuple[str, str]) -> None:
    """A tag split across deltas at any point (two cuts: a tag across three deltas), or
    arriving a character at a time, comes out the same as the whole text."""
    n = len(text)
    for i in range(n + 1):
        for j in range(i, n + 1):
            r, c, _ = _streamed([text[:i], text[i:j], text[j:]], inside)
            assert (r, c) == want, (text, i, j)
    r, c, _ = _streamed(list(text), inside)
    assert (r, c) == want


def test_what_is_given_out_is_never_taken_back() -> None:
    """At every point of a random chunking, the pieces given out so far are the whole
    split's beginnings (so a client can append them as they come)."""
    rng = random.Random(7)
    texts = [t for t, _, _ in CASES] + ["\n".join(rng.choice(["<think>", "</think>", "</th", "a",
                                                              " ", "\n", "ink>", "<"])
                                                  for _ in range(40)) for _ in range(50)]
    for text in texts:
        for inside in (True, False):
            want = split(text, inside)
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 6)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            r = c = ""
            for dr, dc in _streamed(pieces, inside)[2]:
                r, c = r + dr, c + dc
                assert want[0].startswith(r) and want[1].startswith(c), (text, pieces)
            assert (r, c) == want


def test_a_tag_held_back_until_it_resolves() -> None:
    s = ThinkSplitter(True)
    assert s.push("I think so") == ("I think so", "")
    assert s.push("\n</th") == ("", "")  # maybe the close: held
    assert s.thinking
    assert s.push("ink>\n\nYes") == ("", "Yes")
    assert not s.thinking
    s = ThinkSplitter(True)
    assert s.push("a </th") == ("a", "")
    assert s.push("ought") == (" </thought", "")  # it was not the tag after all
    s = ThinkSplitter(False)
    assert s.push("\n<th") == ("", "")  # maybe an opening <think>: held
    assert s.push("ink>x") == ("x", "")
    s = ThinkSplitter(False)
    assert s.push("<th") == ("", "")
    assert s.push("e answer") == ("", "<the answer")  # not the tag: all of it is content


def test_a_sample_splits_to_its_end_and_nothing_after() -> None:
    r = Reasoning(True, n=2)
    assert r.push(0, "a", 2, False) == ("a", "")
    assert r.push(1, "b</think>c", 3, True) == ("b", "c")
    assert r.push(1, "late", 1, True) == ("", "")  # (an ended sample takes nothing more)
    assert [(s.tokens, s.ended) for s in r.samples] == [(2, False), (3, True)]


@pytest.mark.parametrize("fields, kwargs, budget", [
    ({}, {}, None),
    ({"enable_thinking": False}, {"enable_thinking": False}, None),
    ({"chat_template_kwargs": {"enable_thinking": True, "x": 1.5, "y": None, "z": "s"},
      "enable_thinking": True}, {"enable_thinking": True, "x": 1.5, "y": None, "z": "s"}, None),
    ({"reasoning_effort": "low", "max_reasoning_tokens": 64}, {}, 64),
    ({"chat_template_kwargs": None, "enable_thinking": None, "max_reasoning_tokens": None}, {},
     None),
])
def test_request_fields(fields: dict, kwargs: dict, budget: int | None) -> None:
    assert think_options(fields) == ThinkOptions(kwargs, budget)


@pytest.mark.parametrize("fields, says", [
    ({"chat_template_kwargs": []}, "chat_template_kwargs must be an object"),
    ({"chat_template_kwargs": {f"k{i}": 1 for i in range(17)}}, "at most 16"),
    ({"chat_template_kwargs": {"tools": 1}}, "not a template variable name"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "not a template variable"),
    ({"chat_template_kwargs": {"a b": 1}}, "not a template variable name"),
    ({"chat_template_kwargs": {"x" * 65: 1}}, "not a template variable name"),
    ({"chat_template_kwargs": {"x": [1]}}, "chat_template_kwargs.x must be null"),
    ({"chat_template_kwargs": {"x": {"y": 1}}}, "must be null, a boolean"),
    ({"chat_template_kwargs": {"x": "a" * 4097}}, "at most 4096 characters"),
    ({"chat_template_kwargs": {"x": float("nan")}}, "must be null"),
    ({"chat_template_kwargs": {"x": 2**53 + 1}}, "an integer within +-2^53"),
    ({"enable_thinking": "yes"}, "enable_thinking must be a boolean"),
    ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, "disagree"),
    ({"reasoning_effort": "max"}, "reasoning_effort must be one of"),
    ({"max_reasoning_tokens": 0}, "max_reasoning_tokens must be an integer in [1, 1048576]"),
    ({"max_reasoning_tokens": (1 << 20) + 1},
     "max_reasoning_tokens must be an integer in [1, 1048576]"),
    ({"max_reasoning_tokens": True}, "max_reasoning_tokens must be an integer"),
    ({"max_reasoning_tokens": 1.5}, "max_reasoning_tokens must be an integer"),
])
def test_bad_request_fields_are_invalid_request(fields: dict, says: str) -> None:
    with pytest.raises(ProtocolError) as e:
        think_options(fields, "r1")
    assert e.value.code == "invalid_request" and says in e.value.message
    assert e.value.request_id == "r1"


def test_a_generate_takes_the_fields_in_params() -> None:
    g = parse_generate({"type": "generate", "id": "a", "messages": [{"role": "user", "content": "x"}],
                        "params": {"max_tokens": 5, "enable_thinking": False,
                                   "max_reasoning_tokens": 9, "reasoning_effort": "high"}})
    assert g.think == ThinkOptions({"enable_thinking": False}, 9) and g.params.max_tokens == 5
    with pytest.raises(ProtocolError, match="enable_thinking must be a boolean") as e:
        parse_generate({"type": "generate", "id": "b", "prompt": "x",
                        "params": {"enable_thinking": 1}})
    assert e.value.request_id == "b"


class FakeTokenizer:
    """What ThinkPolicy reads of a tokenizer: its template and decode()."""

    def __init__(self, template: str, vocab: dict[int, str]) -> None:
        self.chat_template, self.vocab = template, vocab

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        assert not skip_special_tokens  # <think> may be a special token
        return "".join(self.vocab[i] for i in ids)


VOCAB = {1: "<|im_start|>", 2: "assistant\n", 3: "<think>", 4: "\n", 5: "</think>", 6: "Hi"}


def test_the_policy_follows_the_flag_and_the_template() -> None:
    thinking = FakeTokenizer("{{ '<think>' }}", VOCAB)
    plain = FakeTokenizer("{{ messages }}", VOCAB)
    assert ThinkPolicy("auto", thinking).on and not ThinkPolicy("auto", plain).on
    assert ThinkPolicy("think", plain).on and not ThinkPolicy("none", thinking).on
    assert not ThinkPolicy("auto", None).on and ThinkPolicy("think", None).on
    p = ThinkPolicy("auto", thinking)
    assert p.prompt_opens([1, 2, 3, 4]) and p.prompt_opens([6] * 20 + [3])
    assert not p.prompt_opens([1, 2, 3, 4, 5, 4]) and not p.prompt_opens([1, 2])
    assert not p.prompt_opens([3, 6])  # <think> then a user's text: not an open thinking
    assert not ThinkPolicy("think", None).prompt_opens([3])
    opts = ThinkOptions({}, 7)
    r = p.request([1, 2, 3, 4], opts, 2, constrained=False)
    assert r is not None and r.inside and len(r.samples) == 2
    constrained = p.request([1, 2, 3, 4], opts, 1, constrained=True)
    assert constrained is not None and not constrained.inside  # the constraint's output
    assert ThinkPolicy("none", thinking).request([1, 2, 3], opts, 1, False) is None
    # a constrained request renders without thinking, unless it asks for it
    assert p.template_kwargs(ThinkOptions(), True) == {"enable_thinking": False}
    assert p.template_kwargs(ThinkOptions({"enable_thinking": True}), True) == {
        "enable_thinking": True}
    assert p.template_kwargs(ThinkOptions(), False) is None
    assert ThinkPolicy("none", thinking).template_kwargs(ThinkOptions({"x": 1}), True) == {"x": 1}


# a template that opens the thinking in the prompt and shows none in its turns (the
# tests' thinking model), and one that lets the model open it and shows it its own way
OPENS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
SHOWS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
         "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>\n{% endif %}"
         "{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("template, tags", [
    (OPENS, ("<think>\n", "\n</think>\n\n")),
    (SHOWS, ("<think>", "</think>\n")),
    ("{{ raise_exception('no probes') }}<think>", ("<think>", "\n</think>\n\n")),
])
def test_the_budget_reads_the_tags_from_the_template(tokenizer, template: str,
                                                     tags: tuple[str, str]) -> None:
    tokenizer.chat_template = template
    assert template_tags(tokenizer) == tags
    p = ThinkPolicy("auto", tokenizer)
    ids = [tuple(tokenizer.encode(t, add_special_tokens=False)) for t in tags]
    assert (p.start_ids, p.end_ids) == tuple(ids)
    plain = SamplingParams(max_tokens=9)
    sp = p.engine_params(plain, ThinkOptions({}, 7))
    assert (sp.thinking_budget, sp.think_start_ids, sp.think_end_ids, sp.thinking_open) == (
        7, ids[0], ids[1], False)
    assert sp.max_tokens == 9
    # the prompt the template opens ends with the start ids (the engine opens it there)
    if template == OPENS:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                               add_generation_prompt=True, tokenize=False)
        assert tuple(tokenizer.encode(prompt)[-len(ids[0]):]) == ids[0]
    # no budget, a constrained request, a server that does not split: as given
    assert p.engine_params(plain, ThinkOptions({}, None)) is plain
    assert p.engine_params(plain, None) is plain
    constrained = SamplingParams(response_format={"type": "json_object"})
    assert p.engine_params(constrained, ThinkOptions({}, 7)) is constrained
    assert ThinkPolicy("none", tokenizer).engine_params(plain, ThinkOptions({}, 7)) is plain


def test_the_flag_and_its_environment_variable(monkeypatch) -> None:
    import service.server
    from service.cli import main
    from tests.test_cli import fake_build_server

    got: dict = {}
    monkeypatch.setattr(service.server, "build_server", fake_build_server(got))
    monkeypatch.setattr(sys, "setswitchinterval", lambda s: None)
    monkeypatch.delenv("TIDEWIRE_REASONING_PARSER", raising=False)
    assert main(["serve", "--port", "0"]) == 0
    assert got["config"].reasoning_parser == "auto"
    assert main(["serve", "--port", "0", "--reasoning-parser", "none"]) == 0
    assert got["config"].reasoning_parser == "none"
    monkeypatch.setenv("TIDEWIRE_REASONING_PARSER", "think")
    assert main(["serve", "--port", "0"]) == 0
    assert got["config"].reasoning_parser == "think"
    with pytest.raises(ValueError, match="reasoning_parser must be auto, none or think"):
        ServiceConfig(reasoning_parser="deepseek")


# -- the socket's frames ---------------------------------------------------------------

def _live(n: int = 1, inside: bool = True) -> tuple[Live, RequestStream]:
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=64, n=n))
    stream = RequestStream(req)
    live = Live("c1", Admission(stream, 0.0, Principal(None, "")), False, Timings(0.0))
    live.think = Reasoning(inside, n)
    return live, stream


def _step(tokens: list[int], text: str, index: int = 0, reason: str | None = None) -> StepOutput:
    return StepOutput(request_id="r", new_token_ids=tokens, text_delta=text, index=index,
                      finished=reason is not None, finish_reason=reason, num_prompt_tokens=3)


def _deltas(frames: list[dict]) -> list[tuple]:
    return [(f["seq"], f["token_ids"], f.get("reasoning"), f["text"]) for f in frames
            if f["type"] == "delta"]


def test_delta_frames_carry_reasoning_beside_the_answer() -> None:
    live, stream = _live()
    frames = []
    for tokens, text in (([7], "Let me"), ([8], " think.\n</"), ([9], "think>\n\nParis"),
                         ([10], ".")):
        stream._push(_step(tokens, text))
        frames += step_frames(live, lambda *a: None)
    stream._push(_step([11], "", reason="stop"))
    frames += step_frames(live, lambda *a: None)
    assert [f["type"] for f in frames] == ["start"] + ["delta"] * 5
    assert _deltas(frames) == [(1, [7], "Let me", ""), (2, [8], " think.", ""),
                               (3, [9], None, "Paris"), (4, [10], None, "."), (5, [11], None, "")]
    assert "reasoning" not in frames[-1]  # a delta without thinking has no field
    assert live.said == [(6, 0), (13, 0), (13, 5), (13, 6), (13, 6)]
    done = done_frame(live, "stop")
    assert (done["status"], done["finish_reason"], done["usage"]["completion_tokens"]) == (
        "completed", "stop", 5)


def test_a_held_tail_goes_out_when_the_sample_ends_without_a_token() -> None:
    live, stream = _live()
    stream._push(_step([7], "so\n</th"))
    frames = step_frames(live, lambda *a: None)
    stream._push(_step([], "", reason="abort"))  # cancelled with a possible tag held
    frames += step_frames(live, lambda *a: None)
    assert _deltas(frames) == [(1, [7], "so", ""), (2, [], "\n</th", "")]


def test_replay_sends_the_reasoning_and_content_the_client_missed() -> None:
    live, stream = _live(n=2)
    steps = [([7], "a b", 0), ([5], "x", 1), ([8], " c</think>d", 0), ([6], "</think>y", 1),
             ([9], "e", 0)]
    for tokens, text, index in steps:
        stream._push(_step(tokens, text, index))
        step_frames(live, lambda *a: None)
    assert live.seq == 5
    # the client had seq 1 (sample 0's "a b") only
    again = replay(live, 1)
    assert [(f["seq"], f["index"], f["token_ids"], f.get("reasoning"), f["text"]) for f in again] == [
        (2, 0, [8, 9], " c", "de"), (3, 1, [5, 6], "x", "y")]
    assert live.said[:1] == [(3, 0)] and live.said[1:] == [(5, 2), (1, 1)]
    assert replay(live, 3) == []  # everything delivered
    fresh = replay(live, 0)  # from nothing: the whole split
    assert [(f.get("reasoning"), f["text"]) for f in fresh] == [("a b c", "de"), ("x", "y")]

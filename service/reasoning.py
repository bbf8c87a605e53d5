"""Reasoning output of thinking models. A model whose chat template thinks (Qwen3,
SmolLM3, DeepSeek-R1's distills) writes `<think>...</think>` before its answer; the
server splits a chat request's output into its reasoning and its content (the answer)
as it streams, so that clients see the thinking apart: `reasoning_content` over HTTP,
the delta frames' `reasoning` on the socket (docs/http.md, docs/protocol.md).

- `ThinkSplitter`: one sample's text in, (reasoning, content) pieces out, as deltas
  arrive. A tag split across deltas (or across tokens) is held back until it is
  resolved, so what comes out is a function of the text so far, however it was chunked.
- `SampleSplit` and `Reasoning`: a request's samples as they stream.
- `ThinkOptions`: a request's chat-template arguments (`chat_template_kwargs`,
  `enable_thinking`) and reasoning token budget (`max_reasoning_tokens`), validated where
  they arrive; `ThinkPolicy`: whether this server splits at all (`--reasoning-parser`),
  each request's starting state, and its budget as the engine enforces it.

Where the output starts: a template that opens the thinking itself (Qwen3 with thinking
on, DeepSeek-R1) ends the prompt with `<think>`, so the output starts inside the
reasoning and only `</think>` ends it; otherwise an output that begins with `<think>`
opens it, and any other output is all content. An output that never closes its thinking
(cut by max_tokens) is all reasoning. A constrained request (response_format, a required
tool call) is split as if the prompt opened nothing: the constraint shapes its output
from the first token, so that output is the answer unless it writes the tags itself.
Whitespace around the reasoning, and between `</think>` and the answer, is dropped.

The budget is the engine's (SamplingParams.thinking_budget): a sample that has thought
that many tokens gets the close of its thinking, as the chat template writes it (the
text between a reasoning and its answer in a rendered assistant turn, `\n</think>\n\n`
where the template shows none), in place of its next tokens, and then answers; the
split sees that `</think>` as any other. The thinking the engine counts starts where the
template's opening text ends the prompt, or where the output begins with `<think>`. A
constrained request has no budget: its constraint writes every token."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import join_chunks
from engine.sampling_params import MAX_THINK_IDS, SamplingParams
from service.protocol import ProtocolError

OPEN, CLOSE = "<think>", "</think>"
# the request fields this module reads (HTTP body, or a generate's params)
FIELDS = ("chat_template_kwargs", "enable_thinking", "reasoning_effort", "max_reasoning_tokens")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's; accepted, ignored

_START, _THINK, _ANSWER = 0, 1, 2


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThinkSplitter:
    """One sample's text as (reasoning, content) pieces, delta by delta. `inside`: the
    prompt opened the thinking. What it has given out is always the split of the text
    so far less a held tail (a possible tag, whitespace that may end the reasoning), so
    any chunking of the same text gives the same pieces in total."""

    __slots__ = ("_mode", "_held", "_fresh", "_lead")

    def __init__(self, inside: bool) -> None:
        self._mode = _THINK if inside else _START
        self._held = ""
        self._fresh = True  # no reasoning given out yet: its leading whitespace goes
        self._lead = False  # just past </think>: the answer's leading whitespace goes

    @property
    def thinking(self) -> bool:
        """Inside the reasoning now."""
        return self._mode == _THINK

    def push(self, text: str) -> tuple[str, str]:
        """The reasoning and content that `text` (the next delta) completes."""
        buf, self._held = self._held + text, ""
        reasoning: list[str] = []
        while True:
            if self._mode == _START:
                rest = buf.lstrip()
                if rest.startswith(OPEN):
                    self._mode, buf = _THINK, rest[len(OPEN):]
                elif OPEN.startswith(rest):  # only whitespace and part of <think> so far
                    self._held = buf
                    return "", ""
                else:
                    self._mode = _ANSWER
            elif self._mode == _THINK:
                end = buf.find(CLOSE)
                if end < 0:
                    body = buf[:len(buf) - _partial(buf, CLOSE)]
                    said = body.rstrip()
                    self._held = buf[len(said):]
                    reasoning.append(self._reasoning(said))
                    return "".join(reasoning), ""
                reasoning.append(self._reasoning(buf[:end].rstrip()))
                self._mode, self._lead, buf = _ANSWER, True, buf[end + len(CLOSE):]
            else:
                return "".join(reasoning), self._answer(buf)

    def finish(self) -> tuple[str, str]:
        """The held tail, once the sample has ended: a `<think>` never completed is
        content, a `</think>` never completed is reasoning."""
        held, self._held = self._held, ""
        if self._mode == _START:
            return "", held
        if self._mode == _THINK:
            return self._reasoning(held.rstrip()), ""
        return "", self._answer(held)

    def _reasoning(self, text: str) -> str:
        if self._fresh:
            text = text.lstrip()
            self._fresh = not text
        return text

    def _answer(self, text: str) -> str:
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        return text


def split(text: str, inside: bool) -> tuple[str, str]:
    """A whole output's (reasoning, content)."""
    s = ThinkSplitter(inside)
    r, c = s.push(text)
    r2, c2 = s.finish()
    return r + r2, c + c2


class SampleSplit:
    """One sample of a request as it streams: its splitter, what it has said in each
    part, and the tokens and characters of raw text taken. `ended`: its last piece is
    out (it finished)."""

    __slots__ = ("splitter", "reasoning_chunks", "content_chunks", "said", "tokens", "chars",
                 "ended")

    def __init__(self, inside: bool) -> None:
        self.splitter = ThinkSplitter(inside)
        self.reasoning_chunks: list[str] = []
        self.content_chunks: list[str] = []
        self.said = (0, 0)  # the characters of reasoning and of content given out
        self.tokens = self.chars = 0
        self.ended = False

    @property
    def reasoning(self) -> str:
        return join_chunks(self.reasoning_chunks)

    @property
    def content(self) -> str:
        return join_chunks(self.content_chunks)

    def push(self, text: str, tokens: int, last: bool) -> tuple[str, str]:
        """The next delta (`tokens` of them, `last`: the sample's final one): its
        reasoning and content."""
        r, c = self.splitter.push(text)
        self.tokens += tokens
        self.chars += len(text)
        if last:
            r2, c2 = self.splitter.finish()
            r, c, self.ended = r + r2, c + c2, True
        if r:
            self.reasoning_chunks.append(r)
        if c:
            self.content_chunks.append(c)
        self.said = (self.said[0] + len(r), self.said[1] + len(c))
        return r, c

    def close(self) -> None:
        """The sample has ended: its held tail goes out (a no-op once it has)."""
        if not self.ended:
            self.push("", 0, True)

    def prime(self, text: str, tokens: int) -> None:
        """Text the client already has (a stream continued from its token ids)."""
        self.push(text, tokens, False)


class Reasoning:
    """A request's reasoning split: a SampleSplit per sample."""

    def __init__(self, inside: bool, n: int) -> None:
        self.inside = inside
        self.samples = [SampleSplit(inside) for _ in range(n)]

    def push(self, index: int, text: str, tokens: int, last: bool) -> tuple[str, str]:
        """A delta of sample `index` split (nothing once that sample has ended)."""
        s = self.samples[index]
        return ("", "") if s.ended else s.push(text, tokens, last)


# -- what a request asks for --------------------------------------------------------------

MAX_TEMPLATE_KWARGS = 16
MAX_KWARG_CHARS = 4096  # a string value
MAX_KWARG_INT = 1 << 53  # an integer value: what any JSON reader takes exactly
_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# apply_chat_template's own parameters: not template variables
_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                       "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                       "truncation", "max_length", "return_tensors", "return_dict",
                       "return_assistant_tokens_mask", "tokenizer_kwargs"})
MAX_BUDGET = 1 << 20  # as max_tokens


@dataclass(frozen=True)
class ThinkOptions:
    """A chat request's variables for its chat template and its reasoning budget."""

    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    budget: int | None = None  # max_reasoning_tokens


def think_options(fields: Mapping[str, Any], rid: str | None = None) -> ThinkOptions:
    """The FIELDS of a request (absent or null: unset), validated; `enable_thinking` is
    `chat_template_kwargs.enable_thinking`. Raises invalid_request naming the field."""
    def bad(message: str) -> ProtocolError:
        return ProtocolError("invalid_request", message, rid)

    kwargs = _template_kwargs(fields.get("chat_template_kwargs"), bad)
    thinking = fields.get("enable_thinking")
    if thinking is not None:
        if not isinstance(thinking, bool):
            raise bad("enable_thinking must be a boolean")
        if kwargs.get("enable_thinking", thinking) != thinking:
            raise bad("enable_thinking and chat_template_kwargs.enable_thinking disagree")
        kwargs["enable_thinking"] = thinking
    effort = fields.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise bad(f"reasoning_effort must be one of {', '.join(EFFORTS)}")
    budget = fields.get("max_reasoning_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)
                               or not 1 <= budget <= MAX_BUDGET):
        raise bad(f"max_reasoning_tokens must be an integer in [1, {MAX_BUDGET}]")
    return ThinkOptions(kwargs, budget)


def _template_kwargs(value: Any, bad: Any) -> dict[str, Any]:
    """At most MAX_TEMPLATE_KWARGS variables named as identifiers (not apply_chat_template's
    own parameters), each null, a boolean, a number or a string of at most
    MAX_KWARG_CHARS: the template sees nothing a client could make it loop over."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        raise bad(f"chat_template_kwargs must be an object of at most {MAX_TEMPLATE_KWARGS} "
                  "entries")
    for k, v in value.items():
        if not isinstance(k, str) or not _KWARG_NAME.fullmatch(k) or k in _RESERVED:
            raise bad(f"chat_template_kwargs: {str(k)[:64]!r} is not a template variable name")
        scalar = v is None or isinstance(v, (bool, str)) or (
            isinstance(v, int) and abs(v) <= MAX_KWARG_INT) or (
            isinstance(v, float) and v == v and abs(v) != float("inf"))
        if not scalar or (isinstance(v, str) and len(v) > MAX_KWARG_CHARS):
            raise bad(f"chat_template_kwargs.{k} must be null, a boolean, a number (an integer "
                      f"within +-2^53) or a string of at most {MAX_KWARG_CHARS} characters")
    return dict(value)


# -- this server's policy -------------------------------------------------------------------

# the tokens whose text is checked for an open <think> at the end of a prompt
_PROMPT_TAIL = 8


class ThinkPolicy:
    """Whether this server splits reasoning (`--reasoning-parser`: auto, when the chat
    template mentions <think>; think: always; none: never), and how a request starts."""

    def __init__(self, mode: str, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None) or ""
        self.on = mode == "think" or (mode == "auto" and isinstance(template, str)
                                      and OPEN in template)
        # the token ids that open and close the thinking, for the engine's budget (none
        # without a tokenizer: then no budget is enforced)
        self.start_ids: tuple[int, ...] = ()
        self.end_ids: tuple[int, ...] = ()
        if self.on and tokenizer is not None:
            start, end = template_tags(tokenizer)
            self.start_ids, self.end_ids = _ids(tokenizer, start), _ids(tokenizer, end)

    def template_kwargs(self, opts: ThinkOptions, constrained: bool) -> dict[str, Any] | None:
        """The template's extra variables (None: none). A constrained request renders
        without thinking unless it asks (its constraint applies from the first token)."""
        kwargs = dict(opts.template_kwargs)
        if self.on and constrained:
            kwargs.setdefault("enable_thinking", False)
        return kwargs or None

    def request(self, prompt_ids: Sequence[int], opts: ThinkOptions, n: int,
                constrained: bool) -> Reasoning | None:
        """A chat request's split (None when this server does not split)."""
        if not self.on:
            return None
        return Reasoning(not constrained and self.prompt_opens(prompt_ids), n)

    def engine_params(self, params: SamplingParams, opts: ThinkOptions | None) -> SamplingParams:
        """A chat request's sampling with its reasoning budget for the engine to enforce:
        the ids that open and close the thinking as this model's template writes them.
        As given without a budget, on a server that does not split, or for a
        constrained request (its constraint writes every token)."""
        if (opts is None or opts.budget is None or not self.on or not self.end_ids
                or params.response_format is not None):
            return params
        return dataclasses.replace(params, thinking_budget=opts.budget,
                                   think_end_ids=self.end_ids, think_start_ids=self.start_ids)

    def prompt_opens(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt ends inside a <think> its template opened."""
        if self.tokenizer is None or not prompt_ids:
            return False
        tail = self.tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL:]), skip_special_tokens=False)
        return isinstance(tail, str) and tail.rstrip().endswith(OPEN)


_PROBE_REASONING, _PROBE_ANSWER = "tidewire-probe-thought", "tidewire-probe-answer"
_CLOSE_TEXT = "\n</think>\n\n"  # where a template shows no thinking in its turns


def template_tags(tokenizer: Any) -> tuple[str, str]:
    """The texts that open and close the thinking as the chat template writes them. The
    open: from `<think>` to the end of a generation prompt that ends inside it (the
    template opens it), else `<think>` (the model writes it). The close: what comes
    between the reasoning and the answer of a rendered assistant turn that carries
    `reasoning_content`."""
    user = {"role": "user", "content": "?"}
    start, end = OPEN, _CLOSE_TEXT
    prompt = _render(tokenizer, [user], True)
    at = prompt.rfind(OPEN)
    if at >= 0 and not prompt[at + len(OPEN):].strip():
        start = prompt[at:]
    turn = _render(tokenizer, [user, {"role": "assistant", "content": _PROBE_ANSWER,
                                      "reasoning_content": _PROBE_REASONING}], False)
    a, b = turn.find(_PROBE_REASONING), turn.find(_PROBE_ANSWER)
    between = turn[a + len(_PROBE_REASONING):b] if 0 <= a < b else ""
    if CLOSE in between:
        end = between
    return start, end


def _render(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> str:
    """The template's text for a probe conversation ("" where it cannot render one)."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation,
                                             tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe: the defaults
        return ""
    return text if isinstance(text, str) else ""


def _ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """`text`'s token ids (none where there are more than the engine takes)."""
    try:
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot: no budget is enforced
        return ()
    return ids if len(ids) <= MAX_THINK_IDS else ()

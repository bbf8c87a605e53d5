"""The input side of the engine: a prompt's tokens (text, chat template, or ids), the
checks that a request fits this model and its KV pool, and the Request they make.

Safe to call from any thread: it reads the loaded model's fixed facts only (the grammar
compiler it submits to is thread-safe)."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.structured import GrammarCompiler


class PromptTooLongError(ValueError):
    """The prompt (plus max_tokens) does not fit the context window."""


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What a request must fit: the model's vocabulary and window, and the KV pool."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    # a sliding window on every layer (KVCacheManager.window): a request then holds at
    # most the window plus one step's tokens, whatever its length (0: no window); on
    # some layers (KVCacheManager.local_window): it holds that many in full blocks
    window_tokens: int = 0
    num_full_blocks: int = 0  # blocks with room in every layer (0: num_blocks)
    global_layers: bool = False  # local_window: the whole context also in global layers


def held_tokens(window: int, config: EngineConfig) -> int:
    """ModelLimits.window_tokens: with a window on every layer, the most tokens a request
    holds blocks for (the window, one step's new tokens, a block of slack); 0: none."""
    if not window:
        return 0
    spec = config.speculative
    return (window + config.scheduler.max_num_batched_tokens + config.cache.block_size
            + (spec.num_tokens if spec.method != "none" else 0))


class InputProcessor:
    def __init__(self, tokenizer: Any, limits: ModelLimits, eos_token_ids: frozenset[int],
                 grammars: GrammarCompiler | None,
                 byte_table: Callable[[bool], list[bytes] | None]) -> None:
        """`eos_token_ids`: what ends each request made here (unless it ignores EOS);
        `byte_table`: the output side's tables (OutputProcessor.byte_table), which bound
        a prompt's bytes."""
        self.tokenizer = tokenizer
        self.limits = limits
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self._byte_table = byte_table

    def tokenize(self, prompt: str | list[int], any_thread: bool = False) -> list[int]:
        """A prompt's ids (no special tokens added). `any_thread`: through the Rust
        tokenizer's own encode, which mutates nothing (transformers' wrapper may set
        truncation state on each call), so it may run beside the event loop's calls."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: send prompt_token_ids")
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if any_thread and backend is not None:  # (encode_batch releases the GIL)
                return backend.encode_batch([prompt], add_special_tokens=False)[0].ids
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = list(prompt)
        vocab = self.limits.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        return ids

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template takes a `tools` argument (and tool turns)."""
        return "tools" in (getattr(self.tokenizer, "chat_template", None) or "")

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            any_thread: bool = False) -> list[int]:
        """Token ids of a conversation; without the generation prompt it is the prefix
        that the next turn's prompt starts with (what `warm` caches). `tools` (OpenAI's
        shape) go to a template that renders them. `any_thread`: as for tokenize()."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        kw = {"tools": tools} if tools else {}
        if any_thread and getattr(self.tokenizer, "backend_tokenizer", None) is not None:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kw)
            return self.tokenize(text, any_thread=True)
        out = self.tokenizer.apply_chat_template(messages,
                                                 add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, return_dict=False, **kw)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    @functools.cached_property
    def max_prompt_bytes(self) -> int | None:
        """The most UTF-8 bytes a prompt that fits the context window can have: the
        window times the longest token's bytes (a longer text needs more tokens than the
        window holds). Exact token bytes come from the byte-level table; otherwise a
        token's own string bounds them. None when the tokenizer normalizes its input (a
        normalizer can shorten text before it is split) or there is none. (Computed on
        first use: the byte table is built once, ~80 ms.)"""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return None
        table = self._byte_table(False)
        longest = (max(map(len, table), default=0) if table is not None else
                   max((len(t.encode("utf-8", "surrogatepass")) for t in tok.get_vocab()),
                       default=0))
        return self.limits.max_model_len * longest if longest else None

    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, salt: bytes = b"",
                     output_token_ids: Sequence[int] = ()) -> Request:
        """Tokenize and validate. `output_token_ids`: a request that continues a stream
        begun elsewhere (a resume on another replica): the tokens it already produced,
        recomputed with the prompt before it samples the next one; n must be 1. A
        constrained request's compile starts here (it runs while the request waits)."""
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if output_token_ids:
            self._check_continued(params, output_token_ids)
        self._check_token_ids(params)
        self._check_fits(len(ids), params.max_tokens)
        req = Request(request_id or uuid.uuid4().hex, ids, params, self.eos_token_ids, salt)
        req.output_token_ids = list(output_token_ids)
        if params.response_format is not None:
            if self.grammars is None:
                raise ValueError("response_format needs a model with a tokenizer")
            req.grammar = self.grammars.submit(params.response_format)  # compiles meanwhile
        return req

    def _check_continued(self, params: SamplingParams, output_token_ids: Sequence[int]) -> None:
        if params.n != 1:
            raise ValueError("only a request with n = 1 can continue from its tokens")
        if len(output_token_ids) > params.max_tokens:
            raise ValueError(f"{len(output_token_ids)} tokens already produced, more than "
                             f"max_tokens ({params.max_tokens})")
        vocab = self.limits.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in output_token_ids):
            raise ValueError(f"token ids must be integers in [0, {vocab})")

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids a request names (logit_bias keys, stop_token_ids, the thinking's
        start and end) are this model's."""
        vocab = self.limits.vocab_size
        bad = [t for t in (*params.logit_bias, *params.stop_token_ids, *params.think_start_ids,
                           *params.think_end_ids) if t >= vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} (in logit_bias, stop_token_ids or the "
                             f"thinking's ids) is not in this model's vocabulary of {vocab}")

    def _check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """The prompt plus max_tokens fits the context window and the KV pool."""
        lim = self.limits
        if num_prompt + max_tokens > lim.max_model_len:
            raise PromptTooLongError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context window of {lim.max_model_len} tokens")
        bs = lim.block_size
        total = num_prompt + max_tokens
        held, slack = total, 0
        if lim.window_tokens and lim.window_tokens < held:  # a block may straddle its start
            held, slack = lim.window_tokens, 1
        full = lim.num_full_blocks or lim.num_blocks
        if -(-held // bs) + slack > full or lim.global_layers and -(-total // bs) > lim.num_blocks:
            raise PromptTooLongError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs more KV "
                f"blocks than the pool has ({lim.num_blocks} x {bs} tokens"
                f"{f', {full} of them in every layer' if full < lim.num_blocks else ''})")

"""Offline batch API: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from tqdm import tqdm

from engine import runtime
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Run batches of prompts through the engine in this thread."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 **overrides: Any) -> None:
        """Either `LLM(config=EngineConfig(...))`, or the model and flat keyword
        arguments, each a field of EngineConfig (`dtype`, `seed`, ...) or of one of its
        sub-configs under its flat name (`block_size`, `num_kv_blocks`, `max_num_seqs`,
        `kv_tier`, `redis_url`, `kv_tier_ttl`, ...; engine.config.flat_names()); with
        both, the keywords override the config's fields. An unknown name is a TypeError.

        `kv_tier`: where evicted prefix blocks go — "none", "memory" (in this process)
        or "redis" (memory in front of Redis at `redis_url`; shared by restarts and
        replicas). `enforce_eager`: no CUDA graphs for decode steps. `quantization`:
        "int8" for weight-only int8 linears on the CPU (faster small-batch decode).
        `kv_cache_dtype`: "int8" for the CPU's int8 KV cache (~1.9x the tokens per GB of bf16,
        faster long-context decode).
        `threads`: torch threads (0: one per physical core). `seed`: the generator
        shared by requests without a seed of their own (None: from OS entropy). With
        `params=None`, generate() uses the model's default sampling (default_params()).
        Call close() (or use `with LLM(...) as llm`) to flush the cached blocks to the
        tier at the end."""
        runtime.tune_malloc()  # an entry point: the process's allocator, once
        if model is not None:
            overrides["model"] = model
        self.config = (config or EngineConfig()).with_flat(**overrides)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def close(self, flush: bool = True) -> None:
        """Flush cached prefix blocks to the host tier (unless `flush` is False) and
        stop its I/O thread."""
        self.engine.close(flush)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast(Prompt, prompts)]
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        plist = self._params_list(params, len(batch))
        for fmt in {sp.response_format for sp in plist} - {None}:
            self.engine.compile_format(fmt)  # type: ignore[arg-type]  # an invalid one raises here
        reqs = [self.engine.make_request(p, sp, self._next_id()) for p, sp in zip(batch, plist)]
        return self._run(reqs, use_tqdm)

    def chat(self, conversations: list[dict[str, str]] | Sequence[list[dict[str, str]]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the chat template to each conversation (a list of {role, content}), then
        generate."""
        if conversations and isinstance(conversations[0], dict):
            convs = [cast(list[dict[str, str]], conversations)]
        else:
            convs = list(cast(Sequence[list[dict[str, str]]], conversations))
        ids: list[Prompt] = [self.engine.apply_chat_template(list(c)) for c in convs]
        return self.generate(ids, params, use_tqdm)

    def default_params(self, **overrides: object) -> SamplingParams:
        """SamplingParams with the model's defaults (generation_config.json or the
        registry) for the fields `overrides` leaves out; used when `params` is None."""
        return SamplingParams(**{**self.engine.sampling_defaults, **overrides})  # type: ignore[arg-type]

    def _params_list(self, params: SamplingParams | Sequence[SamplingParams] | None,
                     n: int) -> list[SamplingParams]:
        if params is None:
            return [self.default_params()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return list(params)

    def _next_id(self) -> str:
        self._counter += 1
        return f"offline-{self._counter}"

    def _run(self, reqs: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        results = {r.request_id: RequestOutput(
            r.request_id, r.prompt_token_ids,
            [CompletionOutput(i) for i in range(r.params.n)]) for r in reqs}
        for r in reqs:
            self.engine.add(r)
        bar = tqdm(total=len(reqs), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                res = results[out.request_id]
                res.apply(out)
                bar.update(int(res.finished and out.finished))
        bar.close()
        return [results[r.request_id] for r in reqs]

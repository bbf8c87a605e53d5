"""Tidewire engine: paged-KV continuous batching with chunked prefill.

Public API: LLM (offline), AsyncEngine (asyncio facade over the engine thread),
SamplingParams, EngineConfig, and the output types."""

import importlib
from typing import Any

# name -> module; imported on first use, so `import engine.registry` (the command line)
# does not pay for torch
_EXPORTS = {"AsyncEngine": "engine.async_engine", "CacheConfig": "engine.config",
            "SchedulerConfig": "engine.config", "TierConfig": "engine.config", "LLM": "engine.llm",
            "EngineConfig": "engine.config", "LLMEngine": "engine.llm_engine",
            "PromptTooLongError": "engine.input_processor", "RequestOutput": "engine.outputs",
            "StepOutput": "engine.outputs", "SamplingParams": "engine.sampling_params"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value

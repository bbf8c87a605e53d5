"""Tidewire engine: paged-KV continuous batching with chunked prefill.

Public API: LLM (offline), AsyncEngine (asyncio facade over the engine thread),
SamplingParams, EngineConfig, and the output types."""

from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, SchedulerConfig, TierConfig
from engine.llm import LLM
from engine.llm_engine import EngineConfig, LLMEngine, PromptTooLongError
from engine.outputs import RequestOutput, StepOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "CacheConfig", "EngineConfig", "LLMEngine",
           "PromptTooLongError", "RequestOutput", "SamplingParams", "SchedulerConfig",
           "StepOutput", "TierConfig"]

"""The engine's flags, shared by `generate` and `serve`, and the EngineConfig they
describe."""

from __future__ import annotations

import argparse
from typing import Any

from engine.config import EngineConfig  # torch-free, as is the registry
from engine.registry import DEFAULT_MODEL, REGISTRY
from service.cli.flags import env_arg


MODEL_HELP = (f"a registry name ({', '.join(REGISTRY)}; see `tidewire models`), an HF model "
              "directory (config.json + safetensors) or a .gguf file (dequantized once and "
              "cached under $TIDEWIRE_CACHE)")


def model_args(g: Any) -> None:
    env_arg(g, "--model", "MODEL", default=DEFAULT_MODEL, help=MODEL_HELP)
    env_arg(g, "--dtype", "DTYPE", default="auto",
            choices=["auto", "bfloat16", "float32", "float16"],
            help="weights and activations; auto: bfloat16 on a GPU or on a CPU with "
                 "AVX512-BF16/AMX, else float32")
    env_arg(g, "--quantization", "QUANTIZATION", default="auto",
            choices=["auto", "none", "int8", "int4", "gguf"],
            help="auto: gguf for a .gguf file where that runs (the cpu backend, bfloat16 or "
                 "float32, an architecture it reads), else none; none: a GGUF dequantized "
                 "once into --dtype; int8: weight-only int8 linears, quantized at load and "
                 "cached (CPU backend; ~1.6-1.8x faster single-stream decode than bfloat16); "
                 "int4: group-wise 4-bit (GGUF Q4_K blocks, or Q4_1 where in_features is not "
                 "a multiple of 256), cached likewise (CPU); gguf: a .gguf model's "
                 "block-quantized weights run as the file stores them (CPU)")


def engine_args(g: Any) -> None:
    env_arg(g, "--attention-backend", "ATTENTION_BACKEND", default="cpu",
            choices=["cpu", "cuda", "triton-interpret"],
            help="cpu: torch on the CPU; cuda: Triton kernels on a GPU; triton-interpret: the "
                 "same kernels under Triton's interpreter on the CPU (tests, slow)")
    env_arg(g, "--enforce-eager", "ENFORCE_EAGER", default=False, action="store_true",
            help="no CUDA graphs (decode steps launch their kernels one by one) and no "
                 "compiled CPU decode step")
    env_arg(g, "--threads", "THREADS", type=int, default=0,
            help="torch threads for the engine (0: OMP_NUM_THREADS if set, else one per "
                 "physical core; more than the physical cores only slows the matmuls)")
    env_arg(g, "--max-num-batched-tokens", "MAX_NUM_BATCHED_TOKENS", type=int, default=512,
            help="tokens one engine step may process (decodes plus prefill chunks)")
    env_arg(g, "--max-num-seqs", "MAX_NUM_SEQS", type=int, default=64,
            help="sequences one engine step may batch")
    env_arg(g, "--speculative", "SPECULATIVE", default="none", choices=["none", "ngram", "draft"],
            help="speculative decoding: ngram proposes the tokens that followed the last few "
                 "tokens' earlier occurrence in the prompt or output (no second model); draft "
                 "runs --draft-model. The output is exactly what it is without (greedy: the "
                 "same tokens; sampled: the same distribution)")
    env_arg(g, "--num-speculative-tokens", "NUM_SPECULATIVE_TOKENS", type=int, default=4,
            help="tokens proposed per request per step")
    env_arg(g, "--draft-model", "DRAFT_MODEL", default=None,
            help="--speculative draft: a smaller model with the same tokenizer (name or path)")
    env_arg(g, "--speculative-max-batch", "SPECULATIVE_MAX_BATCH", type=int, default=16,
            help="no proposals in a step with more running requests than this (0: no limit)")


def kv_args(g: Any) -> None:
    env_arg(g, "--block-size", "BLOCK_SIZE", type=int, default=16,
            help="tokens per KV cache block")
    env_arg(g, "--kv-cache-memory-gb", "KV_CACHE_MEMORY_GB", type=float, default=1.0,
            metavar="GB",
            help="GiB of device memory for the KV block pool")
    env_arg(g, "--kv-cache-dtype", "KV_CACHE_DTYPE", default="auto", choices=["auto", "int8"],
            help="auto: K and V in the activations' dtype; int8: one byte a value plus a "
                 "scale per row (CPU backend with its compiled kernels): ~1.9x the tokens of bf16 in "
                 "the same memory and faster long-context decode, at a small accuracy cost "
                 "(docs/cpu-engine.md)")
    env_arg(g, "--num-kv-blocks", "NUM_KV_BLOCKS", type=int, default=None,
            default_text="as many as --kv-cache-memory-gb holds",
            help="size the KV block pool in blocks instead")
    env_arg(g, "--num-full-kv-blocks", "NUM_FULL_KV_BLOCKS", type=int, default=0,
            default_text="every sequence slot's window, at most half the pool",
            help="models with sliding-window and global layers (Gemma 2/3): the blocks with "
                 "room in every layer; the rest hold the global layers only (docs/models.md)")
    env_arg(g, "--no-prefix-caching", "PREFIX_CACHING", dest="prefix_caching", default=True,
            action="store_false",
            help="do not reuse the KV blocks of a prompt prefix seen before")
    env_arg(g, "--no-kv-prefault", "KV_PREFAULT", dest="kv_prefault", default=True,
            action="store_false",
            help="CPU: let the KV pool's pages fault in as blocks are first used instead "
                 "of mapping them all at start-up (less memory until the pool fills; "
                 "each first use then costs a page fault inside a step)")
    env_arg(g, "--kv-tier", "KV_TIER", default="memory", choices=["memory", "redis", "none"],
            help="host tier for prefix blocks evicted from the device (redis: memory in front "
                 "of Redis, shared across restarts and replicas)")
    env_arg(g, "--redis-url", "REDIS_URL", metavar="URL",
            help="redis://host:port/db, for --kv-tier redis")
    env_arg(g, "--kv-tier-memory-gb", "KV_TIER_MEMORY_GB", type=float, default=1.0,
            metavar="GB",
            help="GiB of host memory for the tier's in-process cache")
    env_arg(g, "--kv-tier-ttl", "KV_TIER_TTL", type=int, default=24 * 3600, metavar="SECONDS",
            help="how long a block lives in Redis (a hit refreshes it)")
    env_arg(g, "--kv-tier-write-through", "KV_TIER_WRITE_THROUGH", default=False,
            action="store_true",
            help="also write prompt blocks to the tier as they fill, not only on eviction "
                 "(prefix sharing across replicas)")
    env_arg(g, "--kv-tier-secret", "KV_TIER_SECRET", metavar="SECRET", secret=True,
            help="shared by every replica on the same Redis (e.g. `openssl rand -hex 32`): "
                 "blocks in Redis carry an HMAC keyed by it and tenant salts derive from "
                 "it, so whoever can read or write Redis can neither forge blocks nor test "
                 "which prompts were cached; none: the tier trusts Redis")


def _gib(gb: float) -> int:
    return int(gb * (1 << 30))


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig that the engine flags of `serve` or `generate` describe (their
    TIDEWIRE_* variables are the flags' defaults). One builder for both commands, so a
    flag cannot reach one command's engine and not the other's."""
    # serve only: the offline LLM hands out a step's outputs when the step returns
    serve_only = {"async_output": a.async_output} if hasattr(a, "async_output") else {}
    # generate's --seed also seeds each of its requests, so as the engine's seed (for
    # unseeded requests) it changes nothing there
    return EngineConfig.from_flat(
        a.model, dtype=a.dtype, quantization=a.quantization,
        attention_backend=a.attention_backend, enforce_eager=a.enforce_eager,
        threads=a.threads, max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs, block_size=a.block_size, kv_cache_dtype=a.kv_cache_dtype,
        speculative=a.speculative, num_speculative_tokens=a.num_speculative_tokens,
        draft_model=a.draft_model, speculative_max_batch=a.speculative_max_batch,
        kv_cache_memory=_gib(a.kv_cache_memory_gb), num_kv_blocks=a.num_kv_blocks,
        num_full_kv_blocks=a.num_full_kv_blocks,
        enable_prefix_caching=a.prefix_caching, kv_prefault=a.kv_prefault, kv_tier=a.kv_tier,
        redis_url=a.redis_url,
        kv_tier_memory=_gib(a.kv_tier_memory_gb), kv_tier_ttl=a.kv_tier_ttl,
        kv_tier_write_through=a.kv_tier_write_through,
        kv_tier_secret=a.kv_tier_secret or "", seed=a.seed, **serve_only)

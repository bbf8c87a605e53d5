"""Loading an LLMEngine: the platform, the model's files, tokenizer and weights, and
what loading decides beside them (the EOS ids, the model's sampling defaults, the KV
pool's size, the int8 weights' cache file, the host tier, the speculator). Functions
of the config and the loaded model; LLMEngine.__init__ calls them in order."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.block_manager import KVCacheManager
from engine.input_processor import held_tokens
from engine.config import EngineConfig
from engine.kv_offload import EvictionLog, KVOffload, kv_fingerprint
from engine.loader import (cache_root, load_tokenizer, load_weights, resolve_model,
                           sampling_defaults, weights_checksum)
from engine.models.arch import ModelArch
from engine.platform import Platform
from engine.progress import LoadProgress
from engine.runner import ModelRunner, prefault_default
from engine.sampling_params import SamplingParams
from engine.spec_decode import Speculator, make_speculator

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger("tidewire.engine")


@dataclass(slots=True)
class LoadedModel:
    """The model on its platform, with its KV pool (load_model)."""

    platform: Platform
    model_dir: Path
    arch: ModelArch
    tokenizer: Any  # a transformers tokenizer; None: the model has none
    max_model_len: int
    num_blocks: int
    num_full_blocks: int  # < num_blocks: windowed layers hold only these (HybridPool)
    kv: KVCacheManager
    evicted: EvictionLog | None  # what the pool evicts, for a host tier to copy out
    runner: ModelRunner


def resolve_quantization(config: EngineConfig) -> EngineConfig:
    """`quantization="auto"` (the default) made definite: a .gguf file runs its blocks as
    they are ("gguf", as llama.cpp and Ollama run them) where that can run here: the cpu
    backend with its compiled kernels, bfloat16 or float32, an architecture
    engine/gguf_weights.py reads. Anything else, a registry name (the shipped default
    among them) included, "none": dequantized once into the model's dtype."""
    if config.quantization != "auto":
        return config
    path = Path(config.model).expanduser()
    quantization = "none"
    if path.suffix == ".gguf" and path.is_file():
        why = _why_dequantized(config, path)
        if why is None:
            quantization = "gguf"
        else:
            log.info("%s runs dequantized: %s", path.name, why)
    return replace(config, quantization=quantization)


def _why_dequantized(config: EngineConfig, path: Path) -> str | None:
    from engine import gguf_weights
    from kernels import cpu_ops

    if config.attention_backend != "cpu":
        return f"the {config.attention_backend} backend runs GGUF weights dequantized"
    if config.dtype not in ("auto", "bfloat16", "bf16", "float32", "fp32"):
        return f"its blocks run in bfloat16 or float32, not {config.dtype}"
    if not cpu_ops.available():
        return "the compiled CPU kernels are unavailable (no C++ compiler)"
    return gguf_weights.native_supported(path)


def load_model(config: EngineConfig, progress: LoadProgress) -> LoadedModel:
    """Choose the platform, load the model's files, tokenizer and weights, and allocate
    the KV cache; `progress` follows the phases."""
    # chosen once, its settings made on the thread that runs every op of this engine
    platform = Platform.choose(config)
    platform.apply()
    with progress.phase("model files (a GGUF is converted once)"):
        model_dir: Path = resolve_model(config.model, native_gguf=config.quantization == "gguf")
        arch = ModelArch.from_dir(model_dir)
    with progress.phase("tokenizer"):
        tokenizer: Any = load_tokenizer(model_dir)
    max_model_len = min(config.max_model_len or arch.max_context, arch.max_context)
    cc = config.cache
    num_blocks, num_full = kv_blocks(config, arch, platform.dtype, max_model_len)
    # a host tier hears of every cached block the pool evicts (to copy it out)
    tiered = config.tier.kind != "none" and cc.enable_prefix_caching
    evicted = EvictionLog() if tiered else None
    # a window on every layer: blocks behind it go back to the pool after each step; on
    # some layers: they move to blocks with room in the global layers only
    window = arch.sliding_window or 0 if arch.windowed_everywhere else 0
    local_window = 0 if window else arch.sliding_window or 0
    kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, on_evict=evicted,
                        window=window, local_window=local_window, num_full=num_full)
    if platform.runs_cpu_kernels:
        with progress.phase("CPU kernels (compiled once per machine)"):
            platform.load_kernels()
    with progress.phase("weights"):
        weights = load_weights(model_dir)
    held = f", {num_full} of them in every layer" if num_full < num_blocks else ""
    with progress.phase(f"model and KV cache ({num_blocks} blocks{held}"
                        f"{'' if config.quantization == 'none' else ', ' + config.quantization}"
                        f"{', int8 KV cache' if cc.dtype == 'int8' else ''})"):
        runner = ModelRunner(
            arch, weights, platform=platform,
            block_size=cc.block_size, num_blocks=num_blocks, seed=config.seed,
            max_num_seqs=config.scheduler.max_num_seqs, max_model_len=max_model_len,
            quantization=config.quantization,
            quant_cache=quant_cache_path(config, model_dir),
            prefault=cc.prefault if cc.prefault is not None else prefault_default(),
            kv_cache_dtype=cc.dtype, num_full_blocks=num_full)
        del weights
    trim_heap()
    return LoadedModel(platform, model_dir, arch, tokenizer, max_model_len, num_blocks,
                       num_full, kv, evicted, runner)


def trim_heap() -> None:
    """Give the heap's free pages back to the system once the model is loaded: reading a
    GGUF's metadata and the tokenizer (a 128k-token vocabulary: hundreds of thousands of
    small objects) and the load's temporaries are freed by then, but glibc keeps freed
    memory for reuse, about 0.2 GB resident for nothing with a 3B-shaped Llama file."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to give back this way
        pass


def eos_ids(arch: ModelArch, tokenizer: Any) -> frozenset[int]:
    """The model's end-of-sequence ids and the tokenizer's."""
    ids = set(arch.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def model_sampling_defaults(config: EngineConfig, model_dir: Path) -> dict[str, float]:
    """The model's defaults for unset sampling fields; invalid ones are ignored."""
    found = sampling_defaults(config.model, model_dir)
    try:
        SamplingParams(**found)  # type: ignore[arg-type]  # checked here, at run time
    except (TypeError, ValueError) as e:
        log.warning("ignoring the model's sampling defaults %s: %s", found, e)
        return {}
    return found


def auto_num_blocks(config: EngineConfig, arch: ModelArch, dtype: torch.dtype,
                    max_model_len: int) -> int:
    """As many blocks as the memory budget holds, but no more than every sequence slot
    at full context could use (tiny models would otherwise zero gigabytes)."""
    bs = config.cache.block_size
    per_block = arch.kv_bytes_per_block(bs, dtype, config.cache.dtype)
    budget = config.kv_cache_memory // per_block
    most = -(-max_model_len // bs) * config.scheduler.max_num_seqs
    return max(1, min(budget, most))


def kv_blocks(config: EngineConfig, arch: ModelArch, dtype: torch.dtype,
              max_model_len: int) -> tuple[int, int]:
    """(block ids, of them the full ones). A model whose layers are all global or all
    windowed: every block is full. One with both (HybridPool): the full blocks cover
    every sequence slot's local window and a step's new tokens (at most half the memory
    budget, or half the given num_blocks), and the rest of the budget buys blocks of the
    global layers only, each costing global/all layers of a full one."""
    cc = config.cache
    window = arch.sliding_window or 0
    glob = sum(1 for i in range(arch.num_layers) if not arch.window(i))
    if not window or not glob:
        n = cc.num_blocks or auto_num_blocks(config, arch, dtype, max_model_len)
        return n, n
    bs, sc = cc.block_size, config.scheduler
    spec = config.speculative.num_tokens if config.speculative.method != "none" else 0
    # (at least what one request may hold in full blocks: the input checks' bound)
    one = -(-held_tokens(window, config) // bs) + 1
    want = cc.num_full_blocks or max(one, sc.max_num_seqs * (-(-window // bs) + 1)
                                     + -(-(sc.max_num_batched_tokens + spec) // bs))
    if cc.num_blocks:
        full = min(cc.num_blocks, cc.num_full_blocks or min(want, -(-cc.num_blocks // 2)))
        return cc.num_blocks, full
    per_full = arch.kv_bytes_per_block(bs, dtype, cc.dtype)
    per_global = per_full * glob // arch.num_layers
    budget = config.kv_cache_memory
    full = max(1, min(want, budget // 2 // per_full))
    most = -(-max_model_len // bs) * sc.max_num_seqs
    n = min(most, full + max(0, budget - full * per_full) // per_global)
    return (n, full) if n > full else (n, n)


def quant_cache_path(config: EngineConfig, model_dir: Path) -> Path | None:
    """Where the model's int8 weights are kept once quantized (None: not quantized)."""
    if config.quantization in ("none", "gguf"):
        return None
    key = weights_checksum(model_dir)[:16]
    return cache_root() / "quantized" / f"{key}-{config.quantization}.safetensors"


def offload_fingerprint(config: EngineConfig, arch: ModelArch, model_dir: Path,
                        dtype: torch.dtype, int8_activations: bool = False) -> bytes:
    """What the host tier's keys name: blocks of other K/V bytes never share a key."""
    return kv_fingerprint(
        arch.model_type, weights_checksum(model_dir),
        # int8 weights compute other K/V than the same model's bf16 ones; an int8 cache
        # holds other bytes (and layout) than a bf16 one; an fp32 run with x in int8
        # into the 4-bit matmuls (ModelPlan.int8_activations) other K/V than exact sums
        str(dtype).removeprefix("torch.")
        + ("" if config.quantization == "none" else f"+w{config.quantization}")
        + ("+x8" if int8_activations and dtype == torch.float32 else "")
        + ("" if config.cache.dtype == "auto" else f"+kv{config.cache.dtype}"),
        config.cache.block_size, arch.num_layers, arch.num_kv_heads, arch.head_dim)


def make_offload(config: EngineConfig, fingerprint: bytes, kv: KVCacheManager,
                 runner: ModelRunner, evicted: EvictionLog) -> KVOffload:
    """The host tier behind the device prefix cache."""
    from cache_store import make_tier

    tc = config.tier
    tier = make_tier(tc.kind, tc.memory_bytes, tc.redis_url, tc.ttl, tc.io_timeout)
    assert tier is not None
    return KVOffload(tier, tc, kv, runner, fingerprint, evicted)


def make_engine_speculator(engine: LLMEngine, progress: LoadProgress) -> Speculator | None:
    """The configured speculator; a draft model loads here, beside the engine's."""
    sc = engine.config.speculative
    draft = None
    if sc.method == "draft":
        from engine.spec_draft import DraftProposer

        if not sc.draft_model:
            raise ValueError("speculative decoding with a draft model needs one: "
                             "--draft-model (draft_model=)")

        with progress.phase(f"draft model {sc.draft_model}"):
            draft = DraftProposer(engine, sc)
    return make_speculator(sc, draft)

"""Frozen configuration, one dataclass per layer, and EngineConfig holding them all.

Torch-free: the command line builds an EngineConfig before anything loads torch."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from engine.registry import DEFAULT_MODEL

# the names `EngineConfig.dtype` takes besides "auto" (llm_engine.DTYPES maps them to torch)
DTYPE_NAMES = ("bfloat16", "bf16", "float32", "fp32", "float16", "fp16")
QUANTIZATIONS = ("none", "int8")  # engine/quant.py
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the activations' dtype; int8: the CPU's q8 cache


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    # Blocks kept free when admitting new requests, so running ones can grow a while
    # before anyone is preempted.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # resolved from kv_cache_memory when 0
    enable_prefix_caching: bool = True
    # CPU: map the whole pool's pages at start-up (None: yes, unless the environment
    # says TIDEWIRE_KV_PREFAULT=0). The block queue cycles through every block, so a
    # server ends up holding the whole pool either way; faulted in one page at a time
    # inside engine steps it cost ~4 us a 4 KB page, ~1 s of a chat-64 run.
    prefault: bool | None = None
    # "int8": K and V stored as one-byte codes with a scale per row (cpu backend): ~1.9x
    # the tokens of a bf16 cache in the same memory (head_dim 64), decode attention
    # reading about half the bytes
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                             f"got {self.dtype!r}")


@dataclass(frozen=True)
class TierConfig:
    """The host tier for cold prefix blocks (cache_store)."""

    kind: str = "memory"  # none | memory | redis (memory in front of Redis)
    redis_url: str | None = None  # redis://host:port/db
    memory_bytes: int = 1 << 30  # the in-process tier's budget
    ttl: int = 24 * 3600  # seconds a written key lives; refreshed on every hit
    write_through: bool = False  # also write prompt blocks as they fill (cross-replica)
    load_timeout: float = 2.0  # a LOADING request recomputes after this long
    io_timeout: float = 1.0  # per Redis round trip
    max_pending_writes: int = 4096  # blocks waiting to be written; more are dropped

    def __post_init__(self) -> None:
        if self.kind not in ("none", "memory", "redis"):
            raise ValueError(f"kv tier must be none, memory or redis, got {self.kind!r}")
        if self.kind == "redis" and not self.redis_url:
            raise ValueError("kv tier 'redis' needs a redis_url (redis://host:port/db)")


@dataclass(frozen=True)
class EngineConfig:
    """Everything LLMEngine needs. Build it directly, or from LLM's flat keyword
    arguments with `from_flat` (the command line does, from its flags)."""

    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # bfloat16 where the hardware computes it natively, else float32
    attention_backend: str = "cpu"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tier: TierConfig = field(default_factory=TierConfig)
    kv_cache_memory: int = 1 << 30  # bytes for the KV pool when cache.num_blocks == 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int | None = None  # shared by unseeded requests; None: from OS entropy
    debug: bool = False  # check block-manager integrity after every step
    enforce_eager: bool = False  # no CUDA graphs for decode steps (engine/cuda_graphs.py)
    quantization: str = "none"  # "int8": weight-only int8 linears (engine/quant.py; CPU)
    threads: int = 0  # torch threads of the engine thread; 0: one per physical core
    # AsyncEngine: a step's outputs go out once the next decode graph is on the GPU, so
    # the event loop's fan-out overlaps the GPU's work (no effect on the CPU backend)
    async_output: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES and self.dtype != "auto":
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPE_NAMES)}, "
                             f"got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")

    @classmethod
    def from_flat(cls, model: str = DEFAULT_MODEL, **kw: Any) -> EngineConfig:
        """The config that LLM's flat keyword arguments describe (`flat_names()`);
        what they leave out keeps its default. An unknown name is a TypeError."""
        return cls(model=model).with_flat(**kw)

    def with_flat(self, **kw: Any) -> EngineConfig:
        """This config with flat keyword arguments applied: a top-level field by its own
        name, a sub-config's field by its name in `_NESTED` (LLM's historical names).
        `num_kv_blocks=None` means 0: sized from kv_cache_memory."""
        unknown = [k for k in kw if k not in flat_names()]
        if unknown:
            raise TypeError(f"unexpected engine option{'s' * (len(unknown) > 1)} "
                            f"{', '.join(map(repr, unknown))}; "
                            f"known: {', '.join(sorted(flat_names()))}")
        if not kw:
            return self  # LLM(config=c) runs on c itself, not a copy
        if kw.get("num_kv_blocks", 0) is None:
            kw["num_kv_blocks"] = 0
        changes = {k: v for k, v in kw.items() if k not in _NESTED}
        for section in _SECTIONS:
            sub = {f: kw[name] for name, (s, f) in _NESTED.items() if s == section and name in kw}
            if sub:  # replace() validates the sub-config again
                changes[section] = replace(getattr(self, section), **sub)
        return replace(self, **changes)


_SECTIONS = ("cache", "scheduler", "tier")  # EngineConfig's sub-configs
# flat keyword name -> (sub-config, its field); the sub-configs' own names are not
# flat names, so one value cannot be given twice
_NESTED: dict[str, tuple[str, str]] = {
    "block_size": ("cache", "block_size"),
    "num_kv_blocks": ("cache", "num_blocks"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "kv_prefault": ("cache", "prefault"),
    "kv_cache_dtype": ("cache", "dtype"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "watermark": ("scheduler", "watermark"),
    "kv_tier": ("tier", "kind"),
    "redis_url": ("tier", "redis_url"),
    "kv_tier_memory": ("tier", "memory_bytes"),
    "kv_tier_ttl": ("tier", "ttl"),
    "kv_tier_write_through": ("tier", "write_through"),
    "kv_tier_load_timeout": ("tier", "load_timeout"),
    "kv_tier_io_timeout": ("tier", "io_timeout"),
    "kv_tier_max_pending_writes": ("tier", "max_pending_writes"),
}


def flat_names() -> frozenset[str]:
    """Every keyword `EngineConfig.with_flat` and `LLM(...)` take (model included)."""
    top = {f.name for f in fields(EngineConfig)} - set(_SECTIONS)
    return frozenset(top | set(_NESTED))

"""Frozen configuration, one dataclass per layer, and EngineConfig holding them all.

Torch-free: the command line builds an EngineConfig before anything loads torch."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field, fields, replace
from typing import Any

from engine.registry import DEFAULT_MODEL

# the names `EngineConfig.dtype` takes besides "auto" (platform.DTYPES maps them to torch)
DTYPE_NAMES = ("bfloat16", "bf16", "float32", "fp32", "float16", "fp16")
# engine/quant.py (int8, int4); gguf: a GGUF file's weights as they are
# (engine/gguf_weights.py)
# auto (the default): "gguf" for a .gguf file that can run so here, else "none"
# (engine/build.py resolve_quantization)
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
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
    # A model with local (sliding-window) and global layers: how many blocks have room in
    # every layer; the rest hold the global layers only (engine/block_manager.py
    # HybridPool). 0: enough for every sequence slot's window, at most half the memory.
    num_full_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_full_blocks < 0:
            raise ValueError("num_full_blocks must be >= 0")
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
    # Shared by the replicas on one Redis ("": none). Keys the block values' MAC (a
    # value forged or moved by whoever can write Redis is a miss) and the tenant salts
    # (so block keys in Redis reveal nothing about the prompts). Never shown in a repr.
    secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.kind not in ("none", "memory", "redis"):
            raise ValueError(f"kv tier must be none, memory or redis, got {self.kind!r}")
        if self.kind == "redis" and not self.redis_url:
            raise ValueError("kv tier 'redis' needs a redis_url (redis://host:port/db)")

    @property
    def mac_key(self) -> bytes | None:
        """The key of the block values' HMAC (cache_store.codec); None without a secret."""
        return _subkey(self.secret, b"tidewire.kv.mac") if self.secret else None

    @property
    def salt_key(self) -> bytes | None:
        """The key the tenant salts are derived with (service.gateway.Principal); None
        without a secret."""
        return _subkey(self.secret, b"tidewire.tenant") if self.secret else None


def _subkey(secret: str, purpose: bytes) -> bytes:
    """A key for one purpose, so that no two uses of the secret share a key."""
    return hmac.new(secret.encode("utf-8", "surrogateescape"), purpose, hashlib.sha256).digest()


SPECULATIVE_METHODS = ("none", "ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec_decode.py): a proposer guesses the next
    `num_tokens` tokens of a decoding request, the target model scores them all in one
    step, and exact acceptance keeps what it would have produced (greedy: the same
    tokens; sampled: the same distribution)."""

    method: str = "none"  # none | ngram (prompt lookup) | draft (a smaller model)
    num_tokens: int = 4  # proposed tokens per request per step (k)
    draft_model: str | None = None  # method "draft": its name or path (same tokenizer)
    ngram_min: int = 2  # prompt lookup matches the last n tokens, n from max down to min
    ngram_max: int = 4
    # Off-switch: after `probe_steps` speculative steps a request whose accepted tokens
    # per proposed token stay under `min_acceptance` stops proposing for `cooldown`
    # steps (doubled each time it trips), then tries again.
    min_acceptance: float = 0.15
    probe_steps: int = 4
    cooldown: int = 8
    # no speculation in a step with more running requests than this (0: no limit):
    # a full batch is compute-bound, and the proposals' extra rows cost real time
    max_batch: int = 16

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {list(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if not 1 <= self.num_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError("min_acceptance must be in [0, 1]")
        if self.probe_steps < 1 or self.cooldown < 0 or self.max_batch < 0:
            raise ValueError("probe_steps must be >= 1; cooldown and max_batch >= 0")


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
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kv_cache_memory: int = 1 << 30  # bytes for the KV pool when cache.num_blocks == 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int | None = None  # shared by unseeded requests; None: from OS entropy
    debug: bool = False  # check block-manager integrity after every step
    enforce_eager: bool = False  # no CUDA graphs for decode steps (engine/cuda_graphs.py)
    # "int8"/"int4": weight-only linears (engine/quant.py; CPU); "gguf": a GGUF's blocks as
    # they are; "auto": "gguf" for a .gguf file where that runs, else "none"
    quantization: str = "auto"
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


_SECTIONS = ("cache", "scheduler", "tier", "speculative")  # EngineConfig's sub-configs
# flat keyword name -> (sub-config, its field); the sub-configs' own names are not
# flat names, so one value cannot be given twice
_NESTED: dict[str, tuple[str, str]] = {
    "block_size": ("cache", "block_size"),
    "num_kv_blocks": ("cache", "num_blocks"),
    "num_full_kv_blocks": ("cache", "num_full_blocks"),
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
    "kv_tier_secret": ("tier", "secret"),
    "speculative": ("speculative", "method"),  # the section's own name: its method
    "num_speculative_tokens": ("speculative", "num_tokens"),
    "draft_model": ("speculative", "draft_model"),
    "speculative_ngram_min": ("speculative", "ngram_min"),
    "speculative_ngram_max": ("speculative", "ngram_max"),
    "speculative_min_acceptance": ("speculative", "min_acceptance"),
    "speculative_max_batch": ("speculative", "max_batch"),
    "speculative_probe_steps": ("speculative", "probe_steps"),
    "speculative_cooldown": ("speculative", "cooldown"),
}


def flat_names() -> frozenset[str]:
    """Every keyword `EngineConfig.with_flat` and `LLM(...)` take (model included)."""
    top = {f.name for f in fields(EngineConfig)} - set(_SECTIONS)
    return frozenset(top | set(_NESTED))

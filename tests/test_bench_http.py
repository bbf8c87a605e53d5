"""`tidewire bench http`: a whole run against the real app under uvicorn (tiny random
model), failures that must be counted rather than raised, and the chunk rules."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.http import chunk_has_content, parse_sse_line, percentile
from bench.workloads import chat64
from engine import EngineConfig
from service.cli import main
from service.config import ServiceConfig
from tests.servers import RunningServer, free_port, run_server


@pytest.fixture(scope="module")
def server(tiny_models) -> Iterator[RunningServer]:  # noqa: ANN001 - the conftest factory
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_models("llama", seed=3)),
                                               dtype="float32"), model_name="tiny")
    with run_server(config) as s:
        yield s


def _bench(base_url: str, out: Path, *extra: str) -> tuple[int, dict]:
    rc = main(["bench", "http", "--base-url", base_url, "--vocab-size", "320",
               "--num-requests", "6", "--timeout", "30", "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_bench_http_streams_the_whole_workload_from_a_real_server(server: RunningServer,
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture
                                                                  ) -> None:
    # short outputs keep the test quick; the default range is chat-64's 16-256
    rc, res = _bench(server.url + "/v1", tmp_path / "http.json", "--output-range", "8", "40")
    assert rc == 0
    assert res["model"] == "tiny"  # from GET /v1/models
    assert res["warmup_requests"] == 4  # the default, as bench offline warms up
    assert res["completed"] == 6 and res["failures"] == 0 and res["failures_by_status"] == {}
    work = chat64(320, 6, 0, output_range=(8, 40))
    assert res["output_tokens"] == sum(r.max_tokens for r in work)
    assert res["tokens_from"] == "usage" and res["max_tokens_mismatches"] == 0
    assert [r["completion_tokens"] for r in res["per_request"]] == [r.max_tokens for r in work]
    for key in ("ttft_ms", "inter_chunk_ms"):
        q = res[key]
        assert 0 < q["p50"] <= q["p99"], (key, q)
    assert res["ttft_ms"]["count"] == 6
    assert res["wall_s"] > 0
    assert res["output_tok_s"] == pytest.approx(res["output_tokens"] / res["wall_s"])
    printed = capsys.readouterr().out
    assert "output tok/s" in printed and "TTFT" in printed and "6/6" in printed


@pytest.mark.parametrize("case", ["unknown path", "unknown model", "nothing listening"])
def test_bench_http_counts_failed_requests_without_raising(server: RunningServer,
                                                           tmp_path: Path, case: str,
                                                           capsys: pytest.CaptureFixture
                                                           ) -> None:
    # Tidewire answers an unknown path with 404 not_found, an unknown model with 404
    # model_not_found; a closed port fails before any status.
    base, extra, key = {
        "unknown path": (server.url + "/nope/v1", (), "404"),
        "unknown model": (server.url + "/v1", ("--model", "gpt-9"), "404"),
        "nothing listening": (f"http://127.0.0.1:{free_port()}/v1", (),
                              "ClientConnectorError"),
    }[case]
    rc, res = _bench(base, tmp_path / "fail.json", *extra)
    assert rc == 1
    assert res["completed"] == 0 and res["failures"] == 6
    assert res["failures_by_status"] == {key: 6}
    assert res["output_tokens"] == 0 and res["ttft_ms"]["p50"] is None
    assert f"failed {key} x6" in capsys.readouterr().out


def test_content_chunks_and_sse_lines() -> None:
    assert chunk_has_content({"choices": [{"text": "hi", "finish_reason": None}]})
    # a token whose text is held back (mid-UTF-8, or no tokenizer) is still a token
    assert chunk_has_content({"choices": [{"text": "", "finish_reason": None}]})
    assert chunk_has_content({"choices": [{"text": "!", "finish_reason": "length"}]})
    assert not chunk_has_content({"choices": [{"text": "", "finish_reason": "stop"}]})
    assert not chunk_has_content({"choices": [], "usage": {"completion_tokens": 3}})
    # chat: the opening role chunk comes before any token; a token may bring the role
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    assert not chunk_has_content({"choices": [role]})
    assert chunk_has_content({"choices": [{**role, "delta": {"role": "assistant",
                                                             "content": "Hi"}}]})
    assert chunk_has_content({"choices": [{"index": 0, "delta": {"reasoning_content": "h"},
                                           "finish_reason": None}]})
    assert chunk_has_content({"choices": [{"index": 0, "delta": {}, "finish_reason": None}]})
    assert not chunk_has_content({"choices": [{"index": 0, "delta": {},
                                               "finish_reason": "stop"}]})
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line("data:[DONE]") == "[DONE]"
    assert parse_sse_line(": keep-alive") is None and parse_sse_line("") is None
    assert percentile([], 50) is None
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)


def test_bench_http_times_each_api_in_turn(tiny_chat_model, tmp_path: Path) -> None:
    """--api chat,responses,messages --rounds 2: the same words to each API's stream, every
    request to its max_tokens (the usage each API reports), medians and their ratios."""
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_chat_model), dtype="float32"),
                           model_name="tiny")
    with run_server(config) as s:
        rc, res = _bench(s.url + "/v1", tmp_path / "apis.json", "--output-range", "8", "24",
                         "--api", "chat,responses,messages", "--rounds", "2", "--warmup", "0")
    assert rc == 0 and res["apis"] == ["chat", "responses", "messages"]
    for runs in res["runs"].values():
        assert len(runs) == 2
        for r in runs:
            assert r["completed"] == 6 and r["max_tokens_mismatches"] == 0
            assert r["tokens_from"] == "usage" and r["inter_chunk_ms"]["count"] > 0
    assert res["ratio_to_first"]["chat"] == 1.0 and res["median_output_tok_s"]["responses"] > 0

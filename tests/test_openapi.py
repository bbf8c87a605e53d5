"""The HTTP API against its own OpenAPI document: `/openapi.json` describes what the
server accepts and answers, and schemathesis fuzzes the live server from it (valid and
invalid bodies for every operation). No answer may be a 5xx, and every answer must have
a documented status, content type and body shape."""

from __future__ import annotations

import json
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)

from engine import EngineConfig
from service.config import ServiceConfig
from tests.servers import http_get, run_server

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
# per operation and generation mode (schemathesis: positive, negative); `make fuzz` more
EXAMPLES = int(os.environ.get("TIDEWIRE_FUZZ_EXAMPLES", "10"))


@pytest.fixture(scope="module")
def api(tiny_chat_model):
    """A server on a tiny model with the real tokenizer: every request runs the whole
    path (templates, tokenization, constraints, tools) in milliseconds."""
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_chat_model), dtype="float32",
                                               max_model_len=512))
    with run_server(config) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(api):
    return schemathesis.openapi.from_url(api.url + "/openapi.json")


def test_the_document_is_served_and_names_every_openai_endpoint(api) -> None:
    status, body = http_get(api.url + "/openapi.json")
    doc = json.loads(body)
    assert status == 200 and doc["openapi"].startswith("3.1")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}",
            "/v1/warm", "/health", "/ready"} <= set(doc["paths"])
    # the request schemas list the fields the handlers take, and no others
    from service.openai_request import FIELDS

    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    plain = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert set(chat) | set(plain) == set(FIELDS)
    from service import anthropic_api, responses_api

    assert {"/v1/responses", "/v1/responses/{id}", "/v1/responses/{id}/cancel",
            "/v1/messages"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    assert set(schemas["ResponseRequest"]["properties"]) == responses_api.FIELDS
    assert set(schemas["MessagesRequest"]["properties"]) == anthropic_api.FIELDS


def _operations(schema) -> list:  # noqa: ANN001 - a schemathesis schema
    return [r.ok() for r in schema.get_all_operations()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_get_documented_answers(api, api_schema, mode: GenerationMode) -> None:
    """Every operation, bodies valid by the schema (positive) and not (negative). (The
    operations are driven here, not by schemathesis's pytest plugin, which does not run
    on this pytest.)"""
    ran: dict[str, int] = {}
    statuses: dict[int, int] = {}
    ops = _operations(api_schema)
    if mode is GenerationMode.NEGATIVE:  # only a body can be made invalid (any path string is valid)
        ops = [op for op in ops if op.method.upper() == "POST" and "{id}" not in op.path]
    def fuzz(op) -> None:  # noqa: ANN001 - a schemathesis APIOperation
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:  # noqa: ANN001 - a schemathesis Case
            response = case.call_and_validate(base_url=api.url, checks=CHECKS, timeout=60)
            ran[op.label] = ran.get(op.label, 0) + 1
            if "{id}" not in op.path:  # (a made-up response id is a 404 by design)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        run()

    for op in ops:
        fuzz(op)
    assert len(ran) == len(ops) and min(ran.values()) >= 1, ran
    print(f"{mode.value}: {sum(ran.values())} requests, statuses {sorted(statuses.items())}")
    if mode is GenerationMode.POSITIVE:  # valid by the schema: a good share is served
        # (~10%: 12 of 123 alone, 11 within the whole suite; most valid-by-schema bodies
        # still carry values the server refuses with 400)
        assert statuses.get(200, 0) >= sum(statuses.values()) // 12, statuses


def test_no_request_is_left_behind(api) -> None:
    """After the fuzzing: nothing in flight, every KV block back in the pool."""
    import time

    eng = api.engine
    deadline = time.monotonic() + 30
    while (eng.has_unfinished() or eng.kv.num_free_blocks != eng.num_blocks) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not eng.has_unfinished() and eng.kv.num_free_blocks == eng.num_blocks

"""Structured outputs over the wire: OpenAI `response_format` and vLLM-style
`structured_outputs` with the official `openai` SDK, and `params.response_format` on the
socket, against the real app under uvicorn on a free port."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.test_service_ws import JSON, error_frame, gen, open_client, still_serves

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Describe a city as JSON."}]


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=40_000_000)
    coastal: bool


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_parse_with_a_pydantic_model(server) -> None:
    """The SDK's own `parse`: it sends the model's strict JSON schema and parses the
    answer back into the model."""
    for seed in range(3):
        r = client(server).chat.completions.parse(
            model="smollm2-135m", messages=ASK, response_format=City, temperature=1.0,
            seed=seed, max_tokens=120)
        city = r.choices[0].message.parsed
        assert isinstance(city, City) and r.choices[0].finish_reason == "stop"
        assert 0 <= city.population <= 40_000_000


def test_json_schema_streamed(server) -> None:
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "minItems": 1, "maxItems": 3}}, "required": ["tags"]}
    stream = client(server).chat.completions.create(
        model="smollm2-135m", messages=ASK, max_tokens=80, temperature=1.0, seed=7, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # streamed
    jsonschema.validate(json.loads(text), schema)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_and_structured_outputs(server) -> None:
    c = client(server)
    ask = [{"role": "user", "content": "Give the name of one city as a JSON object."}]
    r = c.chat.completions.create(model="smollm2-135m", messages=ask, max_tokens=80, n=6,
                                  temperature=1.0, seed=0, response_format={"type": "json_object"})
    ended = [ch.message.content for ch in r.choices if ch.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(t), dict) for t in ended)
    assert all(ch.message.content.startswith("{") for ch in r.choices)
    r = c.completions.create(model="smollm2-135m", prompt="The year was", max_tokens=8,
                             temperature=1.0, seed=1,
                             extra_body={"structured_outputs": {"regex": r" (19|20)[0-9]{2}"}})
    assert re.fullmatch(r" (19|20)[0-9]{2}", r.choices[0].text), r.choices[0].text
    r = c.chat.completions.create(model="smollm2-135m", messages=ASK, max_tokens=8, n=3,
                                  temperature=1.0, seed=2,
                                  extra_body={"structured_outputs": {"choice": ["Oslo", "Lima"]}})
    assert {ch.message.content for ch in r.choices} <= {"Oslo", "Lima"}


@pytest.mark.parametrize("extra, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "nope"}}}},
     "invalid JSON schema: Unsupported type"),
    ({"response_format": {"type": "yaml"}}, "response_format.type must be one of"),
    ({"structured_outputs": {"regex": "a(b"}}, "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "invalid grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "not both"),
])
def test_bad_constraints_answer_400(server, extra: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model="smollm2-135m", messages=ASK, max_tokens=4,
                                               extra_body=extra)
    assert e.value.status_code == 400 and e.value.code == "invalid_request"
    assert message in e.value.message
    assert not server.engine.has_unfinished()


async def test_socket_response_format_and_errors(server) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    ws, c = await open_client(server, JSON)
    async with ws:
        # a schema this server has not compiled yet: the request waits for the compile
        await c.send(gen("j", "Is Paris in France? Answer in JSON.", max_tokens=20,
                         response_format={"type": "json_schema",
                                          "json_schema": {"name": "yes", "schema": schema}}))
        msgs = await c.until_done({"j"})
        text = "".join(m.get("text", "") for m in msgs if m["type"] == "delta")
        jsonschema.validate(json.loads(text), schema)
        assert msgs[-1]["status"] == "completed"
        await c.send(gen("bad", "x", response_format={"type": "regex", "regex": "(?<=a)b"}))
        assert "invalid regex" in error_frame(await c.recv(), "invalid_request", "bad")
        await c.send(gen("bad2", "x", response_format={"type": "grammar",
                                                       "grammar": "root ::= undefined_rule"}))
        assert "invalid grammar" in error_frame(await c.recv(), "invalid_request", "bad2")
        await still_serves(c)

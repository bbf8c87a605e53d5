"""Tool calling: OpenAI `tools` / `tool_choice` on /v1/chat/completions with the
official `openai` SDK against the real app, and the parser that turns a choice's text
into streamed tool-call deltas."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from service import tools as tc
from service.protocol import ProtocolError

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                           "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- the parser -----------------------------------------------------------------------------

def _replay(stream: tc.CallStream, text: str, step: int) -> list[dict]:
    deltas = []
    for i in range(0, len(text), step):
        deltas += stream.push(text[i:i + step])
    return deltas + stream.finish()


def _merge(deltas: list[dict]) -> tuple[str, list[dict]]:
    """What a client builds from the deltas (the openai SDK's accumulation)."""
    content, calls = "", []
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] == len(calls) and c["function"]["arguments"] == ""
                calls.append({"id": c["id"], "name": c["function"]["name"], "arguments": ""})
            else:
                calls[c["index"]]["arguments"] += c["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_auto_text_with_tagged_calls(step: int) -> None:
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "c"}}</tool_call><tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
            '</tool_call> Done <tool_call>not json</tool_call> <tool_ca')
    s = tc.CallStream(constrained=False)
    content, calls = _merge(_replay(s, text, step))
    assert content == "Let me check.  Done <tool_call>not json</tool_call> <tool_ca"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    assert s.message()["tool_calls"][1]["function"]["name"] == "add"
    plain = tc.CallStream(constrained=False)
    assert _merge(_replay(plain, "no calls <here>", step)) == ("no calls <here>", [])
    assert plain.message() == {"role": "assistant", "content": "no calls <here>"}


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_constrained_array_streams_argument_fragments(step: int) -> None:
    text = ('[{"name": "add", "arguments": {"a": 1, "b": {"x": "}{\\"]"}}}, '
            '{"name": "get_weather", "arguments": {"city": "Li\\"ma", "unit": "f"}}]')
    s = tc.CallStream(constrained=True)
    deltas = _replay(s, text, step)
    content, calls = _merge(deltas)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": {"x": '}{"]'}}), ("get_weather", {"city": 'Li"ma', "unit": "f"})]
    if step < 5:  # small pieces: the arguments go out as several fragments
        assert sum(1 for d in deltas if "tool_calls" in d) > 6
    msg = s.message()
    assert msg["content"] is None and [c["id"] for c in msg["tool_calls"]] == [c["id"] for c in calls]


def test_tool_parameters_are_checked() -> None:
    ok = tc.parse({"tools": TOOLS})
    assert ok is not None and ok.choice == "auto" and not ok.constrained
    assert tc.parse({"tools": TOOLS, "tool_choice": "none"}) is None
    named = tc.parse({"tools": TOOLS, "tool_choice": {"type": "function",
                                                      "function": {"name": "add"}}})
    assert named is not None and named.name == "add"
    schema = tc.constraint(named)["json_schema"]["schema"]  # type: ignore[index]
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {"const": "add"}
    for body, msg in [({"tool_choice": "auto"}, "tool_choice needs tools"),
                      ({"tools": []}, "tools must be a list"),
                      ({"tools": [{"type": "function"}]}, "must be {type: function"),
                      ({"tools": TOOLS * 2}, "distinct names"),
                      ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice must be"),
                      ({"tools": TOOLS, "tool_choice": {"type": "function",
                                                        "function": {"name": "nope"}}},
                       "not in tools"),
                      ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "must be a boolean")]:
        with pytest.raises(ProtocolError, match=msg):
            tc.parse(body)


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_tools_are_bounded_in_number_size_and_nesting() -> None:
    """Each bound is named with its field: 128 tools, 64 KiB of parameters schema as
    canonical JSON, nesting that leaves the "required" constraint within the engine's
    schema depth (its call array adds 5 levels)."""
    many = [_tool(f"f{i}", WEATHER) for i in range(tc.MAX_TOOLS + 1)]
    assert tc.parse({"tools": many[:-1]}) is not None
    with pytest.raises(ProtocolError, match="tools must be a list of 1-128 tools"):
        tc.parse({"tools": many})
    big = {"type": "object", "description": "d" * tc.MAX_PARAMETERS_BYTES}
    with pytest.raises(ProtocolError, match=r"tools\[1\]\.function\.parameters is 655\d\d bytes "
                                            r"as JSON \(the most is 65536\)"):
        tc.parse({"tools": [TOOLS[0], _tool("big", big)]})
    deep: dict = {"type": "integer"}
    for _ in range(tc.MAX_PARAMETERS_DEPTH - 1):
        deep = {"type": "array", "items": deep}
    required = tc.parse({"tools": [_tool("deep", deep)], "tool_choice": "required"})
    assert required is not None
    from engine.structured import ResponseFormat  # the constraint built from it is within

    assert ResponseFormat.parse(tc.constraint(required)) is not None
    for _ in range(10_000):  # (a depth json.dumps could not walk)
        deep = {"type": "array", "items": deep}
    with pytest.raises(ProtocolError, match=r"tools\[0\]\.function\.parameters is nested more "
                                            r"than 59 levels deep"):
        tc.parse({"tools": [_tool("deep", deep)]})


def test_history_with_calls_renders_as_text_for_a_template_without_tools() -> None:
    msgs = tc.check_messages(ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}])
    out, tools = tc.render(msgs, tc.parse({"tools": TOOLS}), template_tools=False)
    assert tools is None and out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>{"name": "get_weather", '
                      '"arguments": {"city": "Paris", "unit": "c"}}</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    same, tools = tc.render(msgs, tc.parse({"tools": TOOLS}), template_tools=True)
    assert tools is not None and tools[0]["function"]["name"] == "get_weather"
    # a template that renders tools gets the history as it is, each call's arguments an
    # object (tests/test_tool_formats.py has the rest)
    assert same[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "c"}
    assert [m["role"] for m in same] == [m["role"] for m in msgs] and same[2] == msgs[2]


# -- over HTTP ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.slow
def test_required_returns_valid_calls(server) -> None:
    c = client(server)
    for seed in range(4):
        r = c.chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS,
                                      tool_choice="required", temperature=1.0, seed=seed,
                                      max_tokens=120)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        assert ch.message.tool_calls and ch.message.tool_calls[0].id.startswith("call_")
        for call in ch.message.tool_calls:
            _check_call(call.function.name, call.function.arguments)


@pytest.mark.slow
def test_required_streamed_and_named_function(server) -> None:
    c = client(server)
    stream = c.chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS,
                                       tool_choice="required", temperature=0, max_tokens=120,
                                       stream=True, parallel_tool_calls=False)
    chunks = list(stream)
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name in SCHEMAS and len(deltas) > 2
    args = "".join(d.function.arguments or "" for d in deltas)
    assert {d.index for d in deltas} == {0}  # parallel_tool_calls=False: one call
    _check_call(deltas[0].function.name, args)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    r = c.chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS,
                                  tool_choice={"type": "function", "function": {"name": "add"}},
                                  temperature=0, max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add"
    _check_call("add", call.function.arguments)


@pytest.mark.slow
def test_tool_turns_in_history_and_auto(server) -> None:
    hist = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    r = client(server).chat.completions.create(model="smollm2-135m", messages=hist, tools=TOOLS,
                                               temperature=0, max_tokens=24)
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length", "tool_calls")
    assert ch.message.content or ch.message.tool_calls
    r = client(server).chat.completions.create(model="smollm2-135m", messages=hist, max_tokens=8,
                                               temperature=0, tool_choice="none", tools=TOOLS)
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
     "not in tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nah"}}}],
      "tool_choice": "required"}, "invalid JSON schema"),
])
def test_bad_tool_requests_answer_400(server, extra: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model="smollm2-135m", messages=ASK, max_tokens=4,
                                               extra_body=extra)
    assert e.value.code == "invalid_request" and message in e.value.message
    with pytest.raises(openai.BadRequestError, match="chat/completions parameter"):
        client(server).completions.create(model="smollm2-135m", prompt="x", max_tokens=2,
                                          extra_body={"tools": TOOLS})


@pytest.mark.slow
async def test_socket_tools_required(server) -> None:
    from tests.test_service_ws import JSON, error_frame, open_client

    ws, c = await open_client(server, JSON)
    async with ws:
        await c.send({"type": "generate", "id": "t", "messages": ASK,
                      "params": {"max_tokens": 120, "temperature": 0, "tools": TOOLS,
                                 "tool_choice": "required", "parallel_tool_calls": False}})
        msgs = await c.until_done({"t"})
        deltas = [tc for m in msgs if m["type"] == "delta" for tc in m.get("tool_calls", [])]
        assert deltas and deltas[0]["id"].startswith("call_") and deltas[0]["type"] == "function"
        args = "".join(d["function"]["arguments"] for d in deltas)
        done = msgs[-1]
        assert done["finish_reason"] == "tool_calls" and done["content"] is None
        (call,) = done["tool_calls"]
        assert call["id"] == deltas[0]["id"] and call["function"]["arguments"] == args
        _check_call(call["function"]["name"], args)
        await c.send({"type": "generate", "id": "bad", "messages": ASK,
                      "params": {"tool_choice": "required"}})
        assert "tool_choice needs tools" in error_frame(await c.recv(), "invalid_request", "bad")


def test_content_parts_join_their_texts_and_a_non_string_text_is_refused() -> None:
    msgs = tc.check_messages([{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "text", "text": "b"}]}])
    assert msgs == [{"role": "user", "content": "ab"}]
    for bad in ({}, 7, None, ["a"]):  # was a TypeError: a 500 instead of a 400
        with pytest.raises(ProtocolError, match="content part's text must be a string"):
            tc.check_messages([{"role": "user", "content": [{"text": "a"}, {"text": bad}]}])

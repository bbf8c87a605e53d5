"""The APIs agent SDKs speak, end to end through the official SDKs against the real app:
OpenAI's Responses (`client.responses`: whole and streamed, tools, text.format,
previous_response_id, background + retrieve + stream resume, cancel, delete) and
Anthropic's Messages (`client.messages.create` / `.stream`, tools, stop sequences,
output_config.format, errors in Anthropic's shape, x-api-key). Greedy comparisons run
after a warm-up request, so that every compared run finds the same prompt blocks cached
(a run that computes its whole prompt takes other kernel paths, which in bf16 may round
differently)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from engine import EngineConfig
from service.config import ServiceConfig
from tests.servers import run_server

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
GREEDY = {"temperature": 0}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"]}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def server():
    """The default model's file run as stored (its Q4_1 and Q8_0 blocks): these APIs'
    shapes and flows do not depend on the weights' precision, and on a CPU without native
    bf16 it decodes about twice as fast as the dequantized fp32 model."""
    with run_server(ServiceConfig(engine=EngineConfig(model=MODEL, quantization="gguf"))) as s:
        yield s


def oai(server, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def claude(server, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


# -- OpenAI Responses --------------------------------------------------------------------------

def test_responses_whole_and_streamed_agree(server) -> None:
    c = oai(server)
    ask = {"model": MODEL, "input": "Name three colors.", "instructions": "Be brief.",
           "max_output_tokens": 8, **GREEDY}
    c.responses.create(**ask)  # warm-up: the prompt's blocks cached
    whole = c.responses.create(**ask)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 8 and whole.usage.input_tokens > 10
    assert whole.usage.input_tokens_details.cached_tokens > 0
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant" and whole.output_text
    events = list(c.responses.create(**ask, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text
    final = events[-1].response
    assert final.output_text == streamed and final.status == "incomplete"
    assert c.responses.retrieve(final.id).output_text == streamed  # stored by default


def test_responses_continue_from_previous_response(server) -> None:
    c = oai(server)
    first = c.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                               max_output_tokens=12, **GREEDY)
    second = c.responses.create(model=MODEL, input="What is my name?",
                                previous_response_id=first.id, max_output_tokens=12, **GREEDY)
    assert second.previous_response_id == first.id and second.status in ("completed",
                                                                         "incomplete")
    alone = c.responses.create(model=MODEL, input="What is my name?", max_output_tokens=1)
    # the earlier turn and its answer came along; its instructions did not
    carried = second.usage.input_tokens - alone.usage.input_tokens
    assert first.usage.input_tokens - 3 <= carried < first.usage.input_tokens \
        + first.usage.output_tokens + 8
    unstored = c.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError, match="not a stored response"):
        c.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id)


def test_responses_function_calls_and_their_outputs(server) -> None:
    c = oai(server)
    tools = [{"type": "function", "name": "get_weather", "description": "Weather now",
              "parameters": CITY}]
    ask = {"model": MODEL, "input": "What is the weather in Paris?", "tools": tools,
           "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 60,
           **GREEDY}
    r = c.responses.create(**ask)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), CITY)
    events = list(c.responses.create(**ask, stream=True))
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments and done.name == "get_weather"
    jsonschema.validate(json.loads(deltas), CITY)
    after = c.responses.create(model=MODEL, previous_response_id=r.id, tools=tools,
                               input=[{"type": "function_call_output", "call_id": call.call_id,
                                       "output": "18 C and sunny"}],
                               max_output_tokens=12, **GREEDY)
    assert after.status in ("completed", "incomplete") and after.output
    # the whole exchange as input items, no stored state
    again = c.responses.create(model=MODEL, tools=tools, max_output_tokens=4, store=False, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}])
    assert again.usage.input_tokens > 20


def test_responses_text_format_json_schema(server) -> None:
    r = oai(server).responses.create(model=MODEL, input="Describe a person as JSON.",
                                     max_output_tokens=60, **GREEDY, text={"format": {
                                         "type": "json_schema", "name": "person",
                                         "schema": PERSON}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)


def test_responses_background_retrieve_and_resume_the_stream(server) -> None:
    c = oai(server)
    b = c.responses.create(model=MODEL, input="Tell me a story.", background=True,
                           max_output_tokens=48, **GREEDY)
    assert b.background and b.status in ("queued", "in_progress")
    whole = list(c.responses.retrieve(b.id, stream=True))  # from the start, live
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    assert whole[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in whole if e.type == "response.output_text.delta")
    for bad in ("--1", "-2", "x"):  # refused, not a 500 or a broken replay
        with pytest.raises(openai.BadRequestError, match="starting_after"):
            list(c.responses.retrieve(b.id, stream=True, extra_query={"starting_after": bad}))
    # a client that dropped after event 5 picks up at 6, whatever replica state is left
    rest = list(c.responses.retrieve(b.id, stream=True, starting_after=5))
    assert rest[0].sequence_number == 6 and [e.type for e in rest] == [e.type for e in whole[6:]]
    assert c.responses.retrieve(b.id).output_text == text and len(text) > 20


def test_responses_cancel_and_delete(server) -> None:
    c = oai(server)
    b = c.responses.create(model=MODEL, input="Count to one thousand.", background=True,
                           max_output_tokens=2000, extra_body={"ignore_eos": True})
    cancelled = c.responses.cancel(b.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 2000
    assert c.responses.retrieve(b.id).status == "cancelled"
    c.responses.delete(b.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(b.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(b.id)
    plain = c.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="only background"):
        c.responses.cancel(plain.id)
    # the engine holds nothing once they are over
    assert server.gateway.inflight_total == 0


@pytest.mark.parametrize("extra, message", [
    ({"input": []}, "input must be"),
    ({"input": [{"role": "user", "content": "x"}] * 1025}, "1-1024 items"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "not supported"),
    ({"tools": [{"type": "web_search"}]}, "only function tools"),
    ({"background": True, "store": False}, "must be stored"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"extra_body": {"frobnicate": 1}}, "unknown parameter"),
])
def test_responses_bad_requests_answer_400(server, extra: dict, message: str) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError, match=message):
        oai(server).responses.create(**body)


# -- Anthropic Messages ------------------------------------------------------------------------

def test_messages_whole_and_streamed_agree(server) -> None:
    c = claude(server)
    ask = {"model": MODEL, "max_tokens": 8, "system": "Be brief.",
           "messages": [{"role": "user", "content": "Name three colors."}], "extra_body": GREEDY}
    c.messages.create(**ask)  # warm-up
    whole = c.messages.create(**ask)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 8
    assert whole.usage.cache_read_input_tokens > 0 and whole.usage.input_tokens > 0
    (block,) = whole.content
    with c.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text and final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_messages_raw_event_order(server) -> None:
    events = list(claude(server).messages.create(
        model=MODEL, max_tokens=6, stream=True, extra_body=GREEDY,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 6


def test_messages_tools_and_results(server) -> None:
    c = claude(server)
    tools = [{"name": "get_weather", "description": "Weather now", "input_schema": CITY}]
    ask = {"model": MODEL, "max_tokens": 60, "tools": tools, "extra_body": GREEDY,
           "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
           "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    r = c.messages.create(**ask)
    (use,) = r.content
    assert r.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, CITY)
    with c.messages.stream(**ask) as stream:
        parts = [e.delta.partial_json for e in stream
                 if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and json.loads("".join(parts)) == final.content[0].input
    named = c.messages.create(**{**ask, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert named.content[0].name == "get_weather"
    after = c.messages.create(model=MODEL, max_tokens=12, tools=tools, extra_body=GREEDY,
                              messages=[*ask["messages"],
                                        {"role": "assistant", "content": [
                                            {"type": "tool_use", "id": use.id,
                                             "name": "get_weather", "input": use.input}]},
                                        {"role": "user", "content": [
                                            {"type": "tool_result", "tool_use_id": use.id,
                                             "content": "18 C and sunny"}]}])
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use") and after.content


def test_messages_stop_sequences_and_output_format(server) -> None:
    c = claude(server)
    r = c.messages.create(model=MODEL, max_tokens=60, stop_sequences=["."], extra_body=GREEDY,
                          messages=[{"role": "user", "content": "Tell me about Paris."}])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "."
    assert "." not in r.content[0].text
    r = c.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY,
                          output_config={"format": {"type": "json_schema", "schema": PERSON}},
                          messages=[{"role": "user", "content": "Describe a person."}])
    jsonschema.validate(json.loads(r.content[0].text), PERSON)


@pytest.mark.parametrize("extra, error, message", [
    ({"max_tokens": 0}, anthropic.BadRequestError, "max_tokens"),
    ({"model": "claude-nope"}, anthropic.NotFoundError, "not served"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     anthropic.BadRequestError, "not supported"),
    ({"thinking": {"type": "sideways"}}, anthropic.BadRequestError, "thinking must be"),
    ({"thinking": {"type": "enabled", "budget_tokens": (1 << 20) + 1}},
     anthropic.BadRequestError, "thinking must be"),
])
def test_messages_errors_in_anthropic_shape(server, extra: dict, error: type,
                                            message: str) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
            **extra}
    with pytest.raises(error) as e:
        claude(server).messages.create(**body)
    assert e.value.body["type"] == "error" and message in e.value.body["error"]["message"]
    assert e.value.body["error"]["type"] in ("invalid_request_error", "not_found_error")


# -- keys and tenants --------------------------------------------------------------------------

def test_keys_tenants_and_x_api_key(tiny_chat_model) -> None:
    """Anthropic's x-api-key is a key like a Bearer one; a stored response belongs to its
    key's tenant (another tenant's GET, continuation and delete find nothing)."""
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_chat_model), dtype="float32"),
                           model_name=MODEL, api_keys={"sk-a": "a", "sk-b": "b"})
    with run_server(config) as s:
        msg = claude(s, "sk-a").messages.create(model=MODEL, max_tokens=2,
                                                messages=[{"role": "user", "content": "Hi"}])
        assert msg.usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError) as e:
            claude(s, "sk-wrong").messages.create(model=MODEL, max_tokens=2,
                                                  messages=[{"role": "user", "content": "Hi"}])
        assert e.value.body["error"]["type"] == "authentication_error"
        a, b = oai(s, "sk-a"), oai(s, "sk-b")
        r = a.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
        assert a.responses.retrieve(r.id).id == r.id
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError):
            b.responses.create(model=MODEL, input="Hi", previous_response_id=r.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(r.id)
        with pytest.raises(openai.AuthenticationError):
            oai(s, "sk-wrong").responses.retrieve(r.id)


# -- Responses WebSocket mode -----------------------------------------------------------------

def _until_end(conn, n: int = 1) -> list:  # noqa: ANN001 - an openai ResponsesConnection
    """Events until `n` responses have ended (or an error event)."""
    events, ended = [], 0
    while ended < n:
        e = conn.recv()
        events.append(e)
        ended += e.type in ("response.completed", "response.incomplete", "response.failed",
                            "error")
    return events


def test_websocket_mode_through_the_sdk(server) -> None:
    """client.responses.connect(): response.create answered by the same events as the
    HTTP stream; generate: false prefills a turn that a later one continues from its
    cache; store=false responses continue on the same socket; stream_id lanes run side
    by side, their events tagged; a bad message is an error event and the socket goes on."""
    c = oai(server)
    ask = {"model": MODEL, "input": "Name three colors.", "instructions": "Be brief.",
           "max_output_tokens": 12, **GREEDY}
    c.responses.create(**ask)  # warm-up
    http = [e.type for e in c.responses.create(**ask, stream=True)]
    with c.responses.connect() as conn:
        conn.send({"type": "response.create", **ask})
        events = _until_end(conn)
        assert [e.type for e in events] == http
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == events[-1].response.output_text and text
        # a prepared turn, then its continuation (its prompt found in the cache)
        conn.send({"type": "response.create", "model": MODEL, "generate": False,
                   "store": False, "input": "A long preamble about the sea. " * 8})
        (created, done) = _until_end(conn)
        assert done.type == "response.completed" and done.response.output == []
        conn.send({"type": "response.create", "model": MODEL, "input": "Go on.",
                   "previous_response_id": done.response.id, "store": False,
                   "max_output_tokens": 4})
        after = _until_end(conn)[-1].response
        assert after.usage.input_tokens_details.cached_tokens >= 32
        assert after.usage.input_tokens > done.response.usage.input_tokens
        with pytest.raises(openai.NotFoundError):  # store=false: this socket's alone
            c.responses.retrieve(after.id)
        # two lanes in flight at once
        for lane in ("a", "b"):
            conn.send({"type": "response.create", "stream_id": lane, "model": MODEL,
                       "input": f"Lane {lane}", "max_output_tokens": 24, **GREEDY})
        both = _until_end(conn, 2)
        lanes = {e.stream_id for e in both}
        assert lanes == {"a", "b"} and {e.response.status for e in both[-2:] if
                                         hasattr(e, "response")} <= {"completed", "incomplete"}
        firsts = [i for i, e in enumerate(both) if e.type == "response.created"]
        ends = [i for i, e in enumerate(both) if e.type in ("response.completed",
                                                            "response.incomplete")]
        assert max(firsts) < min(ends)  # both had started before either ended
        conn.send({"type": "response.nope"})
        (err,) = _until_end(conn)
        assert err.type == "error" and err.status == 400
        limit = server.gateway.config.limits.max_message_bytes
        conn.send({"type": "response.create", "model": MODEL, "input": "x" * limit})
        (err,) = _until_end(conn)
        assert err.type == "error" and err.status == 413 and err.error.code == "message_too_big"
        for bad in ({"type": "response.resume", "response_id": events[-1].response.id,
                     "starting_after": -50},
                    {"type": "response.create", "model": MODEL, "input": "Hi",
                     "stream_id": ["not", "a", "string"]},
                    {"type": "response.create", "model": MODEL, "input": "Hi",
                     "generate": "no"}):
            conn.send(bad)
            (err,) = _until_end(conn)
            assert err.type == "error" and err.status == 400, err
        conn.send({"type": "response.create", "model": MODEL, "input": "Hi",
                   "max_output_tokens": 2})
        assert _until_end(conn)[-1].type == "response.incomplete"


async def test_websocket_mode_resumes_after_a_dropped_socket(server) -> None:
    """A stored response whose socket drops runs on for the grace period; a new socket
    sends response.resume {response_id, starting_after} and gets the rest, ending as the
    uninterrupted events do."""
    from websockets.asyncio.client import connect

    url = server.url.replace("http", "ws") + "/v1/responses"
    ask = {"type": "response.create", "model": MODEL, "input": "Tell me a story.",
           "max_output_tokens": 64, **GREEDY}
    async with connect(url) as ws:
        for _ in range(2):  # (the first one a warm-up: the prompt's blocks cached)
            await ws.send(json.dumps(ask))
            whole = []
            while not whole or whole[-1]["type"] not in ("response.completed",
                                                         "response.incomplete"):
                whole.append(json.loads(await ws.recv()))
    ws = await connect(url)
    await ws.send(json.dumps(ask))
    before = [json.loads(await ws.recv()) for _ in range(8)]
    ws.transport.abort()
    rid = before[0]["response"]["id"]
    async with connect(url) as ws:
        await ws.send(json.dumps({"type": "response.resume", "response_id": rid,
                                  "starting_after": 7}))
        rest = []
        while not rest or rest[-1]["type"] not in ("response.completed",
                                                   "response.incomplete"):
            rest.append(json.loads(await ws.recv()))
    got = before + rest
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert [e["type"] for e in got] == [e["type"] for e in whole]
    text = "".join(e.get("delta", "") for e in got if e["type"] == "response.output_text.delta")
    assert text == "".join(e.get("delta", "") for e in whole
                           if e["type"] == "response.output_text.delta")

"""Tool calls read in each model family's own format (service/tool_formats.py): the format
picked from the chat template, each format's reader whole and split at every point, and
the real app on a tiny model whose chat template renders tools in the Llama 3 or the
Mistral style, its answers forced by a regex so that they are calls."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import openai
import pytest

from service import tool_formats as tf
from service import tools as tc

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}}}}}]
NAMES = ("get_weather", "add")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NINE = re.compile(r"[A-Za-z0-9]{9}")


# -- the format, from the template ----------------------------------------------------------

# fragments as each family's template writes them (written for these tests)
LLAMA31 = ("{%- if tools %}{{- \"Respond in the format {\\\"name\\\": function name, "
           "\\\"parameters\\\": its arguments}.\" }}{% endif %}")
LLAMA32 = "{%- if tools is not none %}{{- 'Respond with {\"name\": ..., \"parameters\": ...}' }}"
LLAMA_TAG = "{%- if tools %}{{ tools }}{% endif %}{{- '<|python_tag|>' + tool_call.name }}"
MISTRAL = ("{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
           "[TOOL_CALLS]")
QWEN = "{%- if tools %}<tools>{{ tools }}</tools> answer in <tool_call></tool_call>{% endif %}"


@pytest.mark.parametrize("template, fmt", [
    (LLAMA31, "llama3"), (LLAMA32, "llama3"), (LLAMA_TAG, "llama3"), (MISTRAL, "mistral"),
    (QWEN, "hermes"),
    # no tools rendered: Tidewire's own <tool_call> prompt, whatever the family
    ("{{ messages }} [TOOL_CALLS] <|python_tag|>", "hermes"),
    ("{%- if tools %}{{ tools }} in a format of its own{% endif %}", "hermes"),
    (None, "hermes"), ({"default": MISTRAL}, "hermes")])
def test_the_format_comes_from_the_chat_template(template, fmt: str) -> None:
    assert tf.call_format(template) == fmt

    class Tok:
        chat_template = template

    t = tc.for_model(tc.parse({"tools": TOOLS}), Tok())
    assert t is not None and t.format == fmt
    assert tc.for_model(None, Tok()) is None


# -- the readers --------------------------------------------------------------------------------

def _merge(deltas: list[dict]) -> tuple[str, list[tuple[str, str, dict]]]:
    """What a client builds from the deltas (the openai SDK's accumulation): the content,
    and each call's (id, name, arguments)."""
    content, calls = "", []
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] == len(calls) and c["function"]["arguments"] == ""
                calls.append([c["id"], c["function"]["name"], ""])
            else:
                calls[c["index"]][2] += c["function"]["arguments"]
    return content, [(i, name, json.loads(args)) for i, name, args in calls]


def _read(fmt: str, pieces: list[str]) -> tuple[tf.CallStream, list[dict]]:
    s = tf.CallStream(False, fmt, NAMES)
    deltas = [d for p in pieces for d in s.push(p)]
    return s, deltas + s.finish()


def _splits(text: str) -> list[list[str]]:
    """The text whole, a character at a time, and cut in two at every point."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


def _check(fmt: str, text: str, content: str, calls: list[tuple[str, dict]]) -> None:
    """Every way of cutting the text gives the same content and calls (deltas cannot be
    taken back: a marker's start sent as content would stay in it)."""
    for pieces in _splits(text):
        s, deltas = _read(fmt, pieces)
        got, got_calls = _merge(deltas)
        assert (got, [(n, a) for _, n, a in got_calls]) == (content, calls), pieces
        msg = s.message()
        assert msg["content"] == (content or (None if calls else ""))
        assert [c["id"] for c in msg.get("tool_calls", [])] == [i for i, _, _ in got_calls]
        for i, _, _ in got_calls:
            assert NINE.fullmatch(i) if fmt == "mistral" else i.startswith("call_")


WEATHER = {"city": 'Li"ma }{ ][', "unit": "c"}
ADD = {"a": 1, "b": 2}

LLAMA_CASES = [
    # (text, content, calls)
    ('{"name": "get_weather", "parameters": {"city": "Li\\"ma }{ ][", "unit": "c"}}', "",
     [("get_weather", WEATHER)]),
    ('\n\n<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
     '{"name": "get_weather", "parameters": {"city": "Li\\"ma }{ ][", "unit": "c"}}\n', "",
     [("add", ADD), ("get_weather", WEATHER)]),
    ('{"type": "function", "name": "add", "arguments": {"a": 1, "b": 2}}', "", [("add", ADD)]),
    ("Let me check.<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": 1, \"b\": 2}}",
     "Let me check.", [("add", ADD)]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}} That is all.', " That is all.",
     [("add", ADD)]),
    # not calls: an object that is not at the start, an answer in JSON, malformed JSON
    ('The call is {"name": "add", "parameters": {}}', 'The call is {"name": "add", '
     '"parameters": {}}', []),
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    (' {"name": "add", "parameters": {"a": 1,}}', ' {"name": "add", "parameters": {"a": 1,}}', []),
    ('{"name": "add", "parameters": {"a": 1}', '{"name": "add", "parameters": {"a": 1}', []),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": oops}', '; {"name": oops}',
     [("add", ADD)]),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("Hello <|python_ta", "Hello <|python_ta", []),
    ("   ", "   ", []),
]


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_calls_at_every_split(text: str, content: str, calls: list) -> None:
    _check("llama3", text, content, calls)


MISTRAL_CASES = [
    ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
     '{"name": "get_weather", "arguments": {"city": "Li\\"ma }{ ][", "unit": "c"}}]', "",
     [("add", ADD), ("get_weather", WEATHER)]),
    ('Sure. [TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Li\\"ma }{ ][", "unit": "c"}', "Sure. ",
     [("add", ADD), ("get_weather", WEATHER)]),
    ('[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1, "b": 2}', "", [("add", ADD)]),
    # the markers left out (skip_special_tokens): an answer that starts with the array,
    # or with a function's name and its arguments
    ('[{"name": "add", "arguments": {"a": 1, "b": 2}}]', "", [("add", ADD)]),
    ('add{"a": 1, "b": 2}get_weather{"city": "Li\\"ma }{ ][", "unit": "c"}', "",
     [("add", ADD), ("get_weather", WEATHER)]),
    # not calls
    ("[1, 2] are numbers; adding them gives 3", "[1, 2] are numbers; adding them gives 3", []),
    ("addition{is} easy", "addition{is} easy", []),
    ('mul{"a": 1}', 'mul{"a": 1}', []),
    ('[TOOL_CALLS][{"name": "add", "arguments": nope}] ok', '[TOOL_CALLS][{"name": "add", '
     '"arguments": nope}] ok', []),
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}]', '[TOOL_CALLS][{"name": "add", '
     '"arguments": {"a": 1}]', []),
    ('[TOOL_CALLS][{"name": "add", "args": {}}]', '[TOOL_CALLS][{"name": "add", "args": {}}]', []),
    ("[TOOL_CALLS]I will not call anything.", "[TOOL_CALLS]I will not call anything.", []),
    ('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]add[ARGS]{"a": ', '[TOOL_CALLS]add[ARGS]'
     '{"a": ', [("add", ADD)]),
    ("Fine [TOOL_CA", "Fine [TOOL_CA", []),
]


@pytest.mark.parametrize("text, content, calls", MISTRAL_CASES)
def test_mistral_calls_at_every_split(text: str, content: str, calls: list) -> None:
    _check("mistral", text, content, calls)


HERMES_CASES = [
    ('Let me check. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Li\\"ma }{ ][", "unit": "c"}}'
     '</tool_call>', "Let me check. ", [("add", ADD), ("get_weather", WEATHER)]),
    ("<tool_call>not json</tool_call> <tool_call>{\"name\": \"add\"",
     "<tool_call>not json</tool_call> <tool_call>{\"name\": \"add\"", []),
    # another family's call is text to a hermes model
    ('{"name": "add", "parameters": {"a": 1}}', '{"name": "add", "parameters": {"a": 1}}', []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_calls_at_every_split(text: str, content: str, calls: list) -> None:
    _check("hermes", text, content, calls)


@pytest.mark.parametrize("fmt, before, call", [
    ("llama3", "Let me check. ", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}'),
    ("mistral", "Let me check. ", '[TOOL_CALLS]add[ARGS]{"a": 1}'),
    ("hermes", "Let me check. ", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')])
def test_text_before_a_call_streams_before_the_call_is_complete(fmt: str, before: str,
                                                                 call: str) -> None:
    s = tf.CallStream(False, fmt, NAMES)
    sent = [d for ch in before + call[:-1] for d in s.push(ch)]
    assert _merge(sent) == (before, [])  # all of it, while the call is still open
    assert [c["function"]["name"] for d in s.push(call[-1]) for c in d["tool_calls"]
            if "id" in c] == ["add"]


def test_a_constrained_answer_is_the_same_array_whatever_the_format() -> None:
    text = '[{"name": "add", "arguments": {"a": 1, "b": 2}}]'
    for fmt, ids in (("mistral", NINE), ("llama3", re.compile(r"call_\w{24}"))):
        s = tf.CallStream(True, fmt, NAMES)
        content, calls = _merge([d for ch in text for d in s.push(ch)] + s.finish())
        assert content == "" and [(n, a) for _, n, a in calls] == [("add", ADD)]
        assert ids.fullmatch(calls[0][0])
    with pytest.raises(ValueError, match="unknown tool-call format"):
        tf.CallStream(False, "pythonic")


def test_history_for_a_template_that_renders_tools() -> None:
    """Arguments go to the template as objects; a mistral model's ids become 9 letters
    and digits, the same for a call and its result (one already so is kept)."""
    msgs = tc.check_messages(ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "a1b2c3d4e", "type": "function", "function": {"name": "add",
                                                                 "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "3"}])

    class Tok:
        chat_template = MISTRAL

    t = tc.for_model(tc.parse({"tools": TOOLS}), Tok())
    out, tools = tc.render(msgs, t, template_tools=True)
    assert tools is not None and [f["function"]["name"] for f in tools] == list(NAMES)
    first, second = out[1]["tool_calls"]
    assert first["function"]["arguments"] == {"city": "Paris"}
    assert second["function"]["arguments"] == "not json"  # (left as the client sent it)
    assert NINE.fullmatch(first["id"]) and out[2]["tool_call_id"] == first["id"]
    assert second["id"] == out[3]["tool_call_id"] == "a1b2c3d4e"
    assert msgs[1]["tool_calls"][0]["id"] == "call_1"  # the request's own are untouched
    out, _ = tc.render(msgs, tc.parse({"tools": TOOLS}), template_tools=True)
    assert out[1]["tool_calls"][0]["id"] == "call_1" == out[2]["tool_call_id"]  # hermes


# -- over HTTP and the socket, on templates that render tools ----------------------------------

# small templates of each family's style, written for these tests
LLAMA_TEMPLATE = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nTo call a function, answer "
    "with {\"name\": function name, \"parameters\": its arguments}.\n{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", "
    "\"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}"
    "{%- else %}{{ m['content'] }}{% endif %}<|eot_id|>{% endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL_TEMPLATE = (
    "{%- for m in messages %}{% if m['role'] == 'user' %}"
    "{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST]{{ m['content'] }}[/INST]"
    "{%- elif m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{% if c.id | length != 9 %}{{ raise_exception('Tool call ids must be 9 characters') }}"
    "{% endif %}{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}, \"id\": \"{{ c.id }}\"}{% endfor %}]</s>"
    "{%- elif m['role'] == 'tool' %}[TOOL_RESULTS]{\"call_id\": \"{{ m.tool_call_id }}\", "
    "\"content\": {{ m['content'] | tojson }}}[/TOOL_RESULTS]"
    "{%- else %}{{ m['content'] }}</s>{% endif %}{% endfor %}")


@pytest.fixture(scope="module", params=["llama3", "mistral"])
def server(request, tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """The real app on the tiny chat model, its chat template one of each family's."""
    from transformers import AutoTokenizer

    from engine import EngineConfig
    from service.config import ServiceConfig
    from tests.servers import run_server

    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    shutil.copytree(tiny_chat_model, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = LLAMA_TEMPLATE if request.param == "llama3" else MISTRAL_TEMPLATE
    tok.save_pretrained(path)
    with run_server(ServiceConfig(engine=EngineConfig(model=str(path), dtype="float32"))) as s:
        s.family = request.param
        yield s


def _chat(server, forced: str, stream: bool = False, messages: list | None = None):  # noqa: ANN202
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    return c.chat.completions.create(
        model="smollm2-135m", messages=messages or ASK, tools=TOOLS, temperature=0,
        max_tokens=80, stream=stream,
        response_format={"type": "regex", "regex": forced})


# each family's answer, forced: (regex, content, calls)
FORCED = {
    "llama3": [
        (r'\{"name": "get_weather", "parameters": \{"city": "Paris"\}\}', None,
         [("get_weather", {"city": "Paris"})]),
        (r'<\|python_tag\|>\{"name": "add", "parameters": \{"a": 1\}\}; '
         r'\{"name": "get_weather", "parameters": \{"city": "Oslo"\}\}', None,
         [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})])],
    "mistral": [
        (r'Let me check\. \[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": '
         r'\{"city": "Paris"\}\}\]', "Let me check. ", [("get_weather", {"city": "Paris"})]),
        (r'\[TOOL_CALLS\]add\[ARGS\]\{"a": 1\}\[TOOL_CALLS\]get_weather\[ARGS\]'
         r'\{"city": "Oslo"\}', None, [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})])],
}


def _ids_fit(server, ids: list[str]) -> bool:
    return all(NINE.fullmatch(i) if server.family == "mistral" else i.startswith("call_")
               for i in ids)


@pytest.mark.slow
def test_http_answers_in_the_family_format_come_back_as_tool_calls(server) -> None:
    for forced, content, calls in FORCED[server.family]:
        r = _chat(server, forced)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content == content
        assert [(c.function.name, json.loads(c.function.arguments))
                for c in ch.message.tool_calls] == calls
        assert _ids_fit(server, [c.id for c in ch.message.tool_calls])
        chunks = [k for k in _chat(server, forced, stream=True) if k.choices]
        deltas = [d for k in chunks for d in k.choices[0].delta.tool_calls or []]
        streamed: list[list] = []
        for d in deltas:
            if d.id:
                streamed.append([d.function.name, ""])
            streamed[d.index][1] += d.function.arguments or ""
        assert [(n, json.loads(a)) for n, a in streamed] == calls
        assert "".join(k.choices[0].delta.content or "" for k in chunks) == (content or "")
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_http_a_history_with_calls_renders_through_the_family_template(server) -> None:
    """The earlier call's id is OpenAI's shape; a mistral template refuses any but 9
    characters, so it is rewritten (the same for the call and its result)."""
    hist = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "user", "content": "And in Oslo?"}]
    forced, content, calls = FORCED[server.family][0]
    r = _chat(server, forced.replace("Paris", "Oslo"), messages=hist)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == [calls[0][0]]


@pytest.mark.slow
async def test_socket_calls_in_the_family_format(server) -> None:
    from tests.test_service_ws import JSON, open_client

    forced, content, calls = FORCED[server.family][1]
    ws, c = await open_client(server, JSON)
    async with ws:
        await c.send({"type": "generate", "id": "t", "messages": ASK,
                      "params": {"max_tokens": 80, "temperature": 0, "tools": TOOLS,
                                 "response_format": {"type": "regex", "regex": forced}}})
        msgs = await c.until_done({"t"})
        done = msgs[-1]
        assert done["finish_reason"] == "tool_calls" and done["content"] is None
        assert [(x["function"]["name"], json.loads(x["function"]["arguments"]))
                for x in done["tool_calls"]] == calls
        assert _ids_fit(server, [x["id"] for x in done["tool_calls"]])

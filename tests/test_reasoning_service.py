"""Reasoning output end to end, on a tiny random model whose chat template thinks (it
opens `<think>` in the prompt unless `enable_thinking` is false): the real app under
uvicorn, the official `openai` SDK, the socket protocol (frames, resume, continuation on
a server that never saw the request), both SDKs and the chat page in Chromium.

A random model never writes `</think>` itself, so where a test needs thinking and then
an answer, a regex constraint writes them (a constrained request is split as if its
prompt opened nothing: the tags it writes open and close the reasoning), or the
reasoning budget makes the engine write the close."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import openai
import pytest

from engine import EngineConfig
from service.config import Limits, ServiceConfig
from service.reasoning import split
from tests.conftest import make_tiny_model
from tests.servers import run_server
from tests.test_service_ws import gen, open_client, wait_free
from tidewire_client import AsyncClient, Client, DeltaEvent

# the template of a thinking model (as Qwen3's: <think> opened unless enable_thinking is false)
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What is the capital of France?"}]
Q = ASK[0]["content"]
FORCED = {"type": "regex", "regex": r"<think>Let me think\.</think>\n\nParis\."}
JS = Path(__file__).resolve().parents[1] / "clients" / "js"


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory, smollm2_dir) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and a thinking chat template."""
    from transformers import AutoTokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-thinking"), "llama", 5,
                           vocab_size=49152)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(thinking_model):
    config = ServiceConfig(engine=EngineConfig(model=str(thinking_model), dtype="float32"),
                           limits=Limits(resume_grace=30))
    with run_server(config) as s:
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def chat(server, **kw):  # noqa: ANN201 - openai's ChatCompletion
    kw.setdefault("temperature", 0)
    return client(server).chat.completions.create(model="smollm2-135m", messages=ASK, **kw)


def post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def streamed(stream) -> tuple[str, str, list]:  # noqa: ANN001 - openai's Stream
    """(reasoning, content, the chunks) of a streamed chat completion."""
    chunks = [c for c in stream if c.choices]
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks)
    return reasoning, "".join(c.choices[0].delta.content or "" for c in chunks), chunks


# -- HTTP ------------------------------------------------------------------------------------

def test_http_reasoning_content_apart_from_the_answer(server) -> None:
    r = chat(server, max_tokens=32, response_format=FORCED)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == (
        "Let me think.", "Paris.", "stop")
    status, raw = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 32,
                                                        "temperature": 0,
                                                        "response_format": FORCED})
    assert status == 200 and set(raw["choices"][0]) == {"index", "finish_reason", "message",
                                                        "logprobs"}
    assert raw["choices"][0]["message"] == {"role": "assistant", "content": "Paris.",
                                            "reasoning_content": "Let me think."}
    reasoning, content, chunks = streamed(chat(server, max_tokens=32, response_format=FORCED,
                                               stream=True))
    assert (reasoning, content) == ("Let me think.", "Paris.")
    thinking = [i for i, c in enumerate(chunks) if getattr(c.choices[0].delta,
                                                           "reasoning_content", None)]
    answering = [i for i, c in enumerate(chunks) if c.choices[0].delta.content]
    assert len(thinking) > 1 and max(thinking) < min(answering)  # streamed, thinking first
    assert chunks[-1].choices[0].finish_reason == "stop"
    # the constrained request rendered its prompt without thinking
    plain = chat(server, max_tokens=2, extra_body={"enable_thinking": False})
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens


def test_http_output_that_never_closes_its_thinking_is_all_reasoning(server) -> None:
    status, tok = post(server, "/tokenize", {"messages": ASK, "add_generation_prompt": True})
    assert status == 200
    raw = client(server).completions.create(model="smollm2-135m", prompt=tok["tokens"],
                                            max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
    r = chat(server, max_tokens=12, extra_body={"ignore_eos": True})
    m = r.choices[0].message
    assert r.usage.prompt_tokens == tok["count"] and r.usage.completion_tokens == 12
    assert (m.reasoning_content, m.content) == (split(raw.choices[0].text, True)[0], "")
    assert m.reasoning_content and r.choices[0].finish_reason == "length"
    reasoning, content, chunks = streamed(chat(server, max_tokens=12, stream=True,
                                               extra_body={"ignore_eos": True}))
    assert (reasoning, content) == (m.reasoning_content, "")
    assert chunks[-1].choices[0].finish_reason == "length"


def test_enable_thinking_and_chat_template_kwargs_reach_the_template(server) -> None:
    on = chat(server, max_tokens=6, extra_body={"ignore_eos": True})
    off = chat(server, max_tokens=6, extra_body={"ignore_eos": True, "enable_thinking": False})
    kw = chat(server, max_tokens=6, extra_body={"ignore_eos": True,
                                                "chat_template_kwargs": {"enable_thinking": False}})
    effort = chat(server, max_tokens=6, reasoning_effort="low", extra_body={"ignore_eos": True})
    assert off.usage.prompt_tokens == on.usage.prompt_tokens - 4  # "<think>\n": 4 tokens
    assert off.choices[0].message.content and off.choices[0].message.reasoning_content is None
    assert kw.choices[0].message == off.choices[0].message
    assert on.choices[0].message.content == "" and on.choices[0].message.reasoning_content
    assert effort.choices[0].message == on.choices[0].message  # accepted, ignored
    # /tokenize takes them too: the ids the chat endpoint fed the model
    status, tok = post(server, "/tokenize", {"messages": ASK, "chat_template_kwargs":
                                             {"enable_thinking": False}})
    assert status == 200 and tok["count"] == off.usage.prompt_tokens
    status, tok = post(server, "/tokenize", {"messages": ASK, "add_special_tokens": True,
                                             "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and tok["count"] == off.usage.prompt_tokens
    status, bad = post(server, "/tokenize", {"messages": ASK, "chat_template_kwargs": {"x": []}})
    assert status == 400 and "chat_template_kwargs.x" in bad["error"]["message"]


@pytest.mark.parametrize("path, body, says", [
    ("/v1/chat/completions", {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"x": {"y": 1}}}, "chat_template_kwargs.x"),
    ("/v1/chat/completions", {"max_reasoning_tokens": 0}, "max_reasoning_tokens"),
    ("/v1/chat/completions", {"enable_thinking": "no"}, "enable_thinking"),
    ("/v1/chat/completions", {"reasoning_effort": "max"}, "reasoning_effort"),
    ("/v1/completions", {"enable_thinking": False}, "/v1/chat/completions parameter"),
])
def test_bad_reasoning_fields_are_400(server, path: str, body: dict, says: str) -> None:
    base = ({"messages": ASK} if "chat" in path else {"prompt": "x"}) | {"max_tokens": 2}
    status, answer = post(server, path, base | body)
    assert status == 400 and answer["error"]["code"] == "invalid_request"
    assert says in answer["error"]["message"]


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]


def test_tool_calls_are_parsed_from_the_answer_only(server) -> None:
    call = (r'<think>I will look it up\.</think><tool_call>\{"name": "get_weather", '
            r'"arguments": \{"city": "Paris"\}\}</tool_call>')
    r = chat(server, max_tokens=240, tools=TOOLS, response_format={"type": "regex", "regex": call})
    m, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls" and m.reasoning_content == "I will look it up."
    assert m.content is None and m.tool_calls[0].function.name == "get_weather"
    assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris"}
    reasoning, content, chunks = streamed(chat(server, max_tokens=240, tools=TOOLS, stream=True,
                                               response_format={"type": "regex", "regex": call}))
    assert (reasoning, content) == ("I will look it up.", "")
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert calls[0][0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # a call written inside the thinking is thinking, not a call
    inside = (r'<think><tool_call>\{"name": "get_weather", "arguments": \{\}\}</tool_call>'
              r'</think>Sunny\.')
    r = chat(server, max_tokens=240, tools=TOOLS, response_format={"type": "regex", "regex": inside})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and not m.tool_calls and m.content == "Sunny."
    assert m.reasoning_content.startswith("<tool_call>")


async def _raw(server, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    """A prompt's greedy token ids and text, unsplit (a socket request by token ids)."""
    ws, c = await open_client(server)
    async with ws:
        await c.send({"type": "generate", "id": "raw", "prompt_token_ids": prompt,
                      "params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
        msgs = await c.until_done({"raw"})
    deltas = [m for m in msgs if m["type"] == "delta"]
    return sum((d["token_ids"] for d in deltas), []), "".join(d["text"] for d in deltas)


# the close of this template's thinking (it shows no thinking in its turns: the default)
CLOSE_TEXT = "\n</think>\n\n"
BUDGET, MAX = 4, 40


async def _forced(server) -> tuple[list[int], str, str]:
    """What the budget must give for ASK: the first BUDGET tokens of its thinking, the
    close, then the model's continuation of all that; as (token ids, reasoning, content)."""
    status, tok = post(server, "/tokenize", {"messages": ASK, "add_generation_prompt": True})
    assert status == 200
    close = server.engine.tokenizer.encode(CLOSE_TEXT, add_special_tokens=False)
    think, think_text = await _raw(server, tok["tokens"], BUDGET)
    answer, answer_text = await _raw(server, tok["tokens"] + think + close, MAX - BUDGET - len(close))
    reasoning, content = split(think_text + CLOSE_TEXT + answer_text, True)
    assert reasoning == split(think_text, True)[0] and content  # it answered
    return think + close + answer, reasoning, content


async def test_the_reasoning_budget_closes_the_thinking_and_the_model_answers(server) -> None:
    ids, reasoning, content = await _forced(server)
    extra = {"ignore_eos": True, "max_reasoning_tokens": BUDGET}
    r = chat(server, max_tokens=MAX, extra_body=extra)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == (reasoning, content)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX
    got_r, got_c, chunks = streamed(chat(server, max_tokens=MAX, stream=True, extra_body=extra))
    assert (got_r, got_c) == (reasoning, content)
    assert chunks[-1].choices[0].finish_reason == "length"
    # n = 2: each sample has its own budget (greedy: the same output twice)
    two = chat(server, max_tokens=MAX, n=2, extra_body=extra)
    assert [(c.message.reasoning_content, c.message.content) for c in two.choices] == [
        (reasoning, content)] * 2
    # a constrained request has no budget: its constraint writes its every token
    ok = chat(server, max_tokens=32, response_format=FORCED,
              extra_body={"max_reasoning_tokens": 2})
    assert (ok.choices[0].finish_reason, ok.choices[0].message.reasoning_content,
            ok.choices[0].message.content) == ("stop", "Let me think.", "Paris.")
    await wait_free(server)


def test_reasoning_parser_none_leaves_the_thinking_in_the_text(thinking_model) -> None:
    config = ServiceConfig(engine=EngineConfig(model=str(thinking_model), dtype="float32"),
                           reasoning_parser="none")
    with run_server(config) as s:
        r = chat(s, max_tokens=32, response_format=FORCED)
        m = r.choices[0].message
        assert m.content == "<think>Let me think.</think>\n\nParis."
        status, raw = post(s, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2})
        assert status == 200 and set(raw["choices"][0]) == {"index", "finish_reason", "message",
                                                            "logprobs"}
        assert set(raw["choices"][0]["message"]) == {"role", "content"}  # no reasoning field


# -- the socket ------------------------------------------------------------------------------

async def test_socket_deltas_carry_reasoning_beside_the_text(server) -> None:
    ws, c = await open_client(server)
    async with ws:
        assert "reasoning" in c.ready["features"]
        await c.send(gen("a", Q, max_tokens=32, response_format=FORCED))
        await c.send(gen("b", Q, max_tokens=32, n=2, response_format=FORCED))
        msgs = await c.until_done({"a", "b"})
    for rid in ("a", "b"):
        deltas = [m for m in msgs if m["type"] == "delta" and m["id"] == rid]
        for i in (0, 1) if rid == "b" else (0,):
            mine = [d for d in deltas if d.get("index", 0) == i]
            assert "".join(d.get("reasoning", "") for d in mine) == "Let me think."
            assert "".join(d["text"] for d in mine) == "Paris."
        done = [m for m in msgs if m["type"] == "done" and m["id"] == rid][0]
        assert done["finish_reason"] == "stop"


async def _full_reasoning(server, max_tokens: int) -> str:
    ws, c = await open_client(server)
    async with ws:
        await c.send(gen("whole", Q, max_tokens=max_tokens, ignore_eos=True))
        msgs = await c.until_done({"whole"})
    deltas = [m for m in msgs if m["type"] == "delta"]
    assert all(d["text"] == "" for d in deltas)
    return "".join(d.get("reasoning", "") for d in deltas)


async def test_resume_after_a_drop_replays_the_reasoning(server) -> None:
    want = await _full_reasoning(server, 40)
    ws, c = await open_client(server)
    sid = c.ready["session_id"]
    await c.send(gen("story", Q, max_tokens=40, ignore_eos=True))
    deltas: list[dict] = []
    while len(deltas) < 4:
        m = await c.recv()
        if m["type"] == "delta":
            deltas.append(m)
    await ws.close()
    await wait_free(server)  # parked
    ws, c = await open_client(server)
    async with ws:
        await c.send({"type": "resume", "id": "story", "after_seq": 2, "session_id": sid})
        msgs = await c.until_done({"story"})
    assert msgs[0] == {"type": "resumed", "id": "story", "after_seq": 2}
    more = [m for m in msgs if m["type"] == "delta"]
    assert more[0]["seq"] == 3 and more[0].get("reasoning")  # the lost ones, merged
    got = deltas[:2] + more
    assert "".join(d.get("reasoning", "") for d in got) == want
    assert "".join(d["text"] for d in got) == ""
    assert msgs[-1]["usage"]["completion_tokens"] == 40


async def test_a_continued_stream_goes_on_with_the_split_where_it_was(server) -> None:
    """A resume this server holds nothing for, carrying the request and its token ids:
    the continuation's reasoning picks up exactly after what the client had."""
    want = await _full_reasoning(server, 30)
    ws, c = await open_client(server)
    async with ws:
        await c.send(gen("first", Q, max_tokens=30, ignore_eos=True))
        msgs = await c.until_done({"first"})
        kept = [m for m in msgs if m["type"] == "delta"][:5]
        request = {k: v for k, v in gen("x", Q, max_tokens=30, ignore_eos=True).items()
                   if k not in ("type", "id")}
        await c.send({"type": "resume", "id": "again", "after_seq": 5,
                      "session_id": "0" * 32, "request": request,
                      "token_ids": sum((d["token_ids"] for d in kept), [])})
        more = await c.until_done({"again"})
    assert more[0] == {"type": "resumed", "id": "again", "after_seq": 5}
    deltas = [m for m in more if m["type"] == "delta"]
    assert deltas[0]["seq"] == 6
    got = kept + deltas
    assert "".join(d.get("reasoning", "") for d in got) == want


async def test_the_budget_over_the_socket(server) -> None:
    ids, reasoning, content = await _forced(server)
    ws, c = await open_client(server)
    async with ws:
        await c.send(gen("t", Q, max_tokens=MAX, ignore_eos=True, max_reasoning_tokens=BUDGET))
        msgs = await c.until_done({"t"})
    deltas = [m for m in msgs if m["type"] == "delta"]
    assert sum((d["token_ids"] for d in deltas), []) == ids
    assert "".join(d.get("reasoning", "") for d in deltas) == reasoning
    assert "".join(d["text"] for d in deltas) == content
    done = msgs[-1]
    assert (done["status"], done["finish_reason"], done["usage"]["completion_tokens"]) == (
        "completed", "length", MAX)
    await wait_free(server)


# -- the SDKs --------------------------------------------------------------------------------

async def test_python_sdk_exposes_the_reasoning(server) -> None:
    async with AsyncClient(server.ws_url) as c:
        whole = await c.chat.create(ASK, max_tokens=32, temperature=0.0, response_format=FORCED)
        assert (whole.reasoning, whole.text, whole.reasonings) == (
            "Let me think.", "Paris.", ["Let me think."])
        s = await c.chat.stream(ASK, max_tokens=32, temperature=0.0, response_format=FORCED)
        events = [ev async for ev in s]
        deltas = [ev for ev in events if isinstance(ev, DeltaEvent)]
        assert "".join(d.reasoning for d in deltas) == "Let me think."
        s = await c.chat.stream(ASK, max_tokens=32, temperature=0.0, response_format=FORCED)
        assert "".join([t async for t in s.text_stream()]) == "Paris."  # the answer only
    with Client(server.ws_url) as sync:
        plain = sync.chat.create(ASK, max_tokens=6, temperature=0.0, ignore_eos=True,
                                 enable_thinking=False)
        thinking = sync.chat.create(ASK, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert plain.reasoning == "" and plain.text
    assert thinking.text == "" and thinking.reasoning


def test_js_sdk_exposes_the_reasoning(server) -> None:
    node = shutil.which("node")
    assert node, "node is not installed"
    env = {**os.environ, "TIDEWIRE_THINKING_URL": server.ws_url}
    out = subprocess.run([node, "--test", "--test-reporter=spec", "test/reasoning.test.js"],
                         cwd=JS, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "pass 3" in out.stdout and "skipped 0" in out.stdout, out.stdout[-3000:]


# -- the chat page -----------------------------------------------------------------------------

# Every generate the page sends gets the constraint that writes a thought and an answer.
FORCE_IN_PAGE = """
const send = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) {
  if (typeof data === "string") {
    const m = JSON.parse(data);
    if (m.type === "generate") {
      m.params = { ...m.params, response_format: %s };
      data = JSON.stringify(m);
    }
  }
  return send.call(this, data);
};
""" % json.dumps(FORCED)


async def test_chat_page_shows_the_thinking_apart_and_collapsed(server) -> None:
    from tests.test_chat_page import ARTIFACTS, Page, browser

    async with browser() as b:
        page = await b.new_page()
        await page.add_init_script(FORCE_IN_PAGE)
        p = Page(page)
        await page.goto(f"{server.url}/")
        await page.wait_for_selector("#status[data-ready='1']", timeout=30_000)
        await page.fill("#max-tokens", "32")
        await page.fill("#input", Q)
        await page.press("#input", "Enter")
        done = ".msg.assistant[data-state='completed']"
        await page.wait_for_selector(done, timeout=60_000)
        thinking = page.locator(f"{done} details.thinking")
        assert await thinking.is_visible()
        assert not await thinking.evaluate("d => d.open")  # collapsed
        assert await page.text_content(f"{done} .thinking summary") == "Thoughts"
        assert not await page.is_visible(f"{done} .thinking .reasoning")
        assert (await page.text_content(f"{done} .body")).strip() == "Paris."
        await page.click(f"{done} .thinking summary")  # opened: the thoughts show
        assert await page.is_visible(f"{done} .thinking .reasoning")
        assert await page.text_content(f"{done} .thinking .reasoning") == "Let me think."
        await page.screenshot(path=str(ARTIFACTS / "chat-thinking.png"))
        await page.reload()  # kept with the conversation
        await page.wait_for_selector("#status[data-ready='1']", timeout=30_000)
        assert await page.text_content(f"{done} .thinking .reasoning") == "Let me think."
        assert (await page.text_content(f"{done} .body")).strip() == "Paris."
        p.check()


def test_anthropic_thinking_blocks_and_responses_reasoning_items(server) -> None:
    """The same split through the other APIs: Anthropic's `thinking` (enabled with a
    budget: the thinking closes after it and the model answers) gives a `thinking` block
    then a `text` block, whole and streamed alike; chat's reasoning_content and content
    are the same texts. A Responses answer starts with a `reasoning` item, counted in
    reasoning_tokens."""
    import anthropic

    c = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    ask = {"model": "smollm2-135m", "max_tokens": MAX, "messages": ASK,
           "thinking": {"type": "enabled", "budget_tokens": BUDGET},
           "extra_body": {"temperature": 0, "ignore_eos": True}}
    r = c.messages.create(**ask)
    assert [b.type for b in r.content] == ["thinking", "text"] and r.stop_reason == "max_tokens"
    thought, said = r.content[0].thinking, r.content[1].text
    want = chat(server, max_tokens=MAX, extra_body={"ignore_eos": True,
                                                    "max_reasoning_tokens": BUDGET})
    assert (thought, said) == (want.choices[0].message.reasoning_content,
                               want.choices[0].message.content)
    with c.messages.stream(**ask) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert kinds.index("text_delta") > kinds.index("thinking_delta") and "text_delta" in kinds
    assert (final.content[0].thinking, final.content[1].text) == (thought, said)
    resp = client(server).responses.create(model="smollm2-135m", input=Q, max_output_tokens=8,
                                           temperature=0)
    assert resp.output[0].type == "reasoning" and resp.output[0].content[0].text
    assert resp.usage.output_tokens_details.reasoning_tokens > 0

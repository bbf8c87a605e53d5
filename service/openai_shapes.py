"""OpenAI's response objects built from engine outputs: a finished request's choices,
the chunks of a stream (with tool calls and echoed prompts), logprobs in the chat and
the legacy shapes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from engine.outputs import CompletionOutput, RequestOutput
from service import tools as tool_calls
from service.completion_jobs import Job


def finish_of(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "stop", "error": "error"}.get(reason or "")


def _text(tok: Any, token_id: int) -> str:
    """A token's text ("" for a model without a tokenizer, whose outputs have none)."""
    return tok.decode([token_id]) if tok is not None else ""


def _token_lp(tok: Any, table: list[bytes] | None, token_id: int, logprob: float) -> dict[str, Any]:
    text = _text(tok, token_id)
    raw = table[token_id] if table is not None and token_id < len(table) else text.encode()
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def logprobs_of(out: RequestOutput, index: int, new: int, chat: bool, tok: Any,
                table: list[bytes] | None = None) -> Any:
    lps = out.outputs[index].logprobs
    if lps is None:
        return None
    lps = lps[-new:] if new else []
    if chat:
        return {"content": [{**_token_lp(tok, table, x.token_id, x.logprob),
                             "top_logprobs": [_token_lp(tok, table, t, v) for t, v in x.top]}
                            for x in lps]}
    return {"tokens": [_text(tok, x.token_id) for x in lps],
            "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{_text(tok, t): v for t, v in x.top} for x in lps]}


def _prompt_logprobs(job: Job, tok: Any) -> dict[str, list[Any]]:
    """Legacy logprobs of an echoed prompt: its tokens' text; the engine computes no
    prompt logprobs, so their values are null (OpenAI's first prompt token's are too)."""
    ids = job.adm.stream.output.prompt_token_ids
    return {"tokens": [_text(tok, t) for t in ids], "token_logprobs": [None] * len(ids),
            "top_logprobs": [None] * len(ids)}


def choice(job: Job, o: CompletionOutput, chat: bool, tok: Any,
           table: list[bytes] | None, tools: tool_calls.Tools | None = None) -> dict[str, Any]:
    """One sample of a finished request, in the non-streaming response."""
    assert job.last is not None
    c: dict[str, Any] = {"index": job.base + o.index, "finish_reason": finish_of(o.finish_reason)}
    lp = logprobs_of(job.last, o.index, len(o.token_ids), chat, tok, table)
    text, reasoning = o.text, None
    if job.think is not None:  # a thinking model's: the answer, and the thinking apart
        said = job.think.samples[o.index]
        said.close()
        text, reasoning = said.content, said.reasoning or None
    if chat and tools is not None:
        calls = tools.stream()
        calls.push(text)
        calls.finish()
        c["message"] = calls.message()
        if calls.found_calls and o.finish_reason == "stop":
            c["finish_reason"] = "tool_calls"
    elif chat:
        c["message"] = {"role": "assistant", "content": text}
    elif job.echo is not None:
        c["text"] = job.echo + o.text
        if lp is not None:
            lp = {k: v + lp[k] for k, v in _prompt_logprobs(job, tok).items()}
    else:
        c["text"] = o.text
    if chat and job.think is not None:
        c["message"]["reasoning_content"] = reasoning
    c["logprobs"] = lp
    return c


def chunk(meta: dict[str, Any], chat: bool, choices: list[dict[str, Any]],
          usage: dict[str, Any] | None = None) -> str:
    obj = {**meta, "object": "chat.completion.chunk" if chat else "text_completion",
           "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def chat_delta(text: str, reasoning: str) -> dict[str, Any]:
    """A chat chunk's delta: its content (always there without reasoning, as before a
    model thought) and its reasoning_content (when there is some)."""
    if not reasoning:
        return {"content": text}
    return {"reasoning_content": reasoning, **({"content": text} if text else {})}


def tool_chunks(meta: dict[str, Any], streams: dict[tuple[int, int], tool_calls.CallStream],
                job: Job, index: int, text: str, finished: bool,
                tools: tool_calls.Tools) -> Iterator[str]:
    """Sample `index`'s new text (its content, for a thinking model) as content and
    tool-call chunks (its CallStream's), the stream's remainder too once it is done."""
    key = (job.base, index)
    calls = streams.get(key)
    if calls is None:
        calls = streams[key] = tools.stream()
    deltas = calls.push(text)
    if finished:
        deltas += calls.finish()
    for d in deltas:
        yield chunk(meta, True, [{"index": job.base + index, "delta": d,
                                  "finish_reason": None}])


def echo_chunks(meta: dict[str, Any], jobs: list[Job], tok: Any) -> Iterator[str]:
    """Streaming `echo`: each choice's prompt text comes first, in a chunk of its own."""
    for job in jobs:
        if job.echo is None:
            continue
        lp = _prompt_logprobs(job, tok) if job.logprobs else None
        for i in range(len(job.adm.stream.output.outputs)):
            yield chunk(meta, False, [{"index": job.base + i, "text": job.echo,
                                       "logprobs": lp, "finish_reason": None}])

"""engine/prepare.py: waiting for a request's constraint to compile, over a fake
compiler whose futures the test resolves."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

import pytest

from engine.prepare import format_ready, format_started, prepare
from engine.sampling_params import SamplingParams
from engine.structured import GrammarError, ResponseFormat

FMT = ResponseFormat("regex", "[ab]+")
CONSTRAINED = SamplingParams(max_tokens=4, response_format=FMT)


class FakeCompiler:
    def __init__(self, timeout: float = 5.0) -> None:
        self.timeout = timeout
        self.futures: dict[ResponseFormat, Future[Any]] = {}
        self.released: list[ResponseFormat] = []

    def submit(self, fmt: ResponseFormat) -> Future[Any]:
        return self.futures.setdefault(fmt, Future())

    def peek(self, fmt: ResponseFormat) -> Future[Any] | None:
        return self.futures.get(fmt)

    def release(self, fmt: ResponseFormat) -> None:
        self.released.append(fmt)


def test_an_unconstrained_request_is_ready_and_needs_no_compiler() -> None:
    plain = SamplingParams(max_tokens=4)
    assert format_ready(None, plain) and not format_started(None, plain)
    asyncio.run(prepare(None, plain))
    with pytest.raises(ValueError, match="needs a model with a tokenizer"):
        format_ready(None, CONSTRAINED)
    with pytest.raises(ValueError, match="needs a model with a tokenizer"):
        asyncio.run(prepare(None, CONSTRAINED))


def test_ready_and_started_follow_the_compile_and_start_nothing() -> None:
    g = FakeCompiler()
    assert not format_ready(g, CONSTRAINED) and not format_started(g, CONSTRAINED)
    assert g.futures == {}  # peeking starts no compile
    fut = g.submit(FMT)
    assert format_started(g, CONSTRAINED) and not format_ready(g, CONSTRAINED)
    fut.set_result("compiled")
    assert format_ready(g, CONSTRAINED)
    failed = FakeCompiler()
    failed.submit(FMT).set_exception(ValueError("bad regex"))
    with pytest.raises(ValueError, match="bad regex"):
        format_ready(failed, CONSTRAINED)


async def test_prepare_waits_for_the_compile() -> None:
    g = FakeCompiler()
    task = asyncio.create_task(prepare(g, CONSTRAINED))
    await asyncio.sleep(0.01)
    assert not task.done()
    g.futures[FMT].set_result("compiled")
    await asyncio.wait_for(task, 5)
    assert g.released == []


async def test_a_compile_past_the_timeout_is_released_and_refused() -> None:
    g = FakeCompiler(timeout=0.01)
    with pytest.raises(GrammarError, match="took over 0.01s to compile"):
        await prepare(g, CONSTRAINED)
    assert g.released == [FMT]


async def test_a_caller_that_leaves_releases_the_compile() -> None:
    g = FakeCompiler()
    task = asyncio.create_task(prepare(g, CONSTRAINED))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert g.released == [FMT] and not g.futures[FMT].cancelled()


async def test_a_compile_cancelled_under_a_waiter_is_a_request_error() -> None:
    g = FakeCompiler()
    task = asyncio.create_task(prepare(g, CONSTRAINED))
    await asyncio.sleep(0.01)
    g.futures[FMT].cancel()  # (GrammarCompiler.release by another waiter)
    with pytest.raises(GrammarError, match="compile was cancelled; send the request again"):
        await asyncio.wait_for(task, 5)
    assert g.released == [FMT]

"""The engine's constraint bookkeeping (engine/constraints.py), with stand-in futures
and matchers: the compile queue's order and releases, and how a matcher ends a sample."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from engine.constraints import CompileQueue, advance_matcher
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.structured import ResponseFormat

FMT = ResponseFormat.parse({"type": "json_object"})


class Grammars:
    """Records the formats released (GrammarCompiler.release)."""

    def __init__(self) -> None:
        self.released: list[Any] = []

    def release(self, fmt: Any) -> None:
        self.released.append(fmt)


def constrained(rid: str) -> Request:
    r = Request(rid, [1], SamplingParams(response_format=FMT))
    r.grammar = Future()
    return r


def test_take_done_keeps_order_and_releases_failed_compiles() -> None:
    g = Grammars()
    q = CompileQueue(g)  # type: ignore[arg-type]
    a, b, c, d = (constrained(x) for x in "abcd")
    for r in (a, b, c, d):
        q.add(r)
    a.grammar.set_exception(ValueError("bad schema"))
    b.grammar.set_result("compiled")
    d.grammar.cancel()
    assert q.take_done() == [(a, False), (b, True), (d, False)]
    assert g.released == [FMT, FMT] and c in q and a not in q and bool(q)
    c.grammar.set_result("compiled")
    assert q.take_done() == [(c, True)] and not q


def test_remove_takes_a_requests_samples_and_releases_its_compile_once() -> None:
    g = Grammars()
    q = CompileQueue(g)  # type: ignore[arg-type]
    a, b = constrained("a"), constrained("b")
    q.add(a)
    q.add(b)
    assert q.remove("a") == [a] and g.released == [FMT]
    assert q.remove("a") == [] and g.released == [FMT]
    assert b in q


class Matcher:
    """Accepts tokens below `limit`; terminated once it accepted `end`."""

    def __init__(self, limit: int = 100, end: int | None = None) -> None:
        self.limit, self.end, self.terminated = limit, end, False

    def accept(self, t: int) -> bool:
        if t >= self.limit:
            return False
        self.terminated = t == self.end
        return True


def sample(tokens: list[int], new: int, matcher: Matcher) -> Request:
    r = Request("a", [1], SamplingParams(max_tokens=10))
    r.output_token_ids, r.num_new_tokens_last, r.matcher = tokens, new, matcher
    r.status = RequestStatus.RUNNING
    return r


def test_a_matcher_that_accepts_everything_changes_nothing() -> None:
    r = sample([5, 6, 7], 2, Matcher())
    assert advance_matcher(r) is None and r.output_token_ids == [5, 6, 7]


def test_the_constraints_end_stops_a_running_sample_and_drops_what_came_after() -> None:
    r = sample([5, 6, 7, 8], 3, Matcher(end=6))
    assert advance_matcher(r) is RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [5, 6] and r.num_new_tokens_last == 1
    r = sample([5, 6], 1, Matcher(end=6))
    r.status = RequestStatus.FINISHED_STOPPED  # its stop token ended it already
    assert advance_matcher(r) is None


def test_a_token_that_breaks_the_constraint_is_an_error() -> None:
    r = sample([5, 200, 7], 2, Matcher())
    assert advance_matcher(r) is RequestStatus.FINISHED_ERROR
    assert r.output_token_ids == [5, 200]

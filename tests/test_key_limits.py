"""service/key_limits.py: per-key counts and their limits, and the token budget check."""

from __future__ import annotations

import pytest

from service.config import Limits
from service.key_limits import KeyCounts, check_budget
from service.protocol import ProtocolError
from service.ratelimit import TokenBudget


def refused(fn, *args) -> str:  # noqa: ANN001
    with pytest.raises(ProtocolError) as e:
        fn(*args)
    return e.value.message


def test_counts_drop_a_key_at_zero() -> None:
    c = KeyCounts(Limits())
    c.add("k", 2)
    c.add("k", 1, c.sessions)
    assert c.inflight == {"k": 2} and c.sessions == {"k": 1} and c.compiling == {}
    c.add("k", -2)
    c.add("k", -1, c.sessions)
    assert c.inflight == {} and c.sessions == {}


def test_a_key_at_its_limits_is_refused_and_the_open_servers_caller_never() -> None:
    c = KeyCounts(Limits(max_inflight_per_key=2, max_compiles_per_key=1))
    c.add("k", 1)
    c.add("k", 1, c.compiling)
    c.check("k", "r1")  # one more request may start, but not one more compile
    assert "constraints compiling" in refused(c.check, "k", "r1", True)
    c.add("k", 1)
    assert "too many requests" in refused(c.check, "k", "r1")
    c.add(None, 100)
    c.add(None, 100, c.compiling)
    c.check(None, "r1", True)


def test_check_budget_refuses_a_reservation_the_bucket_does_not_hold() -> None:
    now = [0.0]
    budget = TokenBudget(600, clock=lambda: now[0])  # 10 tokens a second
    check_budget(budget, "k", 600, "r1")
    budget.charge("k", 500)
    with pytest.raises(ProtocolError) as e:
        check_budget(budget, "k", 200, "r1")
    assert e.value.code == "rate_limited" and e.value.request_id == "r1"
    assert e.value.retry_after == pytest.approx(10.0)
    now[0] = 10.0
    check_budget(budget, "k", 200, "r1")

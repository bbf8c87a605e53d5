"""What one API key may have at once, counted per key: requests in flight (admitted, or
held while they are prepared), constraints compiling, open sockets; and the check of a
request's reservation against its key's tokens-per-minute budget (service.ratelimit).
An open server's one anonymous caller (key None) is held to no per-key limit."""

from __future__ import annotations

from service.config import Limits
from service.protocol import ProtocolError
from service.ratelimit import TokenBudget


class KeyCounts:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.inflight: dict[str | None, int] = {}  # admitted or held requests
        self.compiling: dict[str | None, int] = {}  # held requests whose constraint compiles
        self.sessions: dict[str | None, int] = {}  # open sockets

    def check(self, key: str | None, request_id: str | None, compiling: bool = False) -> None:
        """Raise too_many_inflight if the key may not start one more request (one more
        compiling constraint, with `compiling`)."""
        lim = self.limits
        if key is None:
            return
        if self.inflight.get(key, 0) >= lim.max_inflight_per_key:
            raise ProtocolError("too_many_inflight", "too many requests in flight for this key",
                                request_id)
        if compiling and self.compiling.get(key, 0) >= lim.max_compiles_per_key:
            raise ProtocolError("too_many_inflight", "this key has "
                                f"{lim.max_compiles_per_key} constraints compiling already",
                                request_id)

    def add(self, key: str | None, n: int, counts: dict[str | None, int] | None = None) -> None:
        """Add n to the key's count in `counts` (its requests in flight by default); a
        count that reaches 0 is dropped, so only keys in use take memory."""
        counts = self.inflight if counts is None else counts
        left = counts.get(key, 0) + n
        if left:
            counts[key] = left
        else:
            counts.pop(key, None)


def check_budget(budget: TokenBudget, key: str, reserve: int, request_id: str | None) -> None:
    """Raise rate_limited (with its retry_after) if the key's budget does not hold the
    `reserve` tokens a request may use now."""
    wait = budget.retry_after(key, reserve)
    if wait > 0:
        raise ProtocolError(
            "rate_limited", f"this key's budget of {int(budget.capacity)} tokens a "
            f"minute does not hold this request's {reserve} (prompt + n x max_tokens) "
            f"now; retry in {wait:.1f}s", request_id, retry_after=wait)

"""The one path from a client request to the engine, shared by the WebSocket and the
OpenAI-compatible endpoints: auth, tenancy, limits, prompt building, metrics."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import time
import uuid
from dataclasses import dataclass
from collections.abc import AsyncIterator, Sequence
from typing import Any

from engine import AsyncEngine, PromptTooLongError, SamplingParams
from engine.async_engine import RequestStream
from service.config import ServiceConfig
from service.metrics import Metrics
from service.protocol import AUTH_PREFIX, ProtocolError
from service.ratelimit import TokenBudget
from service.resume import ParkedRequests


@dataclass
class Principal:
    """Who is calling: the API key's tenant (\"\" when the server is open)."""

    key: str | None
    tenant: str

    @property
    def salt(self) -> bytes:
        """Seeds the prefix-cache hash chain: tenants never share cached blocks."""
        return hashlib.sha256(b"tidewire.tenant:" + self.tenant.encode()).digest() if self.tenant else b""


@dataclass(slots=True, eq=False)
class Admission:
    stream: RequestStream
    arrival: float
    principal: Principal
    # set when the server ends the request itself (shutdown): what its client is told
    failure: ProtocolError | None = None


class Gateway:
    def __init__(self, config: ServiceConfig, engine: AsyncEngine, metrics: Metrics) -> None:
        self.config, self.engine, self.metrics = config, engine, metrics
        # API keys by their SHA-256: a presented key is looked up by its digest, so how
        # long a lookup takes says nothing about the keys' characters
        self._keys = {_digest(k): (k, tenant) for k, tenant in config.api_keys.items()}
        self.inflight_total = 0
        self.inflight_by_key: dict[str | None, int] = {}
        tpm = config.limits.max_tokens_per_minute_per_key
        self.token_budget = TokenBudget(tpm) if tpm > 0 and config.api_keys else None
        self.accepting = True
        self.sessions: set = set()  # open WebSocket sessions (service.session.Session)
        self.http_inflight: set[Admission] = set()  # requests of the HTTP endpoints
        self._by_id: dict[str, Any] = {}  # the same, by session id
        # requests of dropped sockets, parked for a resume (service/resume.py)
        self.parked = ParkedRequests(config.limits, engine, metrics,
                                     lambda live: self.release(live.adm, "abort"))
        # Per-delta metrics, recorded after a step's fan-out rather than in front of the
        # next socket (see log_tokens / log_delivery).
        self._token_log: list[tuple[bool, float, int]] = []
        self._delivery_log: list[float] = []
        self._sse_delivery_log: list[float] = []
        # filled into every request's unset sampling fields (ServiceConfig.sampling_defaults)
        self.sampling_defaults: dict[str, float] = (
            engine.sampling_defaults if config.sampling_defaults == "model" else {})

    # -- auth ------------------------------------------------------------------------------

    def open_session(self, session_id: str) -> Any:
        """The open WebSocket session with this id, if any (service.session.Session)."""
        return self._by_id.get(session_id)

    def add_session(self, session: Any) -> None:
        self.sessions.add(session)
        self._by_id[session.session_id] = session

    def remove_session(self, session: Any) -> None:
        self.sessions.discard(session)
        self._by_id.pop(session.session_id, None)

    def authenticate(self, authorization: str | None,
                     subprotocols: Sequence[str] = ()) -> Principal:
        """Bearer header, or the browser subprotocol tidewire.auth.<base64url key>."""
        keys = self.config.api_keys
        if not keys:
            return Principal(None, "")
        key = None
        if authorization and authorization.lower().startswith("bearer "):
            key = authorization[7:].strip()
        for sp in subprotocols:
            if sp.startswith(AUTH_PREFIX):
                key = _b64url(sp[len(AUTH_PREFIX):]) or key
        found = self._keys.get(_digest(key or ""))
        # (compare_digest as well: equal digests of unequal keys are not a concern in
        # practice, but the comparison costs the same either way)
        if key is None or found is None or not hmac.compare_digest(found[0].encode(),
                                                                   key.encode()):
            raise ProtocolError("unauthorized", "missing or invalid API key")
        return Principal(found[0], found[1])

    # -- requests --------------------------------------------------------------------------

    def submit(self, principal: Principal, params: SamplingParams, request_id: str | None = None,
               prompt: str | list[int] | None = None,
               messages: list[dict[str, Any]] | None = None, warm: bool = False,
               tools: list[dict[str, Any]] | None = None,
               output_token_ids: Sequence[int] = ()) -> Admission:
        """Admit a request or raise ProtocolError (overloaded, invalid, too long...).
        `output_token_ids`: a stream continued here from the tokens its client received
        (a resume of a request this server does not hold)."""
        lim = self.config.limits
        if not self.accepting:
            raise ProtocolError("overloaded", "server is shutting down", request_id)
        if (principal.key is not None  # an open server's one anonymous caller: no key limit
                and self.inflight_by_key.get(principal.key, 0) >= lim.max_inflight_per_key):
            raise ProtocolError("too_many_inflight", "too many requests in flight for this key",
                                request_id)
        budget = self.token_budget
        if budget is not None and principal.key is not None:
            wait = budget.retry_after(principal.key)
            if wait > 0:
                raise ProtocolError(
                    "rate_limited", f"this key used its {int(budget.capacity)} tokens a minute; "
                    f"retry in {wait:.1f}s", request_id, retry_after=wait)
        queued = self.engine.queued()
        if queued >= lim.max_queue:
            raise ProtocolError("overloaded", f"{queued} requests already waiting", request_id)
        rid = request_id or uuid.uuid4().hex
        ids = self._prompt_ids(prompt, messages, rid, not warm, tools)
        try:
            stream = self.engine.add_request(ids, params, self._engine_id(principal, rid),
                                             principal.salt, output_token_ids)
        except PromptTooLongError as e:
            raise ProtocolError("context_length_exceeded", str(e), request_id) from None
        except ValueError as e:
            raise ProtocolError("invalid_request", str(e), request_id) from None
        except RuntimeError as e:
            raise ProtocolError("internal_error", str(e), request_id) from None
        self.inflight_total += 1
        self.inflight_by_key[principal.key] = self.inflight_by_key.get(principal.key, 0) + 1
        n_prompt = len(stream.output.prompt_token_ids)
        self.metrics.prompt_tokens.inc(n_prompt)
        if budget is not None and principal.key is not None:
            budget.charge(principal.key, n_prompt)
        return Admission(stream, time.monotonic(), principal)

    def queue_position(self) -> int | None:
        """Requests ahead of a new one when it will not be admitted at once, else None
        (from the engine's last published stats and the requests sent since)."""
        st = self.engine.stats
        pending = self.engine.queued() - st.waiting  # sent, not yet seen by the engine
        if st.waiting:  # the last step left requests waiting: all these are ahead
            return st.waiting + pending
        if st.running + pending >= st.max_num_seqs:  # the batch is full, or will be
            return st.running + pending - st.max_num_seqs
        return None

    @staticmethod
    def _engine_id(principal: Principal, rid: str) -> str:
        """Engine-wide unique id (client ids are only unique per connection)."""
        return f"{uuid.uuid4().hex}:{rid}"

    async def warm(self, principal: Principal, request_id: str | None,
                   prompt: str | list[int] | None,
                   messages: list[dict[str, str]] | None) -> dict[str, Any]:
        """Prefill a prefix into the cache without generating (one throwaway token is
        sampled). Messages are rendered without the generation prompt: that rendering
        is the prefix the next turn's prompt starts with."""
        last = None
        async with self.admit(principal, SamplingParams(max_tokens=1, temperature=0.0),
                              request_id, prompt, messages, warm=True) as adm:
            async for last in adm.stream:  # noqa: B007 - the last output is what we want
                pass
        if last is None or last.finish_reason == "error":
            raise ProtocolError("internal_error", "warming the prefix failed", request_id)
        n = len(last.prompt_token_ids)
        bs = self.engine.block_size
        return {"prompt_tokens": n,
                "cached_tokens": n // bs * bs if self.engine.prefix_caching else 0,
                "reused_tokens": {"device": last.num_cached_tokens - last.num_host_cached_tokens,
                                  "host": last.num_host_cached_tokens}}

    def _prompt_ids(self, prompt: str | list[int] | None, messages: list[dict[str, Any]] | None,
                    rid: str, generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        eng = self.engine
        try:
            if messages is not None:
                return eng.apply_chat_template(messages, generation_prompt, tools)
            assert prompt is not None
            return eng.tokenize(prompt)
        except (ValueError, TypeError) as e:
            raise ProtocolError("invalid_request", str(e), rid) from None
        except Exception as e:  # noqa: BLE001 - a template error is the client's input
            raise ProtocolError("invalid_request", f"cannot apply the chat template: {e}",
                                rid) from None

    # -- per-delta metrics: one list append on the fan-out path, observed afterwards ----

    def log_tokens(self, first: bool, gap: float, n: int) -> None:
        """n tokens went out: `gap` is the time to first token (first) or since the
        previous delta."""
        self._flush_soon()
        self._token_log.append((first, gap, n))

    def log_delivery(self, seconds: float) -> None:
        """A delta was written `seconds` after its oldest token was sampled."""
        self._flush_soon()
        self._delivery_log.append(seconds)

    def log_sse_delivery(self, seconds: float) -> None:
        """An OpenAI streaming chunk was written `seconds` after its oldest token was
        sampled."""
        self._flush_soon()
        self._sse_delivery_log.append(seconds)

    def _flush_soon(self) -> None:
        if not (self._token_log or self._delivery_log or self._sse_delivery_log):
            asyncio.get_running_loop().call_soon(self._flush_logs)  # the first since a flush

    def _flush_logs(self) -> None:
        tokens, self._token_log = self._token_log, []
        delivery, self._delivery_log = self._delivery_log, []
        sse, self._sse_delivery_log = self._sse_delivery_log, []
        m = self.metrics
        ttft, itl, out = m.ttft.observe, m.itl.observe, m.output_tokens.inc
        for first, gap, n in tokens:
            (ttft if first else itl)(gap)
            out(n)
        for seconds in delivery:
            m.delivery.observe(seconds)
        for seconds in sse:
            m.sse_delivery.observe(seconds)

    @contextlib.asynccontextmanager
    async def admit(self, principal: Principal, params: SamplingParams,
                    request_id: str | None = None, prompt: str | list[int] | None = None,
                    messages: list[dict[str, str]] | None = None,
                    warm: bool = False) -> AsyncIterator[Admission]:
        """`submit`, and `end` when the block exits, however it exits."""
        adm = self.submit(principal, params, request_id, prompt, messages, warm)
        try:
            yield adm
        finally:
            self.end(adm)

    def fail_http(self, error: ProtocolError) -> None:
        """End every HTTP request still in flight with `error` (the end of a shutdown's
        grace): a stream gets it as an error event, a whole response as its body."""
        for adm in list(self.http_inflight):
            adm.failure = error
            if not adm.stream.finished:
                self.engine.abort(adm.stream.request_id)

    def end(self, adm: Admission, finish_reason: str | None = None) -> None:
        """The end of a request, whatever the way: abort it if it still runs (its reason
        is then abort), then release. `finish_reason`: the stream's own by default."""
        if not adm.stream.finished:
            self.engine.abort(adm.stream.request_id)
            finish_reason = "abort"
        elif finish_reason is None:
            finish_reason = adm.stream.output.finish_reason or "error"
        self.release(adm, finish_reason)

    def release(self, adm: Admission, finish_reason: str | None) -> None:
        """Bookkeeping when a request ends, whatever the way."""
        self.inflight_total -= 1
        key = adm.principal.key
        self.inflight_by_key[key] -= 1
        if not self.inflight_by_key[key]:
            del self.inflight_by_key[key]
        if self.token_budget is not None and key is not None:  # what it generated
            self.token_budget.charge(key, sum(len(o.token_ids) for o in adm.stream.output.outputs))
        self.metrics.requests.labels(finish_reason or "unknown").inc()
        self.metrics.e2e.observe(time.monotonic() - adm.arrival)
        self.metrics.observe_spec(adm.stream.output.spec)
        if adm.stream.sampled_at:  # it was admitted: its wait for a batch slot is known
            self.metrics.queue.observe(adm.stream.queue_time)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _b64url(text: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None

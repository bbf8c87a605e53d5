"""The one path from a client request to the engine, shared by the WebSocket and the
OpenAI-compatible endpoints: who is calling, admission and the end of a request. The
Gateway holds the parts that do the rest: API keys (service.keys), per-key counts
(service.key_limits), prompt tokenizing (service.tokenizing) and batched per-delta
metrics (service.delta_log)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine import AsyncEngine, PromptTooLongError, SamplingParams
from engine.request_stream import RequestStream
from service.config import ServiceConfig
from service.delta_log import DeltaLog
from service.key_limits import KeyCounts, check_budget
from service.keys import ApiKeys
from service.metrics import Metrics
from service.protocol import ProtocolError
from service.ratelimit import TokenBudget
from service.reasoning import ThinkPolicy
from service.resume import ParkedRequests
from service.tokenizing import PromptTokenizer


@dataclass
class Principal:
    """Who is calling: the API key's tenant (\"\" when the server is open)."""

    key: str | None
    tenant: str
    salt_key: bytes | None = field(default=None, repr=False)  # TierConfig.salt_key

    @property
    def salt(self) -> bytes:
        """Seeds the prefix-cache hash chain: tenants never share cached blocks. With the
        kv tier secret's salt key it is an HMAC of the tenant (the open server's "" too),
        so block keys in Redis cannot be computed from a guessed prompt; without it, a
        plain hash (b"" for the open server), as before the secret existed."""
        if self.salt_key:
            return hmac.new(self.salt_key, b"tenant:" + self.tenant.encode(),
                            hashlib.sha256).digest()
        return hashlib.sha256(b"tidewire.tenant:" + self.tenant.encode()).digest() if self.tenant else b""


@dataclass(slots=True, eq=False)
class Admission:
    stream: RequestStream
    arrival: float
    principal: Principal
    # set when the server ends the request itself (shutdown): what its client is told
    failure: ProtocolError | None = None
    reserved: int = 0  # tokens taken from its key's budget at admission (service.ratelimit)


@dataclass(slots=True, eq=False)
class Hold:
    """A request being prepared before admission (its constraint compiling, its large
    prompt tokenizing off the event loop): it counts as in flight for its key from the
    start, so preparing work is bounded like running work. `submit(hold=...)` hands it
    to the admission; `unhold` releases one that was not admitted (idempotent)."""

    principal: Principal
    compiling: bool  # counts toward the key's compile limit (Limits.max_compiles_per_key)
    active: bool = True


class Gateway:
    """Admits requests and ends them; the service's state shared across sockets and
    HTTP requests (sessions, counts, parked requests) lives here."""

    def __init__(self, config: ServiceConfig, engine: AsyncEngine, metrics: Metrics) -> None:
        self.config, self.engine, self.metrics = config, engine, metrics
        self._keys = ApiKeys(config.api_keys)
        self._salt_key = config.engine.tier.salt_key  # the same secret as the blocks' MAC
        self.inflight_total = 0
        self.counts = KeyCounts(config.limits)
        # the per-key counts, by API key (the same dicts as self.counts')
        self.inflight_by_key = self.counts.inflight
        self.compiling_by_key = self.counts.compiling
        self.sessions_by_key = self.counts.sessions
        tpm = config.limits.max_tokens_per_minute_per_key
        self.token_budget = TokenBudget(tpm) if tpm > 0 and config.api_keys else None
        self.prompts = PromptTokenizer(engine)
        # (the sessions and endpoints call these by the Gateway's names)
        self.off_loop = self.prompts.off_loop
        self.prompt_ids = self.prompts.prompt_ids
        self.off_the_loop = self.prompts.off_the_loop
        # per-delta metrics, recorded after a step's fan-out rather than in front of the
        # next socket
        self.deltas = DeltaLog(metrics)
        self.log_tokens = self.deltas.log_tokens
        self.log_delivery = self.deltas.log_delivery
        self.log_sse_delivery = self.deltas.log_sse_delivery
        self.accepting = True
        self.sessions: set = set()  # open WebSocket sessions (service.session.Session)
        self.http_inflight: set[Admission] = set()  # requests of the HTTP endpoints
        self._by_id: dict[str, Any] = {}  # the same, by session id
        # requests of dropped sockets, parked for a resume (service/resume.py)
        self.parked = ParkedRequests(config.limits, engine, metrics,
                                     lambda live: self.release(live.adm, "abort"))
        # filled into every request's unset sampling fields (ServiceConfig.sampling_defaults)
        self.sampling_defaults: dict[str, float] = (
            engine.sampling_defaults if config.sampling_defaults == "model" else {})
        # whether chat outputs are split into reasoning and content (service.reasoning)
        self.think = ThinkPolicy(config.reasoning_parser, getattr(engine, "tokenizer", None))

    # -- sessions and auth -----------------------------------------------------------------

    def open_session(self, session_id: str) -> Any:
        """The open WebSocket session with this id, if any (service.session.Session)."""
        return self._by_id.get(session_id)

    def add_session(self, session: Any) -> None:
        self.sessions.add(session)
        self._by_id[session.session_id] = session
        self.counts.add(session.principal.key, 1, self.sessions_by_key)

    def remove_session(self, session: Any) -> None:
        if session in self.sessions:
            self.sessions.discard(session)
            self.counts.add(session.principal.key, -1, self.sessions_by_key)
        self._by_id.pop(session.session_id, None)

    def authenticate(self, authorization: str | None,
                     subprotocols: Sequence[str] = ()) -> Principal:
        """Bearer header, or the browser subprotocol tidewire.auth.<base64url key>."""
        if not self.config.api_keys:
            return Principal(None, "", self._salt_key)
        key, tenant = self._keys.find(authorization, subprotocols)
        return Principal(key, tenant, self._salt_key)

    # -- requests --------------------------------------------------------------------------

    def submit(self, principal: Principal, params: SamplingParams, request_id: str | None = None,
               prompt: str | list[int] | None = None,
               messages: list[dict[str, Any]] | None = None, warm: bool = False,
               tools: list[dict[str, Any]] | None = None,
               output_token_ids: Sequence[int] = (), prompt_ids: list[int] | None = None,
               hold: Hold | None = None,
               template_kwargs: dict[str, Any] | None = None) -> Admission:
        """Admit a request or raise ProtocolError (overloaded, invalid, too long...).
        `output_token_ids`: a stream continued here from the tokens its client received
        (a resume of a request this server does not hold). `prompt_ids`: the prompt
        already tokenized (`prompt_ids()`); `hold`: the request's hold, which the
        admission takes over (the caller unholds it if this raises). `template_kwargs`:
        the chat template's extra variables (ThinkPolicy.template_kwargs)."""
        self._check_room(principal, request_id, hold)
        rid = request_id or uuid.uuid4().hex
        ids = (prompt_ids if prompt_ids is not None
               else self.prompts.ids(prompt, messages, rid, not warm, tools,
                                     template_kwargs=template_kwargs))
        # the most this request may use: its prompt and every token it may generate
        reserve = len(ids) + params.n * params.max_tokens
        budget = self.token_budget if principal.key is not None else None
        if budget is not None:
            check_budget(budget, principal.key, reserve, request_id)  # type: ignore[arg-type]
        stream = _add_request(self.engine, ids, params, principal, rid, request_id,
                              output_token_ids)
        adm = Admission(stream, time.monotonic(), principal, reserved=reserve if budget else 0)
        self.inflight_total += 1
        if hold is None:
            self.counts.add(principal.key, 1)
        else:
            hold.active = False  # its count is the admission's now
        try:
            self.metrics.prompt_tokens.inc(len(ids))
            if budget is not None:
                budget.charge(principal.key, reserve)  # type: ignore[arg-type]
        except BaseException:
            self.end(adm)
            raise
        return adm

    def _check_room(self, principal: Principal, request_id: str | None,
                    hold: Hold | None) -> None:
        """Refuse a request the server cannot take now: it is shutting down, the key has
        too many in flight (a held request was counted when it was held), or the queue
        is full."""
        if not self.accepting:
            raise ProtocolError("overloaded", "server is shutting down", request_id)
        if hold is None:
            self.counts.check(principal.key, request_id)
        else:
            self.compiled(hold)
        queued = self.engine.queued()
        if queued >= self.config.limits.max_queue:
            raise ProtocolError("overloaded", f"{queued} requests already waiting", request_id)

    def hold(self, principal: Principal, request_id: str | None, compiling: bool) -> Hold:
        """Count a request that is prepared before admission (see Hold); raises
        too_many_inflight past its key's limits."""
        self.counts.check(principal.key, request_id, compiling)
        if compiling:
            self.counts.add(principal.key, 1, self.compiling_by_key)
        self.counts.add(principal.key, 1)
        return Hold(principal, compiling)

    def compiled(self, hold: Hold) -> None:
        """The held request's constraint is compiled (or will not be): it leaves the
        key's compile count."""
        if hold.compiling:
            hold.compiling = False
            self.counts.add(hold.principal.key, -1, self.compiling_by_key)

    def unhold(self, hold: Hold) -> None:
        """Release a hold that did not become an admission (a no-op for one that did)."""
        self.compiled(hold)
        if hold.active:
            hold.active = False
            self.counts.add(hold.principal.key, -1)

    def close(self) -> None:
        self.prompts.close()

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

    async def warm(self, principal: Principal, request_id: str | None,
                   prompt: str | list[int] | None,
                   messages: list[dict[str, str]] | None) -> dict[str, Any]:
        """Prefill a prefix into the cache without generating (one throwaway token is
        sampled). Messages are rendered without the generation prompt: that rendering
        is the prefix the next turn's prompt starts with."""
        last = None
        ids = (await self.prompt_ids(prompt, messages, request_id, False)
               if self.off_loop(prompt, messages) else None)
        async with self.admit(principal, SamplingParams(max_tokens=1, temperature=0.0),
                              request_id, prompt, messages, warm=True, prompt_ids=ids) as adm:
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

    @contextlib.asynccontextmanager
    async def admit(self, principal: Principal, params: SamplingParams,
                    request_id: str | None = None, prompt: str | list[int] | None = None,
                    messages: list[dict[str, str]] | None = None,
                    warm: bool = False,
                    prompt_ids: list[int] | None = None) -> AsyncIterator[Admission]:
        """`submit`, and `end` when the block exits, however it exits."""
        adm = self.submit(principal, params, request_id, prompt, messages, warm,
                          prompt_ids=prompt_ids)
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
        self.counts.add(key, -1)
        if adm.reserved and self.token_budget is not None and key is not None:
            out = adm.stream.output  # what it did not use of its reservation comes back
            used = len(out.prompt_token_ids) + sum(len(o.token_ids) for o in out.outputs)
            self.token_budget.refund(key, adm.reserved - used)
        self.metrics.requests.labels(finish_reason or "unknown").inc()
        self.metrics.e2e.observe(time.monotonic() - adm.arrival)
        self.metrics.observe_spec(adm.stream.output.spec)
        if adm.stream.sampled_at:  # it was admitted: its wait for a batch slot is known
            self.metrics.queue.observe(adm.stream.queue_time)


def _add_request(engine: AsyncEngine, ids: list[int], params: SamplingParams,
                 principal: Principal, rid: str, request_id: str | None,
                 output_token_ids: Sequence[int]) -> RequestStream:
    """The engine's stream for the request, its engine id made unique engine-wide (client
    ids are only unique per connection); the engine's refusals as the client's errors."""
    try:
        return engine.add_request(ids, params, f"{uuid.uuid4().hex}:{rid}", principal.salt,
                                  output_token_ids)
    except PromptTooLongError as e:
        raise ProtocolError("context_length_exceeded", str(e), request_id) from None
    except ValueError as e:
        raise ProtocolError("invalid_request", str(e), request_id) from None
    except RuntimeError as e:
        raise ProtocolError("internal_error", str(e), request_id) from None

"""The one path from a client request to the engine, shared by the WebSocket and the
OpenAI-compatible endpoints: auth, tenancy, limits, prompt building, metrics."""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import hashlib
import hmac
import time
import uuid
from dataclasses import dataclass, field
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from engine import AsyncEngine, PromptTooLongError, SamplingParams
from engine.async_engine import RequestStream
from service.config import ServiceConfig
from service.metrics import Metrics
from service.protocol import AUTH_PREFIX, ProtocolError
from service.ratelimit import TokenBudget
from service.resume import ParkedRequests

T = TypeVar("T")


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
    def __init__(self, config: ServiceConfig, engine: AsyncEngine, metrics: Metrics) -> None:
        self.config, self.engine, self.metrics = config, engine, metrics
        # API keys by their SHA-256: a presented key is looked up by its digest, so how
        # long a lookup takes says nothing about the keys' characters
        self._keys = {_digest(k): (k, tenant) for k, tenant in config.api_keys.items()}
        self._salt_key = config.engine.tier.salt_key  # the same secret as the blocks' MAC
        self.inflight_total = 0
        # requests in flight (admitted, or held while they are prepared) by API key
        self.inflight_by_key: dict[str | None, int] = {}
        self.compiling_by_key: dict[str | None, int] = {}
        self.sessions_by_key: dict[str | None, int] = {}  # open sockets
        # large prompts are tokenized here, off the event loop, one at a time (the Rust
        # tokenizer releases the GIL: the loop keeps streaming meanwhile)
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="tidewire-tokenize")
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
        self._count(session.principal.key, 1, self.sessions_by_key)

    def remove_session(self, session: Any) -> None:
        if session in self.sessions:
            self.sessions.discard(session)
            self._count(session.principal.key, -1, self.sessions_by_key)
        self._by_id.pop(session.session_id, None)

    def authenticate(self, authorization: str | None,
                     subprotocols: Sequence[str] = ()) -> Principal:
        """Bearer header, or the browser subprotocol tidewire.auth.<base64url key>."""
        keys = self.config.api_keys
        if not keys:
            return Principal(None, "", self._salt_key)
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
        return Principal(found[0], found[1], self._salt_key)

    # -- requests --------------------------------------------------------------------------

    def submit(self, principal: Principal, params: SamplingParams, request_id: str | None = None,
               prompt: str | list[int] | None = None,
               messages: list[dict[str, Any]] | None = None, warm: bool = False,
               tools: list[dict[str, Any]] | None = None,
               output_token_ids: Sequence[int] = (), prompt_ids: list[int] | None = None,
               hold: Hold | None = None) -> Admission:
        """Admit a request or raise ProtocolError (overloaded, invalid, too long...).
        `output_token_ids`: a stream continued here from the tokens its client received
        (a resume of a request this server does not hold). `prompt_ids`: the prompt
        already tokenized (`prompt_ids()`); `hold`: the request's hold, which the
        admission takes over (the caller unholds it if this raises)."""
        lim = self.config.limits
        if not self.accepting:
            raise ProtocolError("overloaded", "server is shutting down", request_id)
        if hold is None:
            self._check_key(principal, request_id)
        else:
            self.compiled(hold)
        queued = self.engine.queued()
        if queued >= lim.max_queue:
            raise ProtocolError("overloaded", f"{queued} requests already waiting", request_id)
        rid = request_id or uuid.uuid4().hex
        ids = (prompt_ids if prompt_ids is not None
               else self._prompt_ids(prompt, messages, rid, not warm, tools))
        # the most this request may use: its prompt and every token it may generate
        reserve = len(ids) + params.n * params.max_tokens
        budget = self.token_budget if principal.key is not None else None
        if budget is not None:
            wait = budget.retry_after(principal.key, reserve)  # type: ignore[arg-type]
            if wait > 0:
                raise ProtocolError(
                    "rate_limited", f"this key's budget of {int(budget.capacity)} tokens a "
                    f"minute does not hold this request's {reserve} (prompt + n x max_tokens) "
                    f"now; retry in {wait:.1f}s", request_id, retry_after=wait)
        try:
            stream = self.engine.add_request(ids, params, self._engine_id(principal, rid),
                                             principal.salt, output_token_ids)
        except PromptTooLongError as e:
            raise ProtocolError("context_length_exceeded", str(e), request_id) from None
        except ValueError as e:
            raise ProtocolError("invalid_request", str(e), request_id) from None
        except RuntimeError as e:
            raise ProtocolError("internal_error", str(e), request_id) from None
        adm = Admission(stream, time.monotonic(), principal, reserved=reserve if budget else 0)
        self.inflight_total += 1
        if hold is None:
            self._count(principal.key, 1)
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

    def _check_key(self, principal: Principal, request_id: str | None) -> None:
        lim = self.config.limits
        if (principal.key is not None  # an open server's one anonymous caller: no key limit
                and self.inflight_by_key.get(principal.key, 0) >= lim.max_inflight_per_key):
            raise ProtocolError("too_many_inflight", "too many requests in flight for this key",
                                request_id)

    def _count(self, key: str | None, n: int, counts: dict[str | None, int] | None = None) -> None:
        counts = self.inflight_by_key if counts is None else counts
        left = counts.get(key, 0) + n
        if left:
            counts[key] = left
        else:
            counts.pop(key, None)

    def hold(self, principal: Principal, request_id: str | None, compiling: bool) -> Hold:
        """Count a request that is prepared before admission (see Hold); raises
        too_many_inflight past its key's limits."""
        self._check_key(principal, request_id)
        lim = self.config.limits
        if compiling and principal.key is not None:
            if self.compiling_by_key.get(principal.key, 0) >= lim.max_compiles_per_key:
                raise ProtocolError("too_many_inflight", "this key has "
                                    f"{lim.max_compiles_per_key} constraints compiling already",
                                    request_id)
        if compiling:
            self._count(principal.key, 1, self.compiling_by_key)
        self._count(principal.key, 1)
        return Hold(principal, compiling)

    def compiled(self, hold: Hold) -> None:
        """The held request's constraint is compiled (or will not be): it leaves the
        key's compile count."""
        if hold.compiling:
            hold.compiling = False
            self._count(hold.principal.key, -1, self.compiling_by_key)

    def unhold(self, hold: Hold) -> None:
        """Release a hold that did not become an admission (a no-op for one that did)."""
        self.compiled(hold)
        if hold.active:
            hold.active = False
            self._count(hold.principal.key, -1)

    def off_loop(self, prompt: str | list[int] | None,
                 messages: list[dict[str, Any]] | None) -> bool:
        """Whether this prompt is large enough to be tokenized off the event loop."""
        return _text_bytes(prompt, messages, INLINE_PROMPT_BYTES) > INLINE_PROMPT_BYTES

    async def prompt_ids(self, prompt: str | list[int] | None,
                         messages: list[dict[str, Any]] | None, request_id: str | None,
                         generation_prompt: bool = True,
                         tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's token ids, tokenized on the tokenizing thread (a large prompt)
        after a check of its size in bytes against the context window: one that cannot
        fit is refused before any tokenizing."""
        self._check_size(prompt, messages, request_id)
        return await self.off_the_loop(self._prompt_ids, prompt, messages, request_id or "",
                                       generation_prompt, tools, True)

    async def off_the_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the tokenizing thread (tokenizer work on a large input)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    def _check_size(self, prompt: str | list[int] | None,
                    messages: list[dict[str, Any]] | None, request_id: str | None) -> None:
        most = self.engine.max_prompt_bytes
        if most is None:
            return
        size = _text_bytes(prompt, messages, most)
        if size > most:
            raise ProtocolError(
                "context_length_exceeded", f"the prompt's {size} bytes are more than "
                f"{self.engine.max_model_len} tokens, the context window, can hold "
                f"(at most {most} bytes with this tokenizer)", request_id)

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

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

    def _prompt_ids(self, prompt: str | list[int] | None, messages: list[dict[str, Any]] | None,
                    rid: str, generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    any_thread: bool = False) -> list[int]:
        """`any_thread`: use only what is safe off the event loop (Rust encode)."""
        eng = self.engine
        if not any_thread:
            self._check_size(prompt, messages, rid)
        try:
            if messages is not None:
                return eng.apply_chat_template(messages, generation_prompt, tools, any_thread)
            assert prompt is not None
            return eng.tokenize(prompt, any_thread)
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
        self._count(key, -1)
        if adm.reserved and self.token_budget is not None and key is not None:
            out = adm.stream.output  # what it did not use of its reservation comes back
            used = len(out.prompt_token_ids) + sum(len(o.token_ids) for o in out.outputs)
            self.token_budget.refund(key, adm.reserved - used)
        self.metrics.requests.labels(finish_reason or "unknown").inc()
        self.metrics.e2e.observe(time.monotonic() - adm.arrival)
        self.metrics.observe_spec(adm.stream.output.spec)
        if adm.stream.sampled_at:  # it was admitted: its wait for a batch slot is known
            self.metrics.queue.observe(adm.stream.queue_time)


# prompts up to this size (UTF-8 bytes of the text or of the messages' contents) are
# tokenized on the event loop (~20 us a KiB); larger ones on the tokenizing thread
INLINE_PROMPT_BYTES = 16 * 1024


def _text_bytes(prompt: str | list[int] | None, messages: list[dict[str, Any]] | None,
                above: int) -> int:
    """The UTF-8 size of a prompt's text (0 for token ids), exact up to `above` and more
    than `above` past it (a string longer than that in characters is not encoded)."""
    texts = ([prompt] if isinstance(prompt, str) else []) + [
        m["content"] for m in messages or () if isinstance(m.get("content"), str)]
    size = 0
    for t in texts:
        size += len(t) if len(t) > above else len(t.encode("utf-8", "surrogatepass"))
        if size > above:
            break
    return size


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _b64url(text: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None

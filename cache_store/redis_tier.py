"""The Redis tier: prefix blocks shared across restarts and replicas.

A dedicated I/O thread (the engine's cache worker) calls it with redis-py's blocking
client: one pipelined round trip per lookup, per load and per batch of writes. Every
Redis failure is a miss or a dropped write, counted; after `threshold` failures in a
row the circuit breaker opens and the tier is skipped for `cooldown` seconds, then one
trial call decides whether it closes again.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cache_store.base import KVTier

T = TypeVar("T")
GET_CHUNK = 16


class CircuitBreaker:
    """closed -> open after `threshold` consecutive failures -> half-open after
    `cooldown` seconds (one trial call) -> closed on success, open again on failure."""

    def __init__(self, threshold: int = 3, cooldown: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold, self.cooldown, self.clock = threshold, cooldown, clock
        self.failures = 0
        self.opened_at: float | None = None
        self.trips = 0  # times it opened
        self._trial = False
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self.opened_at >= self.cooldown else "open"

    def allow(self) -> bool:
        with self._lock:
            if self.opened_at is None:
                return True
            if self.clock() - self.opened_at < self.cooldown or self._trial:
                return False
            self._trial = True  # exactly one caller tries
            return True

    def success(self) -> None:
        with self._lock:
            self.failures, self.opened_at, self._trial = 0, None, False

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self._trial or self.failures >= self.threshold:
                if self.opened_at is None or self._trial:
                    self.trips += 1
                self.opened_at, self._trial = self.clock(), False


class RedisTier(KVTier):
    """Blocks in Redis as `SET key value EX ttl NX`; a hit refreshes the TTL (GETEX).

    Configure the server with `maxmemory` and `maxmemory-policy allkeys-lru`: Redis,
    not this client, decides what is forgotten."""

    name = "redis"

    def __init__(self, url: str, ttl: int = 24 * 3600, timeout: float = 1.0,
                 breaker: CircuitBreaker | None = None) -> None:
        super().__init__()
        self.url, self.ttl = url, ttl
        self.breaker = breaker or CircuitBreaker()
        # No client-side retries: a failure is a miss now; the breaker decides when to retry.
        # Values are ~0.1-1 MB blocks: reading the socket 1 MB at a time (not 64 KB) took
        # a 46 MB load from ~1.0 to ~1.5 GB/s here (with hiredis parsing the replies).
        self._client = redis.Redis.from_url(url, socket_timeout=timeout,
                                            socket_connect_timeout=timeout,
                                            retry=Retry(NoBackoff(), 0), health_check_interval=0,
                                            socket_read_size=1 << 20)

    def _call(self, fn: Callable[[], T], default: T) -> T:
        if not self.breaker.allow():
            return default
        try:
            out = fn()
        except (redis.RedisError, OSError):
            self.stats.add(errors=1)
            self.breaker.failure()
            return default
        self.breaker.success()
        return out

    def _pipeline(self, build: Callable[[redis.client.Pipeline], object]) -> Callable[[], list[Any]]:
        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            build(pipe)
            return pipe.execute()
        return run

    def lookup(self, keys: Sequence[str]) -> int:
        self.stats.add(lookups=len(keys))
        if not keys:
            return 0
        found: list[int] = self._call(self._pipeline(lambda p: [p.exists(k) for k in keys]), [])
        n = 0
        for hit in found:
            if not hit:
                break
            n += 1
        return n

    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        # Pipelines of GET_CHUNK keys: a few MB per reply instead of one reply of tens of
        # MB, which the client parses in a buffer it keeps growing (3-10x slower here).
        vals: list[bytes | memoryview | None] = []
        for i in range(0, len(keys), GET_CHUNK):
            part = keys[i : i + GET_CHUNK]
            def build(p: redis.client.Pipeline, part: Sequence[str] = part) -> object:
                return [p.getex(k, ex=self.ttl) for k in part]

            got = self._call(self._pipeline(build), None)
            if got is None:  # failed: the rest are misses too
                vals += [None] * (len(keys) - i)
                break
            vals += got
        hits = [v for v in vals if v is not None]
        self.stats.add(hits=len(hits), misses=len(keys) - len(hits),
                       bytes_read=sum(len(v) for v in hits))
        return list(vals)

    def get_into(self, keys: Sequence[str], bufs: Sequence[memoryview]) -> list[int | None]:
        """One pipeline of GETEX whose replies are read off the socket straight into the
        buffers (`_read_bulk_replies`). redis-py with hiredis copies each reply three
        times (socket buffer, parser buffer, a new bytes object whose fresh pages fault
        in): a 3,008-token prefix of 188 values of 360 KiB took 66 ms that way on the
        2-core test machine, 15 ms read into the buffers. The connection (and so AUTH,
        TLS, the database, a unix socket) is redis-py's; any failure disconnects it, since
        its stream may stand mid-reply."""
        if not keys:
            return []

        def run() -> list[int | None]:
            pool = self._client.connection_pool
            conn: Any = pool.get_connection()  # (redis-py's Connection: untyped methods)
            try:
                conn.send_packed_command(conn.pack_commands(
                    [("GETEX", k, "EX", self.ttl) for k in keys]))
                return _read_bulk_replies(conn._sock, bufs[: len(keys)])  # noqa: SLF001 - see above
            except (redis.RedisError, OSError):
                conn.disconnect()
                raise
            except Exception as e:  # whatever else: counted as a failure, like the others
                conn.disconnect()
                raise redis.RedisError(f"reading GETEX replies: {e!r}") from e
            finally:
                pool.release(conn)

        got: list[int | None] = self._call(run, [None] * len(keys))
        hits = [n for n in got if n is not None]
        self.stats.add(hits=len(hits), misses=len(keys) - len(hits), bytes_read=sum(hits))
        return got

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        if not items:
            return 0
        res: list[bool] = self._call(self._pipeline(
            lambda p: [p.set(k, v, ex=self.ttl, nx=True) for k, v in items]), [])
        stored = [len(v) for (_, v), ok in zip(items, res) if ok]
        self.stats.add(puts=len(stored), bytes_written=sum(stored))
        return len(stored)

    def delete(self, keys: Sequence[str]) -> None:
        if keys:
            self._call(lambda: self._client.delete(*keys), 0)

    def warm(self) -> None:
        """One PING: the pooled connection (TCP or TLS handshake, AUTH, and the client
        name commands redis-py sends on connect) is made before the first lookup, which
        took ~3 ms on a fresh replica otherwise. A dead Redis is an error counted, as
        for any call."""
        self._call(self._client.ping, False)

    def state(self) -> str:
        return "ok" if self.breaker.state == "closed" else f"breaker_{self.breaker.state}"

    def breaker_trips(self) -> int:
        return self.breaker.trips

    def close(self) -> None:
        self._client.close()


def _read_bulk_replies(sock: socket.socket | None, bufs: Sequence[memoryview]) -> list[int | None]:
    """Read len(bufs) RESP bulk-string replies (RESP2 or RESP3), each value into its
    buffer: its length, None for a nil. A value longer than its buffer fills the buffer,
    the rest is read and dropped, and its whole length is returned. An error reply
    raises redis.ResponseError after the remaining replies are read (the stream stays
    in step)."""
    if sock is None:
        raise redis.ConnectionError("not connected")
    head = bytearray(1 << 16)  # reply lines, and whatever arrives after them
    view = memoryview(head)
    start = end = 0
    out: list[int | None] = []
    error: bytes | None = None

    def fill() -> None:
        nonlocal start, end
        if start == end:
            start = end = 0
        elif end == len(head):  # a line longer than what is left: move it to the front
            head[: end - start] = head[start:end]
            start, end = 0, end - start
        n = sock.recv_into(view[end:])
        if not n:
            raise redis.ConnectionError("connection closed mid-reply")
        end += n

    def line() -> bytes:
        nonlocal start
        while True:
            i = head.find(b"\r\n", start, end)
            if i >= 0:
                got, start = bytes(head[start:i]), i + 2
                return got
            if end - start >= len(head) - 2:
                raise redis.ResponseError("a reply line longer than 64 KiB")
            fill()

    def read(dest: memoryview, n: int) -> None:
        """n bytes of the stream into dest[:n] (dest may be shorter: the rest dropped)."""
        nonlocal start
        taken = min(n, end - start)
        keep = min(taken, len(dest))
        dest[:keep] = view[start : start + keep]
        start += taken
        while taken < n:
            if taken < len(dest):
                k = sock.recv_into(dest[taken:], min(n, len(dest)) - taken)
            else:
                k = sock.recv_into(view, min(n - taken, len(head)))  # the dropped tail
            if not k:
                raise redis.ConnectionError("connection closed mid-reply")
            taken += k

    for buf in bufs:
        first = line()
        kind, rest = first[:1], first[1:]
        if kind == b"$" and rest != b"-1":
            try:
                n = int(rest)
            except ValueError:
                n = -2
            if n < 0:
                raise redis.ResponseError(f"a bad bulk length: {first[:40]!r}")
            read(buf, n)
            if line():  # the value's CRLF: an empty line
                raise redis.ResponseError("a bulk reply longer than its length")
            out.append(n)
        elif kind == b"_" or (kind == b"$" and rest == b"-1"):
            out.append(None)
        elif kind == b"-":
            error = error or rest
            out.append(None)
        else:
            raise redis.ResponseError(f"unexpected reply to GETEX: {first[:40]!r}")
    if error is not None:
        raise redis.ResponseError(error.decode("utf-8", "replace"))
    return out

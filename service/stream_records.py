"""The record of a resumable completion stream in Redis, for the other replicas.

With the Redis host tier (`--kv-tier redis`), a stream that opted in to resuming
(service/sse_resume.py) is also written where every replica reads: its request (the
body as sent, its tenant, id and creation time) once, and the token ids of each event
before the event goes out, so the record always holds at least what the client has. A
replica asked for a stream it does not hold (`GET .../{id}/events` after its replica
died, or behind a balancer that sent the reconnect elsewhere) continues it from the
record: the request again, from the tokens the client had (Last-Event-ID's TOKENS),
recomputed as prefix-cache hits and sampled on as if never interrupted, so greedy and
seeded text is the uninterrupted run's. A Redis that fails costs only that: the stream
runs on where it is, and a resume elsewhere finds nothing (404)."""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("tidewire.service")

PREFIX = "tidewire:sse:"


class StreamRecords:
    def __init__(self, url: str, ttl: float, timeout: float) -> None:
        import redis.asyncio as aioredis

        self.ttl = max(int(ttl), 1)
        self.client = aioredis.from_url(url, socket_timeout=timeout,
                                        socket_connect_timeout=timeout)
        self._warned = False

    def _failed(self, what: str, e: Exception) -> None:
        if not self._warned:  # once: a down Redis would otherwise log every event
            self._warned = True
            log.warning("stream records: %s failed (%r); streams resume only where they run",
                        what, e)

    async def begin(self, stream_id: str, record: dict[str, Any]) -> bool:
        try:
            await self.client.set(PREFIX + stream_id, json.dumps(record), ex=self.ttl)
            return True
        except Exception as e:  # noqa: BLE001 - any Redis failure: no record, the stream goes on
            self._failed("writing a stream's request", e)
            return False

    async def append(self, stream_id: str, token_ids: list[int]) -> bool:
        key = PREFIX + stream_id + ":tokens"
        try:
            async with self.client.pipeline(transaction=False) as p:
                p.rpush(key, json.dumps(token_ids))
                p.expire(key, self.ttl)
                p.expire(PREFIX + stream_id, self.ttl)
                await p.execute()
            self._warned = False
            return True
        except Exception as e:  # noqa: BLE001 - see begin
            self._failed("recording a stream's tokens", e)
            return False

    async def load(self, stream_id: str) -> tuple[dict[str, Any], list[int]] | None:
        """The stream's request and every token id recorded, or None."""
        try:
            async with self.client.pipeline(transaction=False) as p:
                p.get(PREFIX + stream_id)
                p.lrange(PREFIX + stream_id + ":tokens", 0, -1)
                raw, pieces = await p.execute()
        except Exception as e:  # noqa: BLE001 - see begin
            self._failed("reading a stream's record", e)
            return None
        if raw is None:
            return None
        return json.loads(raw), [t for piece in pieces for t in json.loads(piece)]

    async def close(self) -> None:
        try:
            await self.client.aclose()
        except Exception:  # noqa: BLE001, S110 - closing a client that failed: nothing to do
            pass

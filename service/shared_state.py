"""State the replicas share, in the Redis the KV host tier uses (`--kv-tier redis`): small
JSON records with a TTL:

- live records (service/live_record.py) of running streams: a resumable completion
  stream's (service/sse_resume.py) and a background or WebSocket-mode Response's
  (service/responses_api.py): the request, each write's events and token ids, an owner
  and its heartbeat, so another replica follows the stream while it runs and takes it
  over when its replica dies, greedy and seeded text the uninterrupted run's;
- stored Responses, written when they end: their object, events and conversation, so
  `previous_response_id`, GET (and its event replay) and DELETE work on any replica.

A Redis that fails costs only the sharing: each replica goes on with what it holds, and
what only another held is not found (404); a warning is logged once per failure spell."""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("tidewire.service")


class SharedState:
    def __init__(self, url: str, timeout: float) -> None:
        import redis.asyncio as aioredis

        self.client = aioredis.from_url(url, socket_timeout=timeout,
                                        socket_connect_timeout=timeout)
        self._warned = False
        self._scripts: dict[str, Any] = {}

    def _failed(self, what: str, e: Exception) -> None:
        if not self._warned:  # once: a down Redis would otherwise log every event
            self._warned = True
            log.warning("shared state: %s failed (%r); replicas go on with what they hold",
                        what, e)

    async def put(self, key: str, value: Any, ttl: float) -> bool:
        try:
            await self.client.set(key, json.dumps(value), ex=max(int(ttl), 1))
            self._warned = False
            return True
        except Exception as e:  # noqa: BLE001 - any Redis failure: not shared, nothing else
            self._failed(f"writing {key}", e)
            return False

    async def get(self, key: str) -> Any | None:
        try:
            raw = await self.client.get(key)
        except Exception as e:  # noqa: BLE001 - see put
            self._failed(f"reading {key}", e)
            return None
        return None if raw is None else json.loads(raw)

    async def exists(self, key: str) -> bool | None:
        """Whether `key` is there (None: Redis did not say)."""
        try:
            return bool(await self.client.exists(key))
        except Exception as e:  # noqa: BLE001 - see put
            self._failed(f"looking up {key}", e)
            return None

    async def delete(self, *keys: str) -> None:
        try:
            await self.client.delete(*keys)
        except Exception as e:  # noqa: BLE001 - see put
            self._failed(f"deleting {keys[0]}", e)

    async def run_script(self, source: str, keys: list[str], args: list[Any]) -> Any | None:
        """Run a Lua script (atomic on the server) and return its answer, or None when
        Redis did not answer."""
        try:
            script = self._scripts.get(source)
            if script is None:
                script = self._scripts[source] = self.client.register_script(source)
            answer = await script(keys=keys, args=args)
            self._warned = False
            return answer
        except Exception as e:  # noqa: BLE001 - see put
            self._failed("a script", e)
            return None

    async def read_from(self, key: str, list_key: str, start: int, flag: str,
                        mark: str | None = None, mark_ttl: int = 1
                        ) -> tuple[Any, list[Any], bool] | None:
        """The record at `key`, the items of the list at `list_key` from index `start`
        and whether `flag` exists, read together (and `mark` set for `mark_ttl`
        seconds); None when Redis did not answer."""
        try:
            async with self.client.pipeline(transaction=False) as p:
                p.get(key)
                p.lrange(list_key, start, -1)
                p.exists(flag)
                if mark is not None:
                    p.set(mark, 1, ex=mark_ttl)
                raw, items, there = (await p.execute())[:3]
        except Exception as e:  # noqa: BLE001 - see put
            self._failed(f"reading {key}", e)
            return None
        return (None if raw is None else json.loads(raw), [json.loads(i) for i in items],
                bool(there))

    async def get_with_list(self, key: str, list_key: str) -> tuple[Any, list[Any]] | None:
        """The record at `key` and every item of the list at `list_key`, or None."""
        try:
            async with self.client.pipeline(transaction=False) as p:
                p.get(key)
                p.lrange(list_key, 0, -1)
                raw, items = await p.execute()
        except Exception as e:  # noqa: BLE001 - see put
            self._failed(f"reading {key}", e)
            return None
        if raw is None:
            return None
        return json.loads(raw), [json.loads(i) for i in items]


def shared_state_of(app: Any) -> SharedState | None:
    """The app's shared state: on the KV tier's Redis, or None without one."""
    state = app.state
    if not hasattr(state, "shared_state"):
        tier = state.gateway.config.engine.tier
        state.shared_state = (SharedState(tier.redis_url, tier.io_timeout)
                              if tier.kind == "redis" and tier.redis_url else None)
    return state.shared_state  # type: ignore[no-any-return]

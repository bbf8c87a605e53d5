"""Disconnect storms: 500 sockets, each mid-stream, dropped at once (half reset without
a close frame, half closed cleanly). Every KV block is back in the pool within 2 engine
steps of the server seeing the last drop; parked requests expire on schedule; nothing
is left behind (requests, streams, sessions, file descriptors)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from websockets.asyncio.client import connect

from engine import EngineConfig
from engine.config import CacheConfig, SchedulerConfig
from service.config import Limits, ServiceConfig
from tests.chaos.driver import open_fds
from tests.servers import apoll, run_server

SOCKETS = 500


def storm_config(path, grace: float) -> ServiceConfig:  # noqa: ANN001
    # room for every stream in one batch (so all 500 are mid-stream at once)
    return ServiceConfig(
        engine=EngineConfig(model=str(path), dtype="float32",
                            cache=CacheConfig(block_size=16, num_blocks=SOCKETS * 12),
                            scheduler=SchedulerConfig(max_num_seqs=512,
                                                      max_num_batched_tokens=2048)),
        limits=Limits(resume_grace=grace))


async def open_streams(ws_url: str, n: int) -> list:
    """n sockets, one long greedy stream each, returned once every stream has a delta."""
    async def one(i: int):  # noqa: ANN202 - a websockets ClientConnection
        ws = await connect(ws_url, subprotocols=["tidewire.v1.json"], open_timeout=120,
                           ping_interval=None)
        assert json.loads(await ws.recv())["type"] == "ready"
        await ws.send(json.dumps({"type": "generate", "id": f"s{i}",
                                  "prompt_token_ids": [3 + (i * 7 + k) % 300 for k in range(16)],
                                  "params": {"max_tokens": 150, "temperature": 0.0,
                                             "ignore_eos": True}}))
        while True:
            m = json.loads(await ws.recv())
            assert m["type"] in ("queued", "start", "delta"), m
            if m["type"] == "delta":
                return ws

    return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 180)


async def drop_all(sockets: list) -> float:
    """Reset half (no close frame: a lost network), close the other half; returns when."""
    t = time.monotonic()
    for ws in sockets[::2]:
        ws.transport.abort()
    await asyncio.gather(*(ws.close() for ws in sockets[1::2]))
    return t


def leftovers(s) -> dict:  # noqa: ANN001 - RunningServer
    """Everything a request can leave behind, server-wide (all should be 0)."""
    st = s.gateway.engine.stats
    eng = s.gateway.engine
    return {"sessions": len(s.gateway.sessions), "inflight": s.gateway.inflight_total,
            "parked_service": s.gateway.parked.count, "parked_engine": st.parked,
            "running": st.running, "waiting": st.waiting, "kv_usage": st.kv_usage,
            "engine_streams": len(eng._streams), "engine_requests": len(eng.engine.request_ids())}


@pytest.mark.parametrize("grace", [3.0, 0.0], ids=["parked", "aborted"])
async def test_500_sockets_dropped_mid_stream_at_once(tiny_models, grace: float) -> None:
    path = tiny_models("llama", 0)
    with run_server(storm_config(path, grace)) as s:
        fds_before = open_fds()
        sockets = await open_streams(s.ws_url, SOCKETS)
        st = s.gateway.engine.stats
        assert st.running == SOCKETS and st.kv_usage > 0, st
        dropped_at = await drop_all(sockets)
        # the server sees every drop
        await apoll(lambda: not s.gateway.sessions, 30, "every session to close")
        seen = time.monotonic()
        step_seen = s.gateway.engine.stats.step
        # ... and every block is back within 2 steps of the last one
        await apoll(lambda: s.gateway.engine.stats.kv_usage == 0.0
                    and s.gateway.engine.stats.running == 0, 10, "the blocks back")
        steps = s.gateway.engine.stats.step - step_seen
        freed = time.monotonic()
        if grace:
            assert s.gateway.parked.count == SOCKETS
            assert s.gateway.engine.stats.parked == SOCKETS
            # parked until the grace ends (timers start as each drop is seen), then aborted
            await apoll(lambda: s.gateway.parked.count == 0, grace + 10, "the parked to expire")
            expired = time.monotonic() - dropped_at
            assert grace - 0.05 <= expired <= grace + 3, expired
        await apoll(lambda: not any(leftovers(s).values()), 10, "nothing left behind")
        fds = await apoll(lambda: (n := open_fds()) <= fds_before + 2 and n, 10,
                          "the file descriptors back")
        print(f"\nchaos storm ({'parked' if grace else 'aborted'}): {SOCKETS} sockets dropped; "
              f"server saw them all in {seen - dropped_at:.2f} s; blocks back {steps} "
              f"step(s) and {1000 * (freed - seen):.0f} ms later"
              + (f"; parked expired at {expired:.2f} s (grace {grace:g} s)" if grace else "")
              + f"; fds {fds_before} -> {fds}")
        assert steps <= 2, steps

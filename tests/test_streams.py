"""service/streams.py: a socket's requests as data, driven by a Gateway over the
FakeEngine (tests/fakes.py): the end of a stream, `unsent` to `recent`, the resume
window and what a drop keeps."""

from __future__ import annotations

import asyncio

from engine import SamplingParams
from service.config import ServiceConfig
from service.delivery import Live, Timings
from service.gateway import Gateway
from service.metrics import Metrics
from service.protocol import ProtocolError
from service.streams import RECENT_DONE_SECONDS, RECENT_DONES, Streams
from tests.fakes import FakeEngine


def setup() -> tuple[Gateway, Streams]:
    gw = Gateway(ServiceConfig(), FakeEngine(), Metrics())  # type: ignore[arg-type]
    return gw, Streams(gw)


def start(gw: Gateway, streams: Streams, rid: str, tokens: int = 2) -> Live:
    adm = gw.submit(gw.authenticate(None), SamplingParams(max_tokens=tokens), rid, [5, 6])
    live = streams.live[rid] = Live(rid, adm, False, Timings(adm.arrival))
    return live


async def finished(live: Live) -> None:
    while live.stream.done_indexes != {0}:
        await asyncio.sleep(0.001)


async def test_a_finished_stream_ends_once_and_moves_to_recent_when_written() -> None:
    gw, st = setup()
    live = start(gw, st, "a")
    await finished(live)
    frames = st.pull(live)
    assert [f["type"] for f in frames] == ["start", "delta", "done"]  # both steps, merged
    assert frames[1]["token_ids"] == [5, 6]
    assert live.ended and live.tail == frames[-1:] and st.unsent == {"a": live}
    assert not st.live and gw.inflight_total == 0  # released once, when its done was built
    st.delivered(live)
    assert not st.unsent and st.recent["a"][0] is live
    st.release(live, "stop")  # (already released: a no-op)
    assert gw.inflight_total == 0


async def test_a_failure_goes_out_before_the_done() -> None:
    gw, st = setup()
    live = start(gw, st, "a", tokens=10_000)
    st.fail_all(ProtocolError("slow_consumer", "the client is not reading its stream"))
    await finished(live)
    frames = st.pull(live)
    assert frames[-2] == {"type": "error", "code": "slow_consumer", "id": "a", "retryable": True,
                          "message": "the client is not reading its stream"}
    assert frames[-1]["status"] == "failed"


async def test_recent_ends_expire_and_are_capped() -> None:
    gw, st = setup()
    now = [100.0]
    st.clock = lambda: now[0]  # type: ignore[method-assign]
    lives = [start(gw, st, f"r{i}", tokens=1) for i in range(RECENT_DONES + 2)]
    for live in lives:
        await finished(live)
        st.pull(live)
        st.delivered(live)
    assert len(st.recent) == RECENT_DONES and "r0" not in st.recent  # the oldest went first
    now[0] += RECENT_DONE_SECONDS + 1
    st.expire_recent()
    assert not st.recent


async def test_a_drop_keeps_the_unfinished_first_then_unsent_then_recent() -> None:
    gw, st = setup()
    written, unsent = start(gw, st, "w", tokens=1), start(gw, st, "u", tokens=1)
    for live in (written, unsent):
        await finished(live)
        st.pull(live)
    st.delivered(written)
    running = start(gw, st, "r", tokens=10_000)
    assert list(st.resumable()) == ["r", "u", "w"]
    st.close()
    assert running.stream.listener is None
    st.abort([running, unsent])  # (an ended one is not aborted again)
    assert gw.engine.calls == [("abort", running.stream.request_id)]  # type: ignore[attr-defined]
    assert gw.inflight_total == 0

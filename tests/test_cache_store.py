"""cache_store on its own: the memory LRU, the block codec, the circuit breaker, the
Redis tier against a real redis-server (TTL, NX, faults) and the stack."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from cache_store import (CircuitBreaker, CorruptValue, MemoryTier, RedisTier, TierStack,
                         decode_block, encode_block, make_tier)
from tests.servers import RedisServer, free_port

FP = hashlib.sha256(b"model").digest()
H = [hashlib.sha256(bytes([i])).digest() for i in range(8)]
SHAPE = (2, 2, 4, 1, 8)  # layers, k/v, block size, kv heads, head dim
PAYLOAD = os.urandom(2 * 2 * 4 * 1 * 8 * 2)  # bfloat16


def value(i: int = 0, payload: bytes = PAYLOAD) -> bytes:
    return encode_block(FP, H[i], "bfloat16", SHAPE, payload)


def decode(v: bytes, i: int = 0) -> bytes:
    return bytes(decode_block(v, FP, H[i], "bfloat16", SHAPE, 2))


# -- memory ------------------------------------------------------------------------------


def test_memory_tier_is_a_byte_budgeted_lru() -> None:
    t = MemoryTier(capacity_bytes=300)
    assert t.put_many([("a", b"x" * 100), ("b", b"y" * 100), ("c", b"z" * 100)]) == 3
    assert t.lookup(["a", "b", "c", "d"]) == 3 and t.used == 300
    assert t.get_many(["a"]) == [b"x" * 100]  # a is now the most recent
    t.put_many([("d", b"w" * 100)])  # evicts b, the least recently used
    assert t.get_many(["a", "b", "c", "d"]) == [b"x" * 100, None, b"z" * 100, b"w" * 100]
    assert t.lookup(["a", "b", "c"]) == 1  # contiguous from the first key
    assert t.put_many([("big", b"q" * 301)]) == 0 and t.used == 300  # never over budget
    t.delete(["a", "zzz"])
    assert t.used == 200 and len(t) == 2
    s = t.stats.as_dict()
    assert s["hits"] == 4 and s["misses"] == 1 and s["bytes_read"] == 400 and s["puts"] == 4


# -- codec -------------------------------------------------------------------------------


def test_codec_round_trip() -> None:
    assert decode(value()) == PAYLOAD


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "extra_byte",
                                    "empty"])
def test_codec_rejects_damaged_values(damage: str) -> None:
    v = bytearray(value())
    if damage == "truncate":
        v = v[:-7]
    elif damage == "flip_payload":
        v[-3] ^= 0x10
    elif damage == "flip_header":
        v[30] ^= 0x01  # inside the shape
    elif damage == "extra_byte":
        v += b"\0"
    else:
        v = bytearray()
    with pytest.raises(CorruptValue):
        decode(bytes(v))


def test_codec_refuses_the_crc32_values_of_its_first_version() -> None:
    """Version 1 (a CRC-32 in 4 bytes) gave way to version 3 (XXH3-64): a value an earlier
    Tidewire wrote is a miss, not misread as a payload shifted by 4 bytes."""
    import struct
    import zlib

    from cache_store.codec import _FIELDS, MAGIC

    dims = list(SHAPE) + [0] * (6 - len(SHAPE))
    head = _FIELDS.pack(MAGIC, 1, _FIELDS.size + 4, b"bfloat16", len(SHAPE), *dims, FP, H[0],
                        len(PAYLOAD))
    old = head + struct.pack("<I", zlib.crc32(PAYLOAD)) + PAYLOAD
    with pytest.raises(CorruptValue, match="CRC-32 of an earlier"):
        decode(old)


def test_codec_rejects_another_block_model_dtype_or_shape() -> None:
    v = value(0)
    with pytest.raises(CorruptValue):
        decode(v, i=1)  # stored under another chain hash
    with pytest.raises(CorruptValue):
        decode_block(v, hashlib.sha256(b"other").digest(), H[0], "bfloat16", SHAPE, 2)
    with pytest.raises(CorruptValue):
        decode_block(v, FP, H[0], "float16", SHAPE, 2)
    with pytest.raises(CorruptValue):
        decode_block(v, FP, H[0], "bfloat16", (2, 2, 4, 2, 4), 2)


KEY = hashlib.sha256(b"mac key").digest()


def test_codec_with_a_mac_key_round_trips_and_reads_only_its_own_kind() -> None:
    """A keyed value decodes with its key alone; a reader without a key refuses keyed
    values and a keyed reader refuses unkeyed ones (a server with a secret never trusts
    what a server without one wrote)."""
    keyed = encode_block(FP, H[0], "bfloat16", SHAPE, PAYLOAD, mac_key=KEY)
    assert bytes(decode_block(keyed, FP, H[0], "bfloat16", SHAPE, 2, KEY)) == PAYLOAD
    with pytest.raises(CorruptValue, match="no kv tier secret"):
        decode(bytes(keyed))
    with pytest.raises(CorruptValue, match="without the kv tier secret"):
        decode_block(value(), FP, H[0], "bfloat16", SHAPE, 2, KEY)
    with pytest.raises(CorruptValue, match="MAC mismatch"):
        decode_block(keyed, FP, H[0], "bfloat16", SHAPE, 2, hashlib.sha256(b"other").digest())


def _with_tag(v: bytes | memoryview, tag: bytes, chain_hash: bytes | None = None) -> bytes:
    """A keyed value with its MAC replaced (and its header's chain hash, if given)."""
    b = bytearray(v)
    if chain_hash is not None:
        b[81:113] = chain_hash
    b[121:153] = tag
    return bytes(b)


def test_codec_refuses_forged_and_moved_keyed_values() -> None:
    """Someone who can write the tier but lacks the key: a well-formed value with a
    valid checksum but no MAC, a keyed header with a made-up MAC, a genuine value under
    another chain hash (header rewritten to match), or its payload swapped: all
    refused."""
    def read(v: bytes, i: int = 0) -> bytes:
        return bytes(decode_block(v, FP, H[i], "bfloat16", SHAPE, 2, KEY))

    genuine = encode_block(FP, H[0], "bfloat16", SHAPE, PAYLOAD, mac_key=KEY)
    forged_payload = bytes(reversed(PAYLOAD))
    no_mac = value(0, forged_payload)  # version 1, valid CRC-32
    guessed_key = encode_block(FP, H[0], "bfloat16", SHAPE, forged_payload,
                               mac_key=hashlib.sha256(b"guess").digest())
    zero_mac = _with_tag(genuine, bytes(32))
    moved = _with_tag(genuine, bytes(genuine)[121:153], chain_hash=H[1])
    swapped = bytes(genuine)[:153] + forged_payload
    assert read(bytes(genuine)) == PAYLOAD
    for forged in (no_mac, bytes(guessed_key), zero_mac, swapped):
        with pytest.raises(CorruptValue):
            read(forged)
    with pytest.raises(CorruptValue, match="MAC mismatch"):
        read(moved, i=1)
    with pytest.raises(CorruptValue, match="another model or block"):
        read(bytes(genuine), i=1)  # moved as it is


# -- breaker -----------------------------------------------------------------------------


def test_circuit_breaker_opens_then_tries_once_then_closes() -> None:
    now = [0.0]
    b = CircuitBreaker(threshold=2, cooldown=5.0, clock=lambda: now[0])
    b.failure()
    assert b.state == "closed" and b.allow()
    b.failure()
    assert b.state == "open" and not b.allow() and b.trips == 1
    now[0] = 5.0
    assert b.state == "half_open" and b.allow() and not b.allow()  # one trial at a time
    b.failure()  # the trial failed: open again for a full cooldown
    assert b.state == "open" and b.trips == 2
    now[0] = 10.0
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.failures == 0


# -- redis -------------------------------------------------------------------------------


def test_redis_tier_stores_with_ttl_nx_and_refreshes_on_hits(redis_server) -> None:
    t = RedisTier(redis_server.url, ttl=100)
    r = redis_server.client()
    assert t.put_many([("k0", b"a"), ("k1", b"b")]) == 2
    assert t.put_many([("k0", b"changed")]) == 0  # NX: a key's value never changes
    assert 95 < r.ttl("k0") <= 100
    r.expire("k0", 10)
    assert t.lookup(["k0", "k1", "k2", "k0"]) == 2
    assert t.get_many(["k0", "k2", "k1"]) == [b"a", None, b"b"]
    assert r.ttl("k0") > 95  # the hit refreshed it
    t.delete(["k0"])
    assert t.lookup(["k0", "k1"]) == 0
    s = t.stats.as_dict()
    assert s["hits"] == 2 and s["misses"] == 1 and s["puts"] == 2 and s["errors"] == 0
    t.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_redis_tier_reads_values_straight_into_buffers(redis_server, protocol: int) -> None:
    """get_into: one pipeline whose replies the tier reads off the socket itself, into the
    caller's buffers (RESP2 and RESP3 nils). A value longer than its buffer fills it and
    reports its whole length, and the replies after it still land where they belong. An
    error reply (a key of another type) is a failure counted, every value a miss, and the
    connection is usable again on the next call."""
    t = RedisTier(f"{redis_server.url}?protocol={protocol}", ttl=100)
    r = redis_server.client()
    big = os.urandom(300_000)  # several socket reads
    assert t.put_many([("k0", b"a" * 10), ("k1", big), ("k3", b"")]) == 3
    r.expire("k1", 10)
    bufs = [memoryview(bytearray(n)) for n in (10, 300_000, 5, 4, 4)]
    assert t.get_into(["k0", "k1", "k2", "k3", "k1"], bufs) == [10, 300_000, None, 0, 300_000]
    assert bytes(bufs[0]) == b"a" * 10 and bytes(bufs[1]) == big
    assert bytes(bufs[4]) == big[:4]  # the caller sees the length: too long for its buffer
    assert r.ttl("k1") > 95  # GETEX refreshed it
    s = t.stats.as_dict()
    assert s["hits"] == 4 and s["misses"] == 1 and s["errors"] == 0
    assert s["bytes_read"] == 10 + 2 * 300_000
    # after a value bigger than its buffer, the stream is still in step
    assert t.get_into(["k0"], [memoryview(bytearray(10))]) == [10]
    r.rpush("a-list", "x")
    assert t.get_into(["k0", "a-list", "k1"], bufs[:3]) == [None, None, None]
    assert t.stats.errors == 1
    got = memoryview(bytearray(300_000))
    assert t.get_into(["k1"], [got]) == [300_000] and bytes(got) == big
    assert t.get_into([], []) == []
    t.close()


def _parse(data: bytes, sizes: list[int]) -> tuple[list[int | None], list[bytes]]:
    """_read_bulk_replies over a socket pair, `data` written by a thread in 7-byte
    pieces (so lines and values arrive split across reads)."""
    import socket
    import threading

    from cache_store.redis_tier import _read_bulk_replies

    a, b = socket.socketpair()

    def write() -> None:
        for i in range(0, len(data), 7):
            a.sendall(data[i : i + 7])
    writer = threading.Thread(target=write)
    writer.start()
    try:
        bufs = [memoryview(bytearray(n)) for n in sizes]
        return _read_bulk_replies(b, bufs), [bytes(x) for x in bufs]
    finally:
        writer.join()
        a.close()
        b.close()


def test_the_bulk_reply_reader_on_crafted_streams() -> None:
    """The Redis tier's own reader of GETEX replies: values, RESP2 and RESP3 nils, an
    empty value, a value longer than its buffer (its start kept, the rest dropped, the
    next reply in step), lines that straddle the end of its 64 KiB line buffer, and the
    malformed replies it refuses (as Redis errors: counted, the connection dropped)."""
    import redis

    got = _parse(b"$3\r\nabc\r\n$-1\r\n_\r\n$0\r\n\r\n$5\r\nhello\r\n$2\r\nok\r\n",
                 [3, 1, 1, 1, 2, 2])
    assert got == ([3, None, None, 0, 5, 2], [b"abc", b"\0", b"\0", b"\0", b"he", b"ok"])
    many = 12_000  # 7 bytes a reply: the 64 KiB buffer's end falls inside some line
    lens, vals = _parse(b"".join(b"$1\r\n%c\r\n" % (97 + i % 26) for i in range(many)), [1] * many)
    assert lens == [1] * many and vals == [bytes([97 + i % 26]) for i in range(many)]
    for bad, replies, match in ((b"$-2\r\n", 1, "bulk length"), (b"$x\r\n", 1, "bulk length"),
                                (b"$2\r\nabcd\r\n", 1, "longer than its length"),
                                (b"+OK\r\n", 1, "unexpected reply"),
                                (b"-WRONGTYPE no\r\n$1\r\nz\r\n", 2, "WRONGTYPE")):
        with pytest.raises(redis.ResponseError, match=match):
            _parse(bad, [4] * replies)


def test_tiers_without_their_own_get_into_copy_from_get_many() -> None:
    t = MemoryTier(1 << 20)
    t.put_many([("a", b"12345"), ("b", b"xy")])
    bufs = [memoryview(bytearray(5)), memoryview(bytearray(1)), memoryview(bytearray(3))]
    assert t.get_into(["a", "b", "c"], bufs) == [5, 2, None]
    assert bytes(bufs[0]) == b"12345" and bytes(bufs[1]) == b"x"


def test_redis_down_is_a_miss_counted_and_the_breaker_recovers() -> None:
    server = RedisServer()  # not started yet: nothing listens on its port
    now = [0.0]  # the breaker's clock, moved by hand
    t = RedisTier(server.url, timeout=0.3,
                  breaker=CircuitBreaker(threshold=2, cooldown=5.0, clock=lambda: now[0]))
    assert t.lookup(["a", "b"]) == 0
    assert t.get_many(["a"]) == [None]
    assert t.stats.errors == 2 and t.state() == "breaker_open"
    assert t.put_many([("a", b"1")]) == 0 and t.stats.errors == 2  # skipped while open
    server.start()
    try:
        now[0] += 4.9
        assert t.put_many([("a", b"1")]) == 0 and t.state() == "breaker_open"  # still cooling
        now[0] += 0.2  # cooldown over: the next call is the trial
        assert t.put_many([("a", b"1")]) == 1 and t.state() == "ok"
        assert t.get_many(["a"]) == [b"1"]
        server.stop()  # dies while in use
        assert t.get_many(["a"]) == [None] and t.stats.errors == 3
    finally:
        server.stop()
        t.close()


def test_redis_tier_on_a_port_that_never_answers_fails_fast() -> None:
    t = RedisTier(f"redis://127.0.0.1:{free_port()}/0", timeout=0.2)
    t0 = time.monotonic()
    assert t.lookup(["x"]) == 0 and t.get_many(["x"]) == [None] and t.put_many([("x", b"")]) == 0
    assert time.monotonic() - t0 < 2.0
    assert t.stats.errors == 3 and t.state() == "breaker_open"
    assert t.get_into(["x"], [memoryview(bytearray(1))]) == [None]  # (skipped: open)


# -- stack -------------------------------------------------------------------------------


def test_stack_reads_through_and_promotes_into_memory(redis_server) -> None:
    mem, red = MemoryTier(1 << 20), RedisTier(redis_server.url)
    stack = TierStack([mem, red])
    assert stack.local is False
    red.put_many([("k0", b"0"), ("k1", b"1"), ("k3", b"3")])
    mem.put_many([("k2", b"2")])
    assert stack.lookup(["k0", "k1", "k2", "k3", "k4"]) == 4  # prefix split between tiers
    assert stack.get_many(["k0", "k2", "k4"]) == [b"0", b"2", None]
    assert mem.get_many(["k0"]) == [b"0"]  # promoted
    bufs = [memoryview(bytearray(1)) for _ in range(3)]
    assert stack.get_into(["k1", "k2", "k4"], bufs) == [1, 1, None]
    assert [bytes(b) for b in bufs[:2]] == [b"1", b"2"]
    assert mem.get_many(["k1"]) == [b"1"]  # promoted from the buffer, as a copy
    bufs[0][:] = b"z"
    assert mem.get_many(["k1"]) == [b"1"]
    assert stack.put_many([("k5", b"5")]) == 1
    assert red.get_many(["k5"]) == [b"5"] and mem.get_many(["k5"]) == [b"5"]
    stack.close()


def test_make_tier_kinds(redis_server) -> None:
    assert make_tier("none") is None
    assert isinstance(make_tier("memory", 10), MemoryTier)
    stack = make_tier("redis", 10, redis_server.url)
    assert isinstance(stack, TierStack) and [t.name for t in stack.tiers] == ["memory", "redis"]
    with pytest.raises(ValueError, match="redis_url"):
        make_tier("redis")
    with pytest.raises(ValueError, match="unknown"):
        make_tier("disk")


def test_redis_over_a_unix_socket(tmp_path) -> None:
    """A redis-server on the replica's host, reached through its unix socket (no TCP
    port): lookups, writes, GETEX pipelines read straight into buffers, all through a
    unix:// URL."""
    server = RedisServer(unix_socket=tmp_path / "redis.sock").start()
    try:
        assert server.url.startswith("unix://")
        tier = RedisTier(server.url)
        assert tier.put_many([("k1", value(1)), ("k2", value(2))]) == 2
        assert tier.lookup(["k1", "k2", "k3"]) == 2
        bufs = [memoryview(bytearray(len(value(1)))) for _ in range(3)]
        assert tier.get_into(["k1", "k2", "k3"], bufs) == [len(value(1)), len(value(2)), None]
        assert decode(bytes(bufs[0]), 1) == PAYLOAD and decode(bytes(bufs[1]), 2) == PAYLOAD
        assert tier.stats.as_dict()["errors"] == 0
        tier.close()
    finally:
        server.stop()


def test_redis_with_a_password_over_tls(tmp_path) -> None:
    """A real redis-server that speaks only TLS and wants a password: the tier works
    through a rediss:// URL that carries the password and trusts the server's
    certificate. Without TLS, or with a wrong password, every call is a miss (an
    error counted), never an exception."""
    server = RedisServer(password="s3cret", tls_dir=tmp_path).start()
    try:
        assert server.url.startswith("rediss://:s3cret@")
        tier = RedisTier(server.url)
        assert tier.put_many([("k1", value(1))]) == 1
        assert decode(bytes(tier.get_many(["k1"])[0]), 1) == PAYLOAD
        into = memoryview(bytearray(len(value(1))))
        assert tier.get_into(["k1"], [into]) == [len(into)] and decode(bytes(into), 1) == PAYLOAD
        assert tier.stats.as_dict()["errors"] == 0
        tier.close()
        for url in (server.url.replace("rediss://", "redis://").split("?")[0],  # plain TCP
                    server.url.replace(":s3cret@", ":wrong@")):
            bad = RedisTier(url, timeout=2.0)
            assert bad.get_many(["k1"]) == [None] and bad.stats.as_dict()["errors"] == 1
            bad.close()
    finally:
        server.stop()

"""The on-tier format of one KV block: a fixed header, then the raw payload.

    offset size  field
    0      4     magic b"TWKV"
    4      2     format version: 3 (checksummed) or 2 (authenticated, see below)
    6      2     header length (this header's size, so later versions can grow it)
    8      16    dtype name, ASCII, NUL padded ("bfloat16", "float32", ...)
    24     1     number of dimensions (<= 6)
    25     24    shape, 6 x uint32 (unused dimensions 0)
    49     32    model fingerprint (sha256 digest)
    81     32    chain hash of the block (sha256 digest, includes the tenant salt)
    113    8     payload length in bytes
    121    8|32  version 3: XXH3-64 of the payload
                 version 2: HMAC-SHA256 of bytes 0-120 and the payload
    129|153      payload: the bytes of every layer's K and V for the block

All integers little endian. A value whose header, length, fingerprint, chain hash or
checksum does not match what the reader expects is corrupt: the reader treats it as a
miss and deletes it.

Version 3 (no key): XXH3-64 guards against truncation and flipped bytes; identity comes
from the key, a sha256 chain, so whoever can write the tier can also forge a value. (It
replaced version 1's CRC-32, which took 34 ms of a 3,000-token prefix's 69 MB load on
the 2-core test machine against 7.5 ms; a version 1 value is refused like any other
unknown version: a miss, deleted, recomputed.)
Version 2 (a MAC key, from the replicas' shared secret): the MAC covers the fingerprint
and chain hash the value was written for, so without the key a value can be neither
forged nor moved to another key. A reader accepts only its own version: a keyed one
refuses unauthenticated values, an unkeyed one values it cannot check.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct

import numpy as np
import xxhash

MAGIC = b"TWKV"
FORMAT_VERSION = 3  # checksummed (1: the CRC-32 of earlier versions, refused)
MAC_FORMAT_VERSION = 2  # authenticated
_FIELDS = struct.Struct("<4sHH16sB6I32s32sQ")  # everything before the checksum or MAC
_SUM = struct.Struct("<Q")
MAC_SIZE = hashlib.sha256().digest_size
HEADER_SIZE = _FIELDS.size + _SUM.size
MAC_HEADER_SIZE = _FIELDS.size + MAC_SIZE
MAX_DIMS = 6


# (version found, whether the reader has a MAC key) -> why the value is refused
_VERSION_ERRORS = {
    (FORMAT_VERSION, True): "no MAC: written without the kv tier secret",
    (MAC_FORMAT_VERSION, False): "a MAC this reader cannot check: it has no kv tier secret",
    (1, False): "a CRC-32 of an earlier Tidewire's format",
    (1, True): "a CRC-32 of an earlier Tidewire's format",
}


class CorruptValue(ValueError):
    """A stored value that must not be used (and should be deleted)."""


def header_size(mac_key: bytes | None) -> int:
    """The header's size in values written with (or without) a MAC key."""
    return MAC_HEADER_SIZE if mac_key else HEADER_SIZE


def encode_block(fingerprint: bytes, chain_hash: bytes, dtype: str, shape: tuple[int, ...],
                 payload: bytes | memoryview | np.ndarray,
                 mac_key: bytes | None = None) -> memoryview:
    """Header + payload in one new buffer (what the tier stores), as a bytes-like view;
    authenticated with `mac_key` when given, else checksummed.

    The checksum (or MAC) and the payload's copy run without the GIL (xxhash, hashlib
    and numpy release it for large buffers): this runs on the host tier's I/O thread, beside
    an engine thread that needs the GIL for every step."""
    if len(fingerprint) != 32 or len(chain_hash) != 32:
        raise ValueError("fingerprint and chain hash are 32-byte sha256 digests")
    if len(shape) > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dimensions")
    hsize = header_size(mac_key)
    src = np.frombuffer(payload, dtype=np.uint8)
    out = np.empty(hsize + src.size, dtype=np.uint8)
    out[hsize:] = src  # first: fresh pages fault in here, outside the GIL
    dims = list(shape) + [0] * (MAX_DIMS - len(shape))
    version = MAC_FORMAT_VERSION if mac_key else FORMAT_VERSION
    head = _FIELDS.pack(MAGIC, version, hsize, dtype.encode("ascii"), len(shape), *dims,
                        fingerprint, chain_hash, src.size)
    tag = _mac(mac_key, head, src.data) if mac_key else _SUM.pack(xxhash.xxh3_64_intdigest(src.data))
    out[:hsize] = np.frombuffer(head + tag, dtype=np.uint8)
    return out.data


def decode_block(value: bytes | memoryview, fingerprint: bytes, chain_hash: bytes, dtype: str,
                 shape: tuple[int, ...], itemsize: int,
                 mac_key: bytes | None = None) -> memoryview:
    """The payload of a value written for exactly this (fingerprint, chain hash, dtype,
    shape), and with this MAC key (or none); raises CorruptValue for anything else."""
    hsize = _check_header(value, fingerprint, chain_hash, dtype, shape, itemsize, mac_key)
    view = memoryview(value)
    payload = view[hsize:]
    if mac_key:
        if not hmac.compare_digest(_mac(mac_key, view[: _FIELDS.size], payload),
                                   view[_FIELDS.size : hsize]):
            raise CorruptValue("MAC mismatch (forged, or written with another secret)")
    elif xxhash.xxh3_64_intdigest(payload) != _SUM.unpack_from(value, _FIELDS.size)[0]:
        raise CorruptValue("checksum mismatch")
    return payload


def _check_header(value: bytes | memoryview, fingerprint: bytes, chain_hash: bytes, dtype: str,
                  shape: tuple[int, ...], itemsize: int, mac_key: bytes | None) -> int:
    """The header's size, once every field is what the reader expects."""
    hsize = header_size(mac_key)
    if len(value) < hsize:
        raise CorruptValue("shorter than the header")
    (magic, version, vhsize, vdtype, ndim, *rest) = _FIELDS.unpack_from(value)
    dims, (vfp, vhash, length) = rest[:MAX_DIMS], rest[MAX_DIMS:]
    if magic != MAGIC:
        raise CorruptValue("bad magic")
    if version != (MAC_FORMAT_VERSION if mac_key else FORMAT_VERSION):
        raise CorruptValue(_VERSION_ERRORS.get((version, bool(mac_key)), "unknown version"))
    if vhsize != hsize:
        raise CorruptValue("bad header size")
    if vfp != fingerprint or vhash != chain_hash:
        raise CorruptValue("written for another model or block")
    if vdtype.rstrip(b"\0").decode("ascii", "replace") != dtype or ndim != len(shape) \
            or tuple(dims[:ndim]) != tuple(shape):
        raise CorruptValue("dtype or shape differs")
    if length != math.prod(shape) * itemsize or len(value) != hsize + length:
        raise CorruptValue("payload length differs")
    return hsize


def _mac(key: bytes, head: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of the header's fields and the payload (OpenSSL's, which releases the
    GIL for the payload)."""
    h = hmac.new(key, head, hashlib.sha256)
    h.update(payload)
    return h.digest()

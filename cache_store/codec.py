"""The on-tier format of one KV block: a fixed header, then the raw payload.

    offset size  field
    0      4     magic b"TWKV"
    4      2     format version (1)
    6      2     header length (this header's size, so later versions can grow it)
    8      16    dtype name, ASCII, NUL padded ("bfloat16", "float32", ...)
    24     1     number of dimensions (<= 6)
    25     24    shape, 6 x uint32 (unused dimensions 0)
    49     32    model fingerprint (sha256 digest)
    81     32    chain hash of the block (sha256 digest, includes the tenant salt)
    113    8     payload length in bytes
    121    4     CRC-32 of the payload
    125          payload: the bytes of every layer's K and V for the block

All integers little endian. A value whose header, length, fingerprint, chain hash or
checksum does not match what the reader expects is corrupt: the reader treats it as a
miss and deletes it. (CRC-32 guards against truncation and flipped bytes; identity is
already guaranteed by the key, a sha256 chain.)
"""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np

MAGIC = b"TWKV"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHH16sB6I32s32sQI")
HEADER_SIZE = _HEADER.size
MAX_DIMS = 6


class CorruptValue(ValueError):
    """A stored value that must not be used (and should be deleted)."""


def encode_block(fingerprint: bytes, chain_hash: bytes, dtype: str, shape: tuple[int, ...],
                 payload: bytes | memoryview | np.ndarray) -> memoryview:
    """Header + payload in one new buffer (what the tier stores), as a bytes-like view.

    The checksum and the payload's copy run without the GIL (zlib and numpy release it
    for large buffers): this runs on the host tier's I/O thread, beside an engine thread
    that needs the GIL for every step."""
    if len(fingerprint) != 32 or len(chain_hash) != 32:
        raise ValueError("fingerprint and chain hash are 32-byte sha256 digests")
    if len(shape) > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dimensions")
    src = np.frombuffer(payload, dtype=np.uint8)
    out = np.empty(HEADER_SIZE + src.size, dtype=np.uint8)
    out[HEADER_SIZE:] = src  # first: fresh pages fault in here, outside the GIL
    dims = list(shape) + [0] * (MAX_DIMS - len(shape))
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, dtype.encode("ascii"), len(shape),
                          *dims, fingerprint, chain_hash, src.size, zlib.crc32(src.data))
    out[:HEADER_SIZE] = np.frombuffer(header, dtype=np.uint8)
    return out.data


def decode_block(value: bytes | memoryview, fingerprint: bytes, chain_hash: bytes, dtype: str,
                 shape: tuple[int, ...], itemsize: int) -> memoryview:
    """The payload of a value written for exactly this (fingerprint, chain hash, dtype,
    shape); raises CorruptValue for anything else."""
    if len(value) < HEADER_SIZE:
        raise CorruptValue("shorter than the header")
    (magic, version, hsize, vdtype, ndim, *rest) = _HEADER.unpack_from(value)
    dims, vfp, vhash, length, crc = rest[:MAX_DIMS], *rest[MAX_DIMS:]
    if magic != MAGIC or version != FORMAT_VERSION or hsize != HEADER_SIZE:
        raise CorruptValue("bad magic, version or header size")
    if vfp != fingerprint or vhash != chain_hash:
        raise CorruptValue("written for another model or block")
    if vdtype.rstrip(b"\0").decode("ascii", "replace") != dtype or ndim != len(shape) \
            or tuple(dims[:ndim]) != tuple(shape):
        raise CorruptValue("dtype or shape differs")
    if length != math.prod(shape) * itemsize or len(value) != HEADER_SIZE + length:
        raise CorruptValue("payload length differs")
    payload = memoryview(value)[HEADER_SIZE:]
    if zlib.crc32(payload) != crc:
        raise CorruptValue("checksum mismatch")
    return payload

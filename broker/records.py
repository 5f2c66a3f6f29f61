"""The broker's checksummed record on disk, shared by the spill log and the success store:
``MAGIC | kind u8 | length u64 | crc32 u32 | payload``, the CRC over the kind, the length and the payload.

A reader tells a whole record from anything else by its header and its CRC, and finds the next whole record past
bytes that are none (``walk``, ``next_whole``): a torn tail has none after it, bytes changed on disk do.

Records written before 2026-12-05 (magic ``CRL1``) have a CRC over the payload alone, so a kind byte changed on
disk passed (a consumed record turned into a snapshot, and the groups it cancelled came back). They are still read;
every record written since is ``CRL2``.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Sequence

from common.protocol import frame_nbytes

MAGIC = b"CRL2"
"""what every record written starts with: its CRC covers its kind and length too"""
MAGIC_PAYLOAD_CRC = b"CRL1"
"""a record written before the CRC covered its kind and length: read, never written"""
_PREFIX = MAGIC[:3]
HEADER = struct.Struct("<4sBQI")
_KIND_LENGTH = struct.Struct("<BQ")


def _crc(magic: bytes, kind: int, length: int) -> int:
    """The CRC a payload's is chained onto: over the kind and length for ``CRL2``, nothing for ``CRL1``."""
    return zlib.crc32(_KIND_LENGTH.pack(kind, length)) if magic == MAGIC else 0


def record(kind: int, parts: Sequence[Any]) -> list[Any]:
    """The header for ``parts`` (bytes-like, written after it as they are), then the parts."""
    length = sum(frame_nbytes(p) for p in parts)
    crc = _crc(MAGIC, kind, length)
    for p in parts:
        crc = zlib.crc32(p, crc)
    return [HEADER.pack(MAGIC, kind, length, crc), *parts]


def is_magic(magic: bytes) -> bool:
    """Whether a header's first four bytes are a record's, of either version."""
    return magic in (MAGIC, MAGIC_PAYLOAD_CRC)


def holds(header: bytes, payload: bytes) -> bool:
    """Whether a record's header (``HEADER.size`` bytes) and payload are as written: its magic, its length and CRC."""
    magic, kind, length, crc = HEADER.unpack(header)
    return is_magic(magic) and len(payload) == length and zlib.crc32(payload, _crc(magic, kind, length)) == crc


def find_header(data: bytes, start: int, end: int | None = None) -> int:
    """The first offset in ``data[start:end]`` where a record's magic starts (either version), or -1."""
    end = len(data) if end is None else end
    pos = data.find(_PREFIX, start, end)
    while pos != -1 and not is_magic(data[pos:pos + 4]):
        pos = data.find(_PREFIX, pos + 1, end)
    return pos


def whole_end(data: bytes, pos: int, kinds: Sequence[int]) -> int | None:
    """Where the record at ``pos`` ends, if a whole one of ``kinds`` starts there (its header fits, its CRC holds);
    else None. An empty payload's CRC is that of its kind and length alone, and a ``CRL1`` one's is 0: a header zeroed
    past its magic (a hole a crash left in unsynced bytes) could pass. No record is empty, nor of another kind."""
    if len(data) - pos < HEADER.size:
        return None
    magic, kind, length, crc = HEADER.unpack_from(data, pos)
    end = pos + HEADER.size + length
    if (not is_magic(magic) or kind not in kinds or length == 0 or end > len(data)
            or zlib.crc32(memoryview(data)[pos + HEADER.size:end], _crc(magic, kind, length)) != crc):
        return None
    return end


def next_whole(data: bytes, start: int, kinds: Sequence[int]) -> int | None:
    """The first offset at or after ``start`` where a whole record of ``kinds`` starts, or None."""
    pos = find_header(data, start)
    while pos != -1:
        if whole_end(data, pos, kinds) is not None:
            return pos
        pos = find_header(data, pos + 1)
    return None


def walk(data: bytes, kinds: Sequence[int]) -> tuple[list[tuple[int, int, bool]], int]:
    """The stretches of ``data`` in order, ``(start, end, whole)``: whole records of ``kinds``, and the stretches
    between them that are none (bytes changed on disk, or a hole a crash left among unsynced ones); and where a torn
    tail begins, past which no whole record follows (``len(data)`` where there is none)."""
    out: list[tuple[int, int, bool]] = []
    pos = 0
    while pos < len(data):
        end = whole_end(data, pos, kinds)
        if end is not None:
            out.append((pos, end, True))
            pos = end
            continue
        following = next_whole(data, pos + 1, kinds)
        if following is None:
            break
        out.append((pos, following, False))
        pos = following
    return out, pos

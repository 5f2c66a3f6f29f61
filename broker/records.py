"""The broker's checksummed record on disk, shared by the spill log and the success store:
``MAGIC | kind u8 | length u64 | crc32 u32 | payload``.

A reader tells a whole record from anything else by its header and its payload's CRC, and finds the next whole
record past bytes that are none (``walk``, ``next_whole``): a torn tail has none after it, bytes changed on disk do.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Sequence

from common.protocol import frame_nbytes

MAGIC = b"CRL1"
HEADER = struct.Struct("<4sBQI")


def record(kind: int, parts: Sequence[Any]) -> list[Any]:
    """The header for ``parts`` (bytes-like, written after it as they are), then the parts."""
    crc = 0
    length = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
        length += frame_nbytes(p)
    return [HEADER.pack(MAGIC, kind, length, crc), *parts]


def whole_end(data: bytes, pos: int, kinds: Sequence[int]) -> int | None:
    """Where the record at ``pos`` ends, if a whole one of ``kinds`` starts there (its header fits, its CRC holds);
    else None. The CRC covers the payload alone, and an empty payload's is 0: a header zeroed past its magic (a hole a
    crash left in unsynced bytes) would pass. No record is empty, nor of another kind."""
    if len(data) - pos < HEADER.size:
        return None
    magic, kind, length, crc = HEADER.unpack_from(data, pos)
    end = pos + HEADER.size + length
    if (magic != MAGIC or kind not in kinds or length == 0 or end > len(data)
            or zlib.crc32(memoryview(data)[pos + HEADER.size:end]) != crc):
        return None
    return end


def next_whole(data: bytes, start: int, kinds: Sequence[int]) -> int | None:
    """The first offset at or after ``start`` where a whole record of ``kinds`` starts, or None."""
    pos = data.find(MAGIC, start)
    while pos != -1:
        if whole_end(data, pos, kinds) is not None:
            return pos
        pos = data.find(MAGIC, pos + 1)
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

"""Safetensors weight files checked by their own account of their length, without loading them: a model copied in
part, or a checkpoint on a disk that failed, is found before a role or a resume loads it (and crashes on it at
every restart)."""

from __future__ import annotations

import json
from pathlib import Path


def weights_damage(directory: str | Path) -> str:
    """What cuts short a directory's safetensors weights ("<file>: <what>"), "" where each file is as long as its
    header says: a model copied in part, a checkpoint on a disk that failed, found before anything loads them."""
    for f in sorted(Path(directory).glob("*.safetensors")):
        problem = _safetensors_damage(f)
        if problem:
            return f"{f.name}: {problem}"
    return ""


def _safetensors_damage(f: Path) -> str:
    """A safetensors file is an 8-byte header length, a JSON header of every tensor's byte offsets, then the bytes:
    its size must be what the header says."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or n > size - 8:
                return f"truncated ({size} bytes, shorter than its header)"
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        return f"unreadable header ({exc})"
    if 8 + n + end != size:
        return f"{size} bytes where its header says {8 + n + end} (truncated, or copied in part)"
    return ""

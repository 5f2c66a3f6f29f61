"""Screenshots by content hash and where they are kept: what a vision-language run's roles share on disk.

- **Content addressing.** A screenshot is known by the SHA-256 of its encoded bytes (``digest``). A trajectory
  records, per turn, the digests of the images its prompt holds, in order; the bytes never ride in a group.
- **The image store** (``ImageStore``): ``<run>/images/<aa>/<digest>.<ext>``, one file per distinct image, written
  by the actor that first saw it (temporary file, fsync, rename) *before* any group naming it is sent, so a group
  in the broker never references an image that is not durable. Rollouts of a group start from the same screen and
  the sim renders a screen deterministically, so a group's first screenshots are one file; an image crosses from
  the actor to the store once per run, and the learner reads each once into a bounded in-memory cache. The store
  is a directory every role already shares (the run directory: local runs, and Slurm runs on a shared file
  system, where checkpoints and CURVE keys live too).

How images become model inputs is the model side's (``policy/vision.py``).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_EXTENSIONS = {b"\x89PNG": "png", b"\xff\xd8\xff": "jpg"}


def digest(data: bytes) -> str:
    """The content address of an encoded image."""
    return hashlib.sha256(data).hexdigest()


def is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


@dataclass(frozen=True)
class Image:
    """An encoded image (PNG or JPEG bytes, as the desktop sent it) and its content address."""

    digest: str
    data: bytes

    @classmethod
    def of(cls, data: bytes) -> "Image":
        return cls(digest(data), bytes(data))


class ImageStoreError(RuntimeError):
    pass


class ImageStore:
    """Content-addressed images in a directory (see the module docstring); ``memory_items`` bounds the cache."""

    def __init__(self, root: str | Path, memory_items: int = 256):
        self.root = Path(root)
        self.memory_items = memory_items
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._known: set[str] = set()  # digests this process stored or found durable
        self.stats = {"images_written": 0, "bytes_written": 0, "images_deduplicated": 0, "images_read": 0}

    def path(self, dig: str) -> Path:
        if not is_digest(dig):
            raise ImageStoreError(f"not an image digest: {dig!r}")
        return self.root / dig[:2] / dig

    def put(self, image: Image) -> bool:
        """Make ``image`` durable (a no-op when it already is); True when this call wrote it."""
        if image.digest in self._known:
            self.stats["images_deduplicated"] += 1
            return False
        final = self.path(image.digest)
        if final.exists():
            self._known.add(image.digest)
            self.stats["images_deduplicated"] += 1
            return False
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(image.data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)  # two actors writing the same image write the same bytes: either rename wins
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._known.add(image.digest)
        self._remember(image.digest, image.data)
        self.stats["images_written"] += 1
        self.stats["bytes_written"] += len(image.data)
        return True

    def get(self, dig: str) -> bytes:
        if dig in self._cache:
            self._cache.move_to_end(dig)
            return self._cache[dig]
        try:
            data = self.path(dig).read_bytes()
        except FileNotFoundError:
            raise ImageStoreError(f"image {dig[:12]}… is not in the store at {self.root}") from None
        if digest(data) != dig:
            raise ImageStoreError(f"image {dig[:12]}… in {self.root} is corrupt (its bytes hash differently)")
        self.stats["images_read"] += 1
        self._remember(dig, data)
        return data

    def _remember(self, dig: str, data: bytes) -> None:
        self._cache[dig] = data
        self._cache.move_to_end(dig)
        while len(self._cache) > self.memory_items:
            self._cache.popitem(last=False)


def decode_image(data: bytes) -> Any:
    from PIL import Image as PILImage

    return PILImage.open(io.BytesIO(data)).convert("RGB")

"""The image half of a vision-language policy: screenshots by content hash, where they are kept, and how they become
model inputs, the same way on the actor (sampling) and on the learner (scoring).

- **Content addressing.** A screenshot is known by the SHA-256 of its encoded bytes (``digest``). A trajectory
  records, per turn, the digests of the images its prompt holds, in order; the bytes never ride in a group.
- **The image store** (``ImageStore``): ``<run>/images/<aa>/<digest>.<ext>``, one file per distinct image, written
  by the actor that first saw it (temporary file, fsync, rename) *before* any group naming it is sent, so a group
  in the broker never references an image that is not durable. Rollouts of a group start from the same screen and
  the sim renders a screen deterministically, so a group's first screenshots are one file; an image crosses from
  the actor to the store once per run, and the learner reads each once into a bounded in-memory cache. The store
  is a directory every role already shares (the run directory: local runs, and Slurm runs on a shared file
  system, where checkpoints and CURVE keys live too).
- **Model inputs** (``VisionProcessor``): the checkpoint's own image processor (``AutoImageProcessor``), with
  ``model.min_pixels``/``max_pixels`` when set, gives ``pixel_values`` and each image's patch grid; an image takes
  ``prod(grid) / merge_size**2`` placeholder tokens in the prompt ids. Positions are the model's multimodal RoPE
  indices (``get_rope_index``), computed from the ids, the grids and the attention mask. Supported families: those
  with Qwen2-VL's interface (``qwen2_vl``, ``qwen2_5_vl``).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

SUPPORTED_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
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


class VisionProcessor:
    """A VLM checkpoint's image processor and image token ids; the same object serves the actor and the learner."""

    def __init__(self, path: str | Path, min_pixels: int = 0, max_pixels: int = 0, cache_items: int = 64):
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        if config.model_type not in SUPPORTED_FAMILIES:
            raise ValueError(f"model.kind vlm: model type {config.model_type!r} is not supported; supported "
                             f"families: {', '.join(SUPPORTED_FAMILIES)} (Qwen2-VL's image tokens and RoPE index)")
        self.image_processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        if min_pixels or max_pixels:  # the processors read both from ``size`` (shortest/longest edge = min/max pixels)
            saved = self.image_processor.size
            size = {"shortest_edge": min_pixels or int(saved["shortest_edge"]),
                    "longest_edge": max_pixels or int(saved["longest_edge"])}
            self.image_processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True, size=size)
        self.merge = int(getattr(self.image_processor, "merge_size", 2))
        self.image_token_id = int(config.image_token_id)
        # Tokens a policy must never sample (the learner scores with the same columns removed): a placeholder in an
        # action would ask the next forward pass for an image that does not exist.
        self.banned_ids = sorted({int(t) for t in (config.image_token_id, getattr(config, "video_token_id", None),
                                                   getattr(config, "vision_start_token_id", None),
                                                   getattr(config, "vision_end_token_id", None)) if t is not None})
        self._cache: OrderedDict[str, tuple[Any, Any]] = OrderedDict()
        self.cache_items = cache_items

    def pixels(self, image: Image) -> tuple[Any, Any]:
        """(pixel_values [patches, dim], grid_thw [3]) of one image, cached by digest."""
        hit = self._cache.get(image.digest)
        if hit is not None:
            self._cache.move_to_end(image.digest)
            return hit
        out = self.image_processor(images=[decode_image(image.data)], return_tensors="pt")
        hit = (out["pixel_values"], out["image_grid_thw"][0])
        self._cache[image.digest] = hit
        while len(self._cache) > self.cache_items:
            self._cache.popitem(last=False)
        return hit

    def tokens_for(self, image: Image) -> int:
        """Placeholder tokens the image takes in the prompt ids: from its size alone (read from the PNG/JPEG header)
        where the image processor can say (``get_number_of_image_patches``, as vLLM uses it), so building a prompt
        on the actor's event loop never decodes pixels; the engine's ``model_inputs`` checks the count."""
        count = getattr(self.image_processor, "get_number_of_image_patches", None)
        if count is None:
            return int(self.pixels(image)[1].prod()) // (self.merge ** 2)
        from PIL import Image as PILImage

        with PILImage.open(io.BytesIO(image.data)) as header:
            width, height = header.size
        return int(count(height, width)) // (self.merge ** 2)

    def model_inputs(self, model: Any, input_ids: Any, attention_mask: Any,
                     images: Sequence[Sequence[Image]]) -> dict[str, Any]:
        """Keyword inputs of the model's forward pass for a batch whose row r holds ``images[r]`` in order:
        ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids`` and the multimodal ``position_ids``."""
        import torch

        flat = [img for row in images for img in row]
        device = input_ids.device
        mm = (input_ids == self.image_token_id).int()
        parts = [self.pixels(img) for img in flat]
        expected = sum(int(g.prod()) // self.merge ** 2 for _, g in parts)
        if int(mm.sum()) != expected:
            raise ValueError(f"the prompt ids hold {int(mm.sum())} image tokens, their {len(flat)} images take "
                             f"{expected}")
        grid = torch.stack([g for _, g in parts]).to(device) if parts else None
        # Text positions count on across images (a vision_start/vision_end pair separates any two of them);
        # padding gets position 0. A sampled token continues at the row's last position + 1 on all three axes.
        positions, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=mm, image_grid_thw=grid,
                                                  attention_mask=attention_mask)
        if not parts:
            return {"position_ids": positions}
        return {"pixel_values": torch.cat([p for p, _ in parts]).to(device), "image_grid_thw": grid,
                "mm_token_type_ids": mm, "position_ids": positions}

"""The image half of a vision-language policy: how screenshots (``common/images.py``) become model inputs, the same
way on the actor (sampling) and on the learner (scoring).

The checkpoint's own image processor (``AutoImageProcessor``), with ``model.min_pixels``/``max_pixels`` when set,
gives ``pixel_values`` and each image's patch grid; an image takes ``prod(grid) / merge_size**2`` placeholder tokens
in the prompt ids. Positions are the model's multimodal RoPE indices (``get_rope_index``), computed from the ids,
the grids and the attention mask. Supported families: those with Qwen2-VL's interface (``qwen2_vl``,
``qwen2_5_vl``).

Processing a screenshot costs tens of milliseconds of CPU (decoding the PNG, resizing, normalising, cutting
patches: 35 ms for 1280x800 at about a megapixel, 85 ms for 1920x1080 at the processor's full size, measured here),
so it runs on threads of its own (``model.image_workers``; the C parts let go of the GIL): all of a batch's images
at once, and on an actor from the moment a turn is submitted, so the engine's thread finds them done.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from common.images import Image, decode_image
from policy.staging import host_to_device

SUPPORTED_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
"""model types whose image tokens and RoPE index follow Qwen2-VL's interface"""

class VisionProcessor:
    """A VLM checkpoint's image processor and image token ids; the same object serves the actor and the learner."""

    def __init__(self, path: str | Path, min_pixels: int = 0, max_pixels: int = 0, cache_items: int = 64,
                 workers: int = 4):
        from transformers import AutoConfig
        # from its module, not ``transformers``: transformers 5.17's top-level name is a placeholder that demands
        # torchvision, while the class itself falls back to the PIL processor where torchvision is missing
        from transformers.models.auto.image_processing_auto import AutoImageProcessor

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
        self.workers = workers
        self._pool: cf.ThreadPoolExecutor | None = None  # started by the first prefetch
        self._pool_pid = 0  # the process that started it: a forked child has none of its threads
        self._pending: dict[str, cf.Future] = {}  # digest -> its processing, under way on a worker
        self._lock = threading.Lock()  # the cache and the pending map: the caller's thread and the workers'

    def prefetch(self, images: Iterable[Image]) -> None:
        """Start processing each of ``images`` not cached or under way, on the worker threads (none with
        ``workers`` 0); ``pixels`` then waits for it rather than processing it again."""
        self._queue((image.digest, lambda image=image: image) for image in images)

    def prefetch_stored(self, digests: Iterable[str], read: Callable[[str], bytes]) -> None:
        """``prefetch`` for images known by their digests, each read with ``read`` (an image store's ``get``) on the
        worker too, so the caller's thread does no file reading. One that cannot be read is left uncached: whoever
        needs it reads it again, and reports it."""
        self._queue((digest, lambda digest=digest: Image(digest, read(digest))) for digest in digests)

    def _queue(self, loads: Iterable[tuple[str, Callable[[], Image]]]) -> None:
        if not self.workers:
            return
        with self._lock:
            for digest, load in loads:
                if digest in self._cache or digest in self._pending:
                    continue
                if self._pool is None or self._pool_pid != os.getpid():
                    self._pool = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="image-processor")
                    self._pool_pid, self._pending = os.getpid(), {}
                try:
                    self._pending[digest] = self._pool.submit(self._process, digest, load)
                except RuntimeError:  # the interpreter is shutting down: ``pixels`` processes it where it is needed
                    return

    def _process(self, digest: str, load: Callable[[], Image]) -> tuple[Any, Any]:
        try:
            out = self.image_processor(images=[decode_image(load().data)], return_tensors="pt")
            hit = (out["pixel_values"], out["image_grid_thw"][0])
            with self._lock:
                self._cache[digest] = hit
                while len(self._cache) > self.cache_items:
                    self._cache.popitem(last=False)
            return hit
        finally:
            with self._lock:
                self._pending.pop(digest, None)

    def pixels(self, image: Image) -> tuple[Any, Any]:
        """(pixel_values [patches, dim], grid_thw [3]) of one image, cached by digest (a processing under way on a
        worker is waited for; one that failed raises here, where the image is needed). One still queued behind
        others (a learner's next batch, set processing ahead) is taken back and processed here: what is needed now
        never waits behind what is needed later."""
        with self._lock:
            hit = self._cache.get(image.digest)
            if hit is not None:
                self._cache.move_to_end(image.digest)
                return hit
            pending = self._pending.get(image.digest)
            if pending is not None and pending.cancel():
                del self._pending[image.digest]
                pending = None
        return pending.result() if pending is not None else self._process(image.digest, lambda: image)

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
                     images: Sequence[Sequence[Image]], device: Any = None) -> dict[str, Any]:
        """Keyword inputs of the model's forward pass for a batch whose row r holds ``images[r]`` in order:
        ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids`` and the multimodal ``position_ids``, on ``device``
        (default: the ids').

        Worked out on the host, from host copies of the ids and mask (pass them so: counting image tokens and the
        position index's per-row loops read values, which on a GPU would make the host wait for it), and put on a
        GPU from pinned memory without waiting: an engine's VLM prefill then queues like a text model's."""
        import torch

        device = torch.device(device if device is not None else input_ids.device)
        ids, mask = input_ids.cpu(), attention_mask.cpu()
        flat = [img for row in images for img in row]
        mm = (ids == self.image_token_id).int()
        self.prefetch(flat)  # every image at once, then each as it is done
        parts = [self.pixels(img) for img in flat]
        expected = sum(int(g.prod()) // self.merge ** 2 for _, g in parts)
        if int(mm.sum()) != expected:
            raise ValueError(f"the prompt ids hold {int(mm.sum())} image tokens, their {len(flat)} images take "
                             f"{expected}")
        grid = torch.stack([g for _, g in parts]) if parts else None
        # Text positions count on across images (a vision_start/vision_end pair separates any two of them);
        # padding gets position 0. A sampled token continues at the row's last position + 1 on all three axes.
        positions, _ = model.model.get_rope_index(ids, mm_token_type_ids=mm, image_grid_thw=grid, attention_mask=mask)
        out = {"position_ids": positions}
        if parts:
            out.update(pixel_values=torch.cat([p for p, _ in parts]), image_grid_thw=grid, mm_token_type_ids=mm)
        return {k: host_to_device(v, device) for k, v in out.items()}

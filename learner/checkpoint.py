"""Atomic checkpoints: HF-format safetensors weights, optimizer, scheduler, RNG and trainer state.

``<run>/checkpoints/step-<version>/`` is written into a temporary sibling and renamed into place, and
``latest`` is replaced atomically after it, so a kill at any moment leaves the previous checkpoint intact. Its
``checksums.json`` holds every file's length and CRC32 as written, so a resume finds bytes changed since (a failing
disk, a bad copy) before it trains on them.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from policy.weight_files import weights_damage

TRAINER_FILE = "trainer.pt"
STATE_FILE = "state.json"
CHECKSUMS_FILE = "checksums.json"
_READ_CHUNK = 16 << 20


class StorageRefused(OSError):
    """A checkpoint the file system refused (full, over quota, failing), as an OSError whichever library wrote it.
    torch.save reports a full disk as a RuntimeError ("unexpected pos"), safetensors as a SafetensorError naming the
    OS error; the learner counts a refused save and trains on (``learner/process.py``), so it must see one as such,
    while a bug in the save still raises as itself."""


class _WriteRecorder:
    """The file torch.save writes through, keeping the OSError of a write that failed (torch's zip writer turns it
    into an "unexpected pos" RuntimeError), and the length and CRC32 of what it wrote: it only appends (it is given
    no ``seek``), so those are the file's, and the optimizer's bytes, most of a checkpoint, are not read back."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None
        self.length = 0
        self.crc = 0

    def write(self, data: Any) -> int:
        try:
            n = self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.crc = zlib.crc32(data, self.crc)
        self.length += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as exc:
            self.error = exc
            raise


_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")
"""how Rust's std::io::Error ends its message (safetensors: "I/O error: No space left on device (os error 28)")"""


def storage_error(exc: BaseException, recorded: OSError | None = None) -> OSError | None:
    """The file system's error behind a failed write, or None where nothing says it was the file system: the
    exception itself or one it was raised from, what a ``_WriteRecorder`` kept, or an OS error number in its text."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError):
            return cur
        match = _OS_ERROR_IN_TEXT.search(str(cur))
        if match:
            code = int(match.group(1))
            return OSError(code, os.strerror(code))
        cur = cur.__cause__ or cur.__context__
    return recorded


def _length_and_crc(path: Path) -> tuple[int, int]:
    """A file's length and CRC32, read in chunks (zlib releases the GIL over each)."""
    crc, length = 0, 0
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            length += n
    return length, crc


def contents_damage(path: Path, with_trainer: bool = True) -> str:
    """The first file of checkpoint ``path`` whose bytes are not those written (``checksums.json``), "" where every
    one is (or the checkpoint predates checksums: nothing to compare with). Reads every byte: a resume, which reads
    them all anyway, checks them; a look at a run does not. Without ``with_trainer``, ``trainer.pt`` is left out."""
    try:
        listed = json.loads((path / CHECKSUMS_FILE).read_text())["crc32"]
        files = sorted((str(name), int(size), int(crc)) for name, (size, crc) in listed.items())
    except FileNotFoundError:
        return ""
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{CHECKSUMS_FILE}: unreadable ({exc})"
    for name, size, crc in files:
        if name == TRAINER_FILE and not with_trainer:
            continue
        try:
            got_size, got_crc = _length_and_crc(path / name)
        except OSError as exc:
            return f"{name}: {exc.strerror or exc}"
        if got_size != size:
            return f"{name}: {got_size} bytes where {size} were written"
        if got_crc != crc:
            return f"{name}: its bytes changed since they were written (CRC32 {got_crc:08x}, written {crc:08x})"
    return ""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_dir(final: Path, model: Any, weights: dict, state: dict, trainer: dict | None, tokenizer: Any) -> Path:
    """HF config + safetensors + state.json (+ trainer.pt, + a Hugging Face tokenizer's files) written into a
    temporary sibling, synced, then renamed over ``final``: a kill at any moment leaves either the old directory
    or the new one."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    recorder: _WriteRecorder | None = None
    try:
        model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        if trainer is not None:
            with open(tmp / TRAINER_FILE, "wb") as fh:
                recorder = _WriteRecorder(fh)
                torch.save(trainer, recorder)
        if hasattr(tokenizer, "save_pretrained"):  # the byte tokenizer has no files
            tokenizer.save_pretrained(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(state))
        # The weights read back from the page cache (safetensors writes them itself), ~1.5 GB/s here; the trainer
        # state summed as it was written.
        written = {TRAINER_FILE: (recorder.length, recorder.crc)} if recorder is not None else {}
        sums = {f.name: list(written.get(f.name) or _length_and_crc(f)) for f in sorted(tmp.iterdir())}
        (tmp / CHECKSUMS_FILE).write_text(json.dumps({"crc32": sums}))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    except BaseException as exc:
        # A half-written checkpoint (a full disk) would hold the space the next try needs.
        shutil.rmtree(tmp, ignore_errors=True)
        refused = storage_error(exc, recorder.error if recorder else None) if isinstance(exc, Exception) else None
        if refused is None or isinstance(exc, StorageRefused):
            raise
        code = refused.errno or errno.EIO
        raise StorageRefused(code, f"{final.name} not written to {final.parent}: {refused.strerror or refused} "
                                   f"({type(exc).__name__}: {str(exc)[:200]})") from exc
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def save(root: Path, version: int, model: Any, weights: dict, optimizer_state: dict, scheduler: Any, state: dict,
         keep: int = 3, tokenizer: Any = None) -> Path:
    """Write one checkpoint from full (unsharded) state dicts; ``model`` supplies the HF config.

    The optimizer state is keyed by parameter name, so a checkpoint resumes on any number of learner ranks.
    """
    trainer = {"optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
               "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}}
    final = _write_dir(root / f"step-{version:08d}", model, weights, {"version": version, **state}, trainer,
                       tokenizer)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    # The one just written is never rotated out, whatever its name sorts after: a run resumed from an older checkpoint
    # by hand (latest pointed back past later ones) writes lower versions than those, and with keep 1 the rotation
    # deleted each checkpoint as it was written, leaving latest naming nothing.
    others = sorted(p for p in root.glob("step-*") if p.is_dir() and p != final)
    for old in (others[:max(0, len(others) - (keep - 1))] if keep > 0 else []):
        shutil.rmtree(old, ignore_errors=True)
    return final


def export_policy(out: Path, model: Any, weights: dict, state: dict, tokenizer: Any = None) -> Path:
    """A weights-only policy directory (HF config + safetensors + state.json) for ``model.path`` and
    ``computerrl eval``: no optimizer state, so small enough to ship; replaced atomically."""
    return _write_dir(Path(out), model, weights, state, None, tokenizer)


def latest(root: Path) -> Path | None:
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / STATE_FILE).exists() else None


class CheckpointDamaged(ValueError):
    """A checkpoint a resume cannot read (truncated, half copied): the learner would crash on it at every restart."""


def damage(path: Path, with_trainer: bool = True, contents: bool = False) -> str:
    """What makes checkpoint ``path`` unreadable, "" where nothing is seen. Read from the parts of each file that say
    how long it must be (a safetensors header's offsets, a zip's central directory), not by loading it: a resume
    finds a truncated or half-copied checkpoint before a learner starts. A bit flipped inside a tensor is seen only
    with ``contents`` (``contents_damage``: every byte read against its checksum)."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        return f"{STATE_FILE}: {exc}"
    if not isinstance(state, dict) or (with_trainer and not isinstance(state.get("version"), int)):
        return f"{STATE_FILE} holds no version"  # (an export, read without its trainer, may record none)
    if not any(path.glob("*.safetensors")):
        return "no weights (*.safetensors)"
    problem = weights_damage(path)
    if problem:
        return problem
    if with_trainer:
        try:
            with zipfile.ZipFile(path / TRAINER_FILE) as z:
                if not any(n.endswith("/data.pkl") for n in z.namelist()):
                    return f"{TRAINER_FILE}: no data.pkl in it"
        except (OSError, zipfile.BadZipFile) as exc:
            return f"{TRAINER_FILE}: {exc}"
    return contents_damage(path, with_trainer) if contents else ""


def check_whole(path: Path, contents: bool = False) -> None:
    """Raise ``CheckpointDamaged`` when checkpoint ``path`` cannot be resumed from, naming what is wrong and the
    newest whole checkpoint before it, with the two commands that make a resume go on from that one. ``contents``:
    every byte checked against its checksum too (``damage``), the earlier one named included."""
    problem = damage(path, contents=contents)
    if problem:
        raise CheckpointDamaged(f"checkpoint {path} is damaged: {problem}; a resume cannot read it. "
                                f"{_go_on_before(path.parent, path.name, set_aside=path, contents=contents)}")


def resume_point(root: Path, contents: bool = False) -> Path | None:
    """The checkpoint in ``root`` a resume goes on from: None where none was written (no ``latest``). Raises
    ``CheckpointDamaged`` where it cannot: the one ``latest`` names is damaged, or not there (removed or moved by
    hand). ``latest`` alone read that as no checkpoint, so a resume started from scratch beside the older ones, or
    was refused with the advice to start a new run there, whose checkpoints the rotation would then delete.
    ``contents``: its bytes checked against their checksums too (the learner's resume; ``check_whole``)."""
    pointer = root / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not (path / STATE_FILE).exists():
        raise CheckpointDamaged(f"{pointer} names {name or 'nothing'}, which is not there (removed or moved?); a "
                                f"resume cannot go on from it. {_go_on_before(root, name or '~', contents=contents)}")
    check_whole(path, contents)
    return path


def _go_on_before(root: Path, name: str, set_aside: Path | None = None, contents: bool = False) -> str:
    """What to do when checkpoint ``name`` in ``root`` cannot be resumed from: the newest whole one before it, and the
    commands that point ``latest`` at it (moving ``set_aside``, the damaged one, out of the way first)."""
    earlier = sorted((p for p in root.glob("step-*") if p.is_dir() and p.name < name), reverse=True)
    whole = next((p for p in earlier if (p / STATE_FILE).exists() and not damage(p, contents=contents)), None)
    if whole is None:
        return "No checkpoint before it is whole: start the run again in another --run-dir."
    move = f"mv {set_aside} {root / ('damaged-' + set_aside.name)} && " if set_aside is not None else ""
    return (f"The newest whole one is {whole.name}. To go on from there, "
            f"{'move the damaged one aside and ' if set_aside is not None else ''}point latest at it: "
            f"{move}echo {whole.name} > {root / 'latest'} (the steps after {whole.name} are lost from the model; "
            "their groups, which the broker forgot at the later checkpoint, are not trained again, and computerrl "
            "audit, which reads the trail, still counts them trained)")


def read(path: Path, model: Any, with_trainer: bool, weights: bool = True) -> tuple[dict, dict | None, dict]:
    """(full weights, optimizer/scheduler/RNG blob or None, trainer state) of a checkpoint, checked against
    the model's parameter names (only weights tied to the embedding may be missing).

    ``weights`` False (a learner rank other than 0, which receives its shards from rank 0): no weights are read, and
    the blob is mapped rather than read (``torch.load(mmap=True)``), so its optimizer tensors, which the caller does
    not touch, never take host memory; its scheduler and RNG states are read as usual."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    if weights:
        for f in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        expected = set(model.state_dict())
        missing, unexpected = expected - set(tensors), set(tensors) - expected
        tied = {n for n in missing if "lm_head" in n and getattr(model.config, "tie_word_embeddings", False)}
        if missing - tied or unexpected:
            raise ValueError(f"checkpoint {path} does not fit the model: missing {sorted(missing - tied)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
    blob = torch.load(path / TRAINER_FILE, weights_only=False, mmap=not weights) if with_trainer else None
    return tensors, blob, json.loads((path / STATE_FILE).read_text())


def restore_rng(blob: dict) -> None:
    torch.set_rng_state(blob["rng"]["torch"])
    np.random.set_state(blob["rng"]["numpy"])
    random.setstate(blob["rng"]["python"])

"""Store of successful trajectories per task, served to the learner for Entropulse SFT phases.

De-duplicated per task by the sampled tokens (two identical solutions teach nothing twice). Bounded:
``per_task`` newest solutions per task, ``max_tasks`` tasks (the task least recently added to goes first).
With persistence on, additions are appended to ``success.log`` and reloaded on restart; the file is
rewritten compactly when it grows past twice its live content. The store is best-effort (acked groups live in the
spill log): a write that fails (a full disk) is counted and logged, the file is let go, and the whole store is
rewritten from memory once a retry succeeds, so no record follows a torn one. Records carry a checksum
(``broker/records.py``): one changed on disk is dropped on load, never imitated as a success.
"""

from __future__ import annotations

import collections
import hashlib
import os
import random
import struct
import time
from pathlib import Path
from typing import Any


from broker.records import HEADER, is_magic, record, walk
from common import protocol as P
from common.appendfile import close_quietly

_LEN = struct.Struct("<II")  # header length, number of frames
KIND_SUCCESS = 4
"""the store's record kind (``broker/records.py``): its payload is one encoded SuccessBatch, ``_LEN``, the frames'
lengths, the frames. A file of records starts with the record magic; one without it was written before 2026-12-04,
the same payloads back to back with no checksum, and is read as such once (the store rewrites its file at start)."""
_KINDS = (KIND_SUCCESS,)
REWRITE_RETRY_S = 10.0  # after a failed write, how often the rewrite from memory is tried again


def solution_key(traj: P.Trajectory) -> bytes:
    return hashlib.blake2b(traj.output_ids.tobytes() + traj.output_lens.tobytes(), digest_size=16).digest()


class SuccessStore:
    def __init__(self, per_task: int, max_tasks: int, path: str | Path | None, log: Any):
        self.per_task, self.max_tasks = per_task, max_tasks
        self.tasks: collections.OrderedDict[str, collections.OrderedDict[bytes, P.Trajectory]] = collections.OrderedDict()
        self.path = Path(path) if path is not None else None
        self.log = log
        self.added = 0
        self.duplicates = 0
        self._count = 0  # trajectories held: kept as they come and go, since every append compares against it
        self._file_records = 0
        self._f = None
        self.write_failures = 0
        self._rewrite_at: float | None = None  # set after a failed write: when to try rewriting the file
        if self.path is not None:
            if self.path.exists():
                self._load()
            self._guarded(self._compact)

    def __len__(self) -> int:
        return self._count

    def add(self, task_id: str, traj: P.Trajectory, persist: bool = True) -> bool:
        """Keep a copy of a successful trajectory; False if the task already has this exact solution."""
        key = solution_key(traj)
        sols = self.tasks.get(task_id)
        if sols is not None and key in sols:
            self.duplicates += 1
            return False
        if sols is None:
            sols = self.tasks[task_id] = collections.OrderedDict()
        self.tasks.move_to_end(task_id)
        # Kept as decoded, no copy: a large array is a view of its own network frame (the codec gives every
        # array of 64 KiB or more a frame of its own), so holding it pins nothing else; small ones own their bytes.
        sols[key] = traj
        self._count += 1
        while len(sols) > self.per_task:
            sols.popitem(last=False)
            self._count -= 1
        while len(self.tasks) > self.max_tasks:
            self._count -= len(self.tasks.popitem(last=False)[1])
        self.added += 1
        if persist and self._f is not None:
            self._guarded(lambda: self._append(task_id, sols[key]))
        elif persist and self._rewrite_at is not None and time.monotonic() >= self._rewrite_at:
            self._guarded(self._compact)  # (holds this addition too)
        return True

    def sample(self, k_per_task: int, max_tasks: int, seed: int) -> list[P.SuccessSample]:
        rng = random.Random(seed)
        task_ids = list(self.tasks)
        rng.shuffle(task_ids)
        if max_tasks > 0:
            task_ids = task_ids[:max_tasks]
        out = []
        for tid in task_ids:
            sols = list(self.tasks[tid].values())
            for traj in rng.sample(sols, min(k_per_task, len(sols))):
                out.append(P.SuccessSample(task_id=tid, trajectory=traj))
        return out

    def newest_fresh(self, task_id: str, scope: str, min_version: int) -> P.Trajectory | None:
        """The newest stored success a model sampled, every token at ``min_version`` or later: of ``task_id``
        itself (``scope`` "task"), or of any task sharing its suite prefix, the id before its last '/' (``scope``
        "family": under curation that prefix names one family)."""
        if scope == "task":
            return next(self._fresh(self.tasks.get(task_id, {}), min_version), None)
        prefix = task_id.rpartition("/")[0]
        for tid, sols in reversed(self.tasks.items()):
            newest = next(reversed(sols.values()))
            if len(newest.versions) and int(newest.versions.max()) < min_version:
                # Tasks are kept in the order solutions arrived, so the rest are older still (bar a straggler from
                # a stale group): the scan stops here instead of walking every task the store holds.
                return None
            if tid.rpartition("/")[0] == prefix:
                found = next(self._fresh(sols, min_version), None)
                if found is not None:
                    return found
        return None

    @staticmethod
    def _fresh(sols: dict, min_version: int):
        # an explored success (workflow exploration) has no behaviour log-probs to correct a replay with
        return (t for t in reversed(sols.values())
                if t.sampled and len(t.versions) and int(t.versions.min()) >= min_version)

    # ----- persistence -----------------------------------------------------------------------

    def _append(self, task_id: str, traj: P.Trajectory) -> None:
        frames = P.encode(P.SuccessBatch(samples=[P.SuccessSample(task_id=task_id, trajectory=traj)]))
        bufs = [memoryview(f).cast("B") for f in frames]  # numpy frames are written as they are, no copy
        lengths = (_LEN.pack(len(bufs[0]), len(bufs) - 1)
                   + struct.pack(f"<{len(bufs) - 1}Q", *(b.nbytes for b in bufs[1:])))
        for part in record(KIND_SUCCESS, [lengths, *bufs]):
            self._f.write(part)
        self._file_records += 1
        if self._file_records > 2 * max(len(self), 64):
            self._compact()

    def _load(self) -> None:
        data = self.path.read_bytes()
        batches, damaged, tail = (_checked_batches if is_magic(data[:4]) else _unchecked_batches)(data)
        loaded = 0
        for msg in batches:
            for s in msg.samples:
                self.add(s.task_id, s.trajectory, persist=False)
                loaded += 1
        if damaged:  # changed on disk: dropped, not trained on as a success it no longer is
            self.log.error("success_store_records_damaged", records=damaged, path=str(self.path))
        if tail:
            self.log.warning("success_store_tail_dropped", bytes=tail)
        self.log.info("success_store_loaded", trajectories=len(self), tasks=len(self.tasks), records=loaded)

    def _compact(self) -> None:
        self._let_go()
        tmp = self.path.with_suffix(".tmp")
        self._f = open(tmp, "wb")
        self._file_records = 0
        for tid, sols in self.tasks.items():
            for traj in sols.values():
                self._append(tid, traj)
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        os.replace(tmp, self.path)
        self._f = open(self.path, "ab", buffering=1 << 20)

    def _guarded(self, write) -> None:
        """``write`` to the file; on failure, let the file go and rewrite it whole later."""
        try:
            write()
            self._rewrite_at = None
        except OSError as exc:
            self.write_failures += 1
            self._let_go()
            self._rewrite_at = time.monotonic() + REWRITE_RETRY_S
            self.log.error("success_store_write_failed", path=str(self.path), error=repr(exc),
                           retry_in_s=REWRITE_RETRY_S, failures=self.write_failures)

    def _let_go(self) -> None:
        f, self._f = self._f, None
        close_quietly(f)

    def flush(self) -> None:
        """The store is best-effort state (acked groups live in the spill log): flushed per loop turn."""
        if self._f is not None:
            self._guarded(self._f.flush)

    def close(self) -> None:
        self.flush()  # (a failure is counted and logged like any other write's)
        self._let_go()


def _batch_at(data: Any, pos: int) -> tuple[P.SuccessBatch, int]:
    """The SuccessBatch whose payload starts at ``pos`` and where it ends; raises ``struct.error`` or
    ``P.ProtocolError`` where it is cut short or does not decode."""
    hlen, nframes = _LEN.unpack_from(data, pos)
    p = pos + _LEN.size
    lens = struct.unpack_from(f"<{nframes}Q", data, p)
    p += 8 * nframes
    frames = [data[p:p + hlen]]
    p += hlen
    for n in lens:
        frames.append(data[p:p + n])
        p += n
    if p > len(data):
        raise struct.error("record cut short")
    return P.decode(frames, max_bytes=None), p


def _checked_batches(data: bytes) -> tuple[list[P.SuccessBatch], int, int]:
    """(batches, damaged records, torn tail bytes) of a file of checksummed records (``broker/records.py: walk``):
    a stretch that is no whole record, or one whose content does not decode, is a damaged record (skipped)."""
    out, damaged = [], 0
    stretches, tail = walk(data, _KINDS)
    for start, end, whole in stretches:
        if not whole:
            damaged += 1
            continue
        try:
            msg, used = _batch_at(data, start + HEADER.size)  # (frames copied out of data: nothing pins the file)
            if used != end:
                raise struct.error("payload and record lengths differ")
            out.append(msg)
        except (struct.error, P.ProtocolError):
            damaged += 1
    return out, damaged, len(data) - tail


def _unchecked_batches(data: bytes) -> tuple[list[P.SuccessBatch], int, int]:
    """The same for a file written before records had checksums: payloads back to back, read up to the first that
    does not decode (the rest is taken for a torn tail: nothing tells where the next one starts)."""
    out, pos = [], 0
    while pos + _LEN.size <= len(data):
        try:
            msg, pos_next = _batch_at(data, pos)
        except (struct.error, P.ProtocolError):
            break
        out.append(msg)
        pos = pos_next
    return out, 0, len(data) - pos

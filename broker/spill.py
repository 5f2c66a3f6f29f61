"""Durable spill log for trajectory groups.

Segments ``seg-<n>.log`` hold records ``MAGIC | kind u8 | length u64 | crc32 u32 | payload``:

- GROUP: one encoded TrajectoryGroup, frames stored verbatim (no re-encoding);
- CONSUMED: ids of groups delivered to the learner or dropped — they must never be delivered again;
- SNAPSHOT: first record of every segment: recently seen group ids (de-duplication survives the deletion
  of old segments) and small broker state (restart count, tickets issued).

With ``persist`` on, appends are fsynced before the caller acks (one fsync per batch of appends: group
commit). Recovery replays the segments in order; a torn record at the tail of a segment (a ``kill -9``
mid-write) is cut off, which is safe because its group was never acked. Segments are deleted oldest first,
once every group in them is consumed, so a CONSUMED record can never outlive the GROUP it cancels.
With ``persist`` off the log is only where groups wait when memory is full; it is wiped on start.
"""

from __future__ import annotations

import collections
import os
import queue
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import msgpack

from common.protocol import frame_buffer, frame_nbytes

MAGIC = b"CRL1"
_HDR = struct.Struct("<4sBQI")
_U32 = struct.Struct("<I")
KIND_GROUP, KIND_CONSUMED, KIND_SNAPSHOT = 1, 2, 3
_IOV_MAX = 512


def _segment_name(seg: int) -> str:
    return f"seg-{seg:08d}.log"


def _segments(directory: Path) -> list[int]:
    """Numbers of the segment files in ``directory``, oldest first."""
    return sorted(int(p.stem.split("-")[1]) for p in directory.glob("seg-*.log"))


@dataclass(frozen=True)
class Location:
    segment: int
    offset: int  # of the record header
    length: int  # of the payload


@dataclass
class Recovered:
    groups: list[tuple[str, Location]] = field(default_factory=list)
    recent_ids: list[str] = field(default_factory=list)
    state: dict = field(default_factory=dict)
    truncated_bytes: int = 0
    corrupt_segments: list[int] = field(default_factory=list)


class SpillLog:
    def __init__(self, directory: str | Path, persist: bool, segment_bytes: int, log: Any):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.persist = persist
        self.segment_bytes = segment_bytes
        self.log = log
        self.live: collections.Counter[int] = collections.Counter()
        self.segments: list[int] = []
        self._fd: int | None = None
        self._active = 0
        self._size = 0
        self.fsyncs = 0
        self.bytes_written = 0
        self.lock = threading.RLock()  # the commit thread appends while the loop reads and marks
        if not persist:
            for p in self.dir.glob("seg-*.log"):
                p.unlink()

    # ----- files -----------------------------------------------------------------------------

    def _path(self, seg: int) -> Path:
        return self.dir / _segment_name(seg)

    def open(self, recent_ids: Sequence[str], state: dict) -> None:
        """Start a fresh active segment (after recovery, or on first start)."""
        self.segments = _segments(self.dir)
        self._rotate(recent_ids, state)

    def _rotate(self, recent_ids: Sequence[str], state: dict) -> None:
        if self._fd is not None:
            if self.persist:
                # The commit thread may have written a round it has not synced yet (write and sync overlap).
                os.fdatasync(self._fd)
            os.close(self._fd)
        self._active = (self.segments[-1] + 1) if self.segments else 1
        self.segments.append(self._active)
        self._fd = os.open(self._path(self._active), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._size = 0
        self._write([self._record(KIND_SNAPSHOT, [msgpack.packb({"recent_ids": list(recent_ids), "state": state})])])
        if self.persist:
            self._sync(dir_too=True)

    def close(self) -> None:
        if self._fd is not None:
            if self.persist:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    # ----- writing ---------------------------------------------------------------------------

    @staticmethod
    def _record(kind: int, parts: Sequence[Any]) -> list[Any]:
        crc = 0
        length = 0
        for p in parts:
            crc = zlib.crc32(p, crc)
            length += frame_nbytes(p)
        return [_HDR.pack(MAGIC, kind, length, crc), *parts]

    def _write(self, records: list[list[Any]]) -> list[int]:
        """Append records; returns each record's offset in the active segment."""
        offsets = []
        iov: list[Any] = []
        for rec in records:
            offsets.append(self._size)
            self._size += sum(frame_nbytes(p) for p in rec)
            iov.extend(rec)
        for i in range(0, len(iov), _IOV_MAX):
            chunk = iov[i:i + _IOV_MAX]
            want = sum(frame_nbytes(p) for p in chunk)
            done = os.writev(self._fd, chunk)
            if done < want:
                self._finish_short_write(chunk, done)
            self.bytes_written += want
        return offsets

    def _finish_short_write(self, parts: list[Any], done: int) -> None:
        """writev may stop early (signals, odd filesystems): write what is left, part by part."""
        for p in parts:
            view = memoryview(p).cast("B")
            if done >= view.nbytes:
                done -= view.nbytes
                continue
            view = view[done:]
            done = 0
            while view.nbytes:
                view = view[os.write(self._fd, view):]

    def _sync(self, dir_too: bool = False) -> None:
        # fdatasync also flushes the file size, which is all a reader of appended records needs.
        os.fdatasync(self._fd)
        self.fsyncs += 1
        if dir_too:
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def maybe_rotate(self, snapshot: Callable[[], tuple[Sequence[str], dict]]) -> None:
        """Start a new segment once the active one is full (called from the broker's loop). ``snapshot`` gives the
        recent group ids and state the new segment starts with; it is called only then (it copies the dedupe
        window, up to hundreds of thousands of ids, which every loop turn could not afford)."""
        with self.lock:
            if self._size >= self.segment_bytes:
                self._rotate(*snapshot())

    def append_groups(self, items: Sequence[tuple[str, Sequence[Any]]], sync: bool | None = None) -> list[Location]:
        """Append groups (id, frames); durable on return when persisting (one fdatasync for all)."""
        with self.lock:
            return self._append_groups(items, sync)

    def _append_groups(self, items, sync) -> list[Location]:
        records = []
        lengths = []
        for group_id, frames in items:
            bufs = [frame_buffer(f) for f in frames]
            meta = msgpack.packb([group_id, [frame_nbytes(b) for b in bufs]])
            parts = [_U32.pack(len(meta)), meta, *bufs]
            records.append(self._record(KIND_GROUP, parts))
            lengths.append(sum(frame_nbytes(p) for p in parts))
        offsets = self._write(records)
        if self.persist if sync is None else sync:
            self._sync()
        self.live[self._active] += len(items)
        return [Location(self._active, off, n) for off, n in zip(offsets, lengths)]

    def mark_consumed(self, group_ids: Sequence[str], locations: Sequence[Location | None], state: dict,
                      sync: bool = True) -> None:
        """Record that these groups are gone for good (delivered or dropped), then free their segments; with none,
        record the state alone."""
        with self.lock:
            self._mark_consumed(group_ids, locations, state, sync)

    def sync(self) -> None:
        with self.lock:
            self._sync()

    def sync_written(self) -> None:
        """Make everything written so far durable without holding the lock during the disk flush.

        The commit thread keeps appending the next round meanwhile. A duplicate descriptor keeps the
        file open if the loop rotates segments during the flush; rotation syncs the old segment itself.
        """
        with self.lock:
            fd = os.dup(self._fd)
        try:
            os.fdatasync(fd)
            self.fsyncs += 1
        finally:
            os.close(fd)

    def _mark_consumed(self, group_ids, locations, state, sync) -> None:
        # With no group the record carries the state alone (a new learner version), so a restart resumes from it.
        if self.persist:
            self._write([self._record(KIND_CONSUMED, [msgpack.packb({"ids": list(group_ids), "state": state})])])
            if sync:
                self._sync()
        for loc in locations:
            if loc is not None:
                self.live[loc.segment] -= 1
        self._delete_consumed_prefix()

    def _delete_consumed_prefix(self) -> None:
        while len(self.segments) > 1 and self.live[self.segments[0]] <= 0:
            seg = self.segments.pop(0)
            self.live.pop(seg, None)
            try:
                self._path(seg).unlink()
            except FileNotFoundError:
                pass

    # ----- reading ---------------------------------------------------------------------------

    def read(self, loc: Location) -> list[bytes]:
        """The frames of a stored group."""
        with self.lock, open(self._path(loc.segment), "rb") as f:
            f.seek(loc.offset)
            hdr = f.read(_HDR.size)
            magic, kind, length, crc = _HDR.unpack(hdr)
            payload = f.read(length)
        if magic != MAGIC or kind != KIND_GROUP or len(payload) != length or zlib.crc32(payload) != crc:
            raise OSError(f"spill record at {loc} is damaged")
        return self._split_group(payload)[1]

    @staticmethod
    def _split_group(payload: bytes) -> tuple[str, list[bytes]]:
        (meta_len,) = _U32.unpack_from(payload, 0)
        group_id, lengths = msgpack.unpackb(payload[4:4 + meta_len])
        frames = []
        pos = 4 + meta_len
        view = memoryview(payload)
        for n in lengths:
            frames.append(view[pos:pos + n])
            pos += n
        return group_id, frames

    def recover(self) -> Recovered:
        """Replay every segment: unconsumed groups in arrival order, recent ids, last state. A torn tail is
        cut off, so later appends stay readable."""
        out = self._replay(self.dir, self.log, truncate=True)
        for _, loc in out.groups:
            self.live[loc.segment] += 1
        return out

    @classmethod
    def scan(cls, directory: str | Path) -> Recovered:
        """What ``recover`` would find, read-only (``computerrl audit`` on a live or stopped run)."""
        return cls._replay(Path(directory), None, truncate=False)

    @classmethod
    def _replay(cls, directory: Path, log: Any, truncate: bool) -> Recovered:
        out = Recovered()
        groups: collections.OrderedDict[str, Location] = collections.OrderedDict()
        consumed: set[str] = set()
        recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        existing = _segments(directory)
        for seg in existing:
            path = directory / _segment_name(seg)
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # scanning a live log: the broker deleted a consumed segment
                continue
            pos = 0
            while pos < len(data):
                if len(data) - pos < _HDR.size:
                    break
                magic, kind, length, crc = _HDR.unpack_from(data, pos)
                end = pos + _HDR.size + length
                if magic != MAGIC or end > len(data) or zlib.crc32(data[pos + _HDR.size:end]) != crc:
                    break
                payload = data[pos + _HDR.size:end]
                if kind == KIND_GROUP:
                    (meta_len,) = _U32.unpack_from(payload, 0)
                    group_id, _ = msgpack.unpackb(payload[4:4 + meta_len])
                    groups[group_id] = Location(seg, pos, length)
                    recent[group_id] = None
                elif kind == KIND_CONSUMED:
                    body = msgpack.unpackb(payload)
                    consumed.update(body["ids"])
                    out.state.update(body.get("state", {}))
                elif kind == KIND_SNAPSHOT:
                    body = msgpack.unpackb(payload)
                    for gid in body.get("recent_ids", []):
                        recent[gid] = None
                    out.state.update(body.get("state", {}))
                pos = end
            if pos < len(data):
                # A torn tail: the write was never acknowledged. Cut it so later appends stay readable.
                out.truncated_bytes += len(data) - pos
                if seg != existing[-1]:
                    out.corrupt_segments.append(seg)
                if truncate:
                    with open(path, "r+b") as f:
                        f.truncate(pos)
                        os.fsync(f.fileno())
                    log.warning("spill_tail_truncated", segment=seg, offset=pos, bytes=len(data) - pos)
        out.groups = [(gid, loc) for gid, loc in groups.items() if gid not in consumed]
        out.recent_ids = list(recent)
        return out


class CommitThread:
    """Group commit off the broker's loop, in two overlapped stages, completed in submission order.

    The writer stage appends every job queued since its last round; the sync stage runs one fdatasync
    for all rounds written since its last flush. While the disk flushes one round, the next is copied
    into the page cache, so the log keeps the disk busy instead of alternating copy and flush.
    Completed ``(token, locations)`` come back through ``completed`` plus a wake-up message on an
    inproc socket the loop polls.
    """

    def __init__(self, spill: SpillLog, ctx: Any, wake_addr: str):
        import zmq

        self.spill = spill
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = ctx.socket(zmq.PUSH)
        self._wake.connect(wake_addr)
        self.pending = 0
        self.error: BaseException | None = None
        self._written: list[tuple[list, list[Location] | None]] = []  # rounds awaiting the sync stage
        self._cond = threading.Condition()
        self._writing_done = False
        self._writer = threading.Thread(target=self._write_rounds, name="spill-write", daemon=True)
        self._syncer = threading.Thread(target=self._sync_rounds, name="spill-sync", daemon=True)
        self._writer.start()
        self._syncer.start()

    def submit(self, items: Sequence[tuple[str, Sequence[Any]]], token: Any) -> None:
        """Make groups durable; ``(token, locations)`` comes back through ``completed``."""
        self.pending += 1
        self.jobs.put(("groups", items, token))

    def submit_consumed(self, group_ids: Sequence[str], locations: Sequence[Location | None], state: dict,
                        token: Any = None) -> None:
        """Record consumed groups in the next round; with a token, ``(token, [])`` comes back once durable."""
        if token is not None:
            self.pending += 1
        self.jobs.put(("consumed", (list(group_ids), list(locations), dict(state)), token))

    def _next_round(self) -> tuple[list, bool]:
        batch = [self.jobs.get()]
        if batch[0] is None:
            return [], True
        while True:
            try:
                nxt = self.jobs.get_nowait()
            except queue.Empty:
                return batch, False
            if nxt is None:
                return batch, True
            batch.append(nxt)

    def _write_rounds(self) -> None:
        stop = False
        while not stop:
            batch, stop = self._next_round()
            if not batch:
                break
            group_jobs = [(items if kind == "groups" else [], token) for kind, items, token in batch
                          if kind == "groups" or token is not None]
            items = [it for its, _ in group_jobs for it in its]
            locs: list[Location] | None
            try:
                locs = self.spill.append_groups(items, sync=False) if items else []
                for kind, (ids, locations, state), _ in (j for j in batch if j[0] == "consumed"):
                    self.spill.mark_consumed(ids, locations, state, sync=False)
            except BaseException as exc:  # a full or failing disk: the loop must stop acking
                self.error = exc
                locs = None
            with self._cond:
                self._written.append((group_jobs, locs))
                self._cond.notify()
        with self._cond:
            self._writing_done = True
            self._cond.notify()

    def _sync_rounds(self) -> None:
        while True:
            with self._cond:
                while not self._written and not self._writing_done:
                    self._cond.wait()
                rounds, self._written = self._written, []
                finished = self._writing_done
            if rounds:
                # A failed round is not acked; the actor's retry writes it again, into a later round.
                synced = True
                try:
                    self.spill.sync_written()  # one fdatasync for every round written so far
                except BaseException as exc:
                    self.error = exc
                    synced = False
                self._complete(rounds, synced)
            if finished and not rounds:
                break
        self._wake.close(0)

    def _complete(self, rounds: list, synced: bool) -> None:
        woke = False
        for group_jobs, locs in rounds:
            pos = 0
            for job_items, token in group_jobs:
                n = len(job_items)
                ok = synced and locs is not None
                self.done.put((token, locs[pos:pos + n] if ok else None))
                pos += n
                woke = True
        if woke:
            self._wake.send(b"", copy=True)

    def completed(self) -> list[tuple[Any, list[Location] | None]]:
        out = []
        while True:
            try:
                out.append(self.done.get_nowait())
            except queue.Empty:
                break
        self.pending -= len(out)
        return out

    def close(self) -> None:
        self.jobs.put(None)
        self._writer.join(30)
        self._syncer.join(30)

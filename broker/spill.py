"""Durable spill log for trajectory groups.

Segments ``seg-<n>.log`` hold checksummed records (``broker/records.py``) of three kinds:

- GROUP: one encoded TrajectoryGroup, frames stored verbatim (no re-encoding);
- CONSUMED: ids of groups delivered to the learner or dropped — they must never be delivered again;
- SNAPSHOT: first record of every segment: recently seen group ids (de-duplication survives the deletion
  of old segments) and small broker state (restart count, tickets issued).

With ``persist`` on, appends are fsynced before the caller acks (one fsync per batch of appends: group
commit). Recovery replays the segments in order; a torn record at the tail of a segment (a ``kill -9``
mid-write) is cut off, which is safe because its group was never acked. A stretch that is no record with whole
records after it (bytes changed on disk) is skipped, reported (``Recovered.damaged``) and left in the file: what it
held is lost, the records after it are not. Segments are deleted oldest first,
once every group in them is consumed, so a CONSUMED record can never outlive the GROUP it cancels.
With ``persist`` off the log is only where groups wait when memory is full; it is wiped on start.

A full or failing disk loses nothing acked. A write that fails (``ENOSPC`` halfway through a record) is cut back
off the file, so the next record follows the last whole one. A failed fdatasync leaves the segment's unsynced bytes
unknown (the kernel may have dropped them, and a later fdatasync can report success all the same), so the segment
takes no more writes: the next is refused until the broker's loop rotates to a fresh segment. A record counts as
durable only up to the bytes of its segment that a successful fdatasync covered (``durable``), and the commit
thread acks nothing beyond them.
"""

from __future__ import annotations

import collections
import os
import queue
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import msgpack

from broker.records import HEADER, find_header, holds, is_magic, record, walk
from common.net import RateLimitedLog
from common.protocol import frame_buffer, frame_nbytes

_U32 = struct.Struct("<I")
KIND_GROUP, KIND_CONSUMED, KIND_SNAPSHOT = 1, 2, 3
_KINDS = (KIND_GROUP, KIND_CONSUMED, KIND_SNAPSHOT)
_IOV_MAX = 512
ROTATE_RETRY_S = 1.0  # after a failed rotation (a full disk), the least wait before the next try


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

    @property
    def end(self) -> int:
        """Where the record ends in its segment."""
        return self.offset + HEADER.size + self.length


@dataclass(frozen=True)
class Written:
    """Where a record (a consumed one: no group to locate) ends: durable once its segment's synced bytes reach it."""

    segment: int
    end: int


@dataclass
class Recovered:
    groups: list[tuple[str, Location]] = field(default_factory=list)
    recent_ids: list[str] = field(default_factory=list)
    state: dict = field(default_factory=dict)
    truncated_bytes: int = 0
    corrupt_segments: list[int] = field(default_factory=list)
    missing_segments: list[int] = field(default_factory=list)
    """segment numbers absent between existing ones (deleted or lost by hand: the log only ever deletes its oldest)"""
    damaged: list[dict] = field(default_factory=list)
    """stretches inside a segment that hold no readable record while whole records follow them (bytes changed on
    disk, not a torn write), and a torn tail that holds a whole-sized record: ``{"segment", "offset", "bytes",
    "group_ids"}``, the ids that the group records starting there still state (one whose header or id changed states
    none). Skipped, not cut: the records after them are acked groups."""


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
        self.synced: dict[int, int] = {}  # segment -> bytes of it a successful fdatasync covered
        self.broken: set[int] = set()  # segments whose unsynced bytes are unknown after a failure: no more writes
        self.write_failures = 0
        self.sync_failures = 0
        self.rotate_failures = 0
        self._rotate_retry_at = -1e18
        self._rotate_log = RateLimitedLog(log, interval_s=10.0) if log is not None else None
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
            if self.persist and self._active not in self.broken:
                # The commit thread may have written a round it has not synced yet (write and sync overlap).
                try:
                    self._sync()
                except OSError:
                    pass  # (counted, and the segment is broken: its rounds not yet synced are not acked)
            os.close(self._fd)
            self._fd = None
        new = (self.segments[-1] + 1) if self.segments else 1
        fd = os.open(self._path(new), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._active, self._fd, self._size = new, fd, 0
        self.segments.append(new)
        try:
            self._write([record(KIND_SNAPSHOT, [msgpack.packb({"recent_ids": list(recent_ids),
                                                                      "state": state})])])
            if self.persist:
                self._sync(dir_too=True)
        except OSError:
            # The fresh segment holds nothing yet: it goes, so a retry takes its name again instead of leaving an
            # empty file behind on every try while the disk is full.
            self.segments.pop()
            self.broken.discard(new)
            self.synced.pop(new, None)
            os.close(fd)
            self._fd = None
            try:
                os.unlink(self._path(new))
            except OSError:
                pass
            raise

    def close(self) -> None:
        if self._fd is not None:
            try:
                if self.persist and self._active not in self.broken:
                    self._synced_or_broken(self._fd, self._active, self._size)
            except OSError as exc:  # (what it would have covered was never acked)
                if self.log is not None:
                    self.log.error("spill_close_sync_failed", segment=self._active, error=repr(exc))
            finally:
                os.close(self._fd)
                self._fd = None

    # ----- writing ---------------------------------------------------------------------------

    @property
    def writable(self) -> bool:
        """Whether a segment is open that takes writes (none after a failed rotation; not a broken one)."""
        return self._fd is not None and self._active not in self.broken

    def _write(self, records: list[list[Any]]) -> list[int]:
        """Append records, all or none; returns each record's offset in the active segment."""
        if not self.writable:
            raise OSError(f"spill segment {self._active} is broken after a failed write or sync: waiting to rotate")
        offsets = []
        iov: list[Any] = []
        size = self._size
        for rec in records:
            offsets.append(size)
            size += sum(frame_nbytes(p) for p in rec)
            iov.extend(rec)
        try:
            for i in range(0, len(iov), _IOV_MAX):
                chunk = iov[i:i + _IOV_MAX]
                want = sum(frame_nbytes(p) for p in chunk)
                done = os.writev(self._fd, chunk)
                if done < want:
                    self._finish_short_write(chunk, done)
                self.bytes_written += want
        except BaseException:
            self.write_failures += 1
            self._cut_back()
            raise
        self._size = size
        return offsets

    def _cut_back(self) -> None:
        """After a failed write, the file ends at the last whole record again (a truncation needs no free space);
        if even that fails, the segment is broken."""
        try:
            os.ftruncate(self._fd, self._size)
        except OSError:
            self.broken.add(self._active)

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
        if dir_too:  # (a new segment's records are durable only once its directory entry is)
            try:
                dfd = os.open(self.dir, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            except OSError:
                self.sync_failures += 1
                self.broken.add(self._active)
                raise
        # fdatasync also flushes the file size, which is all a reader of appended records needs.
        self._synced_or_broken(self._fd, self._active, self._size)

    def _synced_or_broken(self, fd: int, segment: int, size: int) -> None:
        """fdatasync ``fd`` (``segment``, ``size`` bytes written): on success those bytes are durable; on failure
        the segment is broken (what it held unsynced may be gone, whatever a later fdatasync says)."""
        try:
            os.fdatasync(fd)
        except OSError:
            self.sync_failures += 1
            self.broken.add(segment)
            raise
        self.fsyncs += 1
        if segment not in self.broken:
            self.synced[segment] = max(self.synced.get(segment, 0), size)

    def durable(self, written: Sequence[Location | Written]) -> bool:
        """Whether a successful fdatasync has covered every one of these records."""
        with self.lock:
            return all(self.synced.get(w.segment, 0) >= w.end for w in written)

    def maybe_rotate(self, snapshot: Callable[[], tuple[Sequence[str], dict]]) -> None:
        """Start a new segment once the active one is full or broken (called from the broker's loop). ``snapshot``
        gives the recent group ids and state the new segment starts with; it is called only then (it copies the
        dedupe window, up to hundreds of thousands of ids, which every loop turn could not afford). A rotation
        that fails (a full disk) leaves the log refusing writes until a later call, at least ``ROTATE_RETRY_S``
        on, succeeds."""
        with self.lock:
            if self._size < self.segment_bytes and self.writable:
                return
            now = time.monotonic()
            if now < self._rotate_retry_at:
                return
            try:
                self._rotate(*snapshot())
            except OSError as exc:  # (the old segment is closed by then: no write goes anywhere until a retry)
                self._rotate_retry_at = now + ROTATE_RETRY_S
                self.rotate_failures += 1
                if self._rotate_log is not None:
                    self._rotate_log.error("spill_rotate_failed", (), error=repr(exc), failures=self.rotate_failures,
                                           retry_in_s=ROTATE_RETRY_S)

    def append_groups(self, items: Sequence[tuple[str, Sequence[Any]]], sync: bool | None = None) -> list[Location]:
        """Append groups (id, frames); durable on return when persisting (one fdatasync for all)."""
        with self.lock:
            return self._append_groups(items, sync)

    def _append_groups(self, items, sync) -> list[Location]:
        # (on a failed fdatasync the groups' records stay in the file, not counted live: never acked, they are
        # recovered at a restart only if the actor's retry did not land, and the dedupe keeps one copy)
        records = []
        lengths = []
        for group_id, frames in items:
            bufs = [frame_buffer(f) for f in frames]
            meta = msgpack.packb([group_id, [frame_nbytes(b) for b in bufs]])
            parts = [_U32.pack(len(meta)), meta, *bufs]
            records.append(record(KIND_GROUP, parts))
            lengths.append(sum(frame_nbytes(p) for p in parts))
        offsets = self._write(records)
        if self.persist if sync is None else sync:
            self._sync()
        self.live[self._active] += len(items)
        return [Location(self._active, off, n) for off, n in zip(offsets, lengths)]

    def mark_consumed(self, group_ids: Sequence[str], locations: Sequence[Location | None], state: dict,
                      sync: bool = True) -> Written | None:
        """Record that these groups are gone for good (delivered or dropped), then free their segments; with none,
        record the state alone. Returns where the record ends (None when not persisting)."""
        with self.lock:
            return self._mark_consumed(group_ids, locations, state, sync)

    def forget(self, locations: Sequence[Location]) -> None:
        """Groups written but never acked (their round failed): their segments need not wait for them."""
        with self.lock:
            for loc in locations:
                self.live[loc.segment] -= 1
            self._delete_consumed_prefix()

    def sync(self) -> None:
        with self.lock:
            self._sync()

    def sync_written(self) -> None:
        """Make everything written so far durable without holding the lock during the disk flush.

        The commit thread keeps appending the next round meanwhile. A duplicate descriptor keeps the
        file open if the loop rotates segments during the flush; rotation syncs the old segment itself.
        """
        with self.lock:
            if self._fd is None:  # a rotation failed: rounds written before it were synced by it (or not acked)
                return
            fd, segment, size = os.dup(self._fd), self._active, self._size
        try:
            self._synced_or_broken(fd, segment, size)
        finally:
            os.close(fd)

    def _mark_consumed(self, group_ids, locations, state, sync) -> Written | None:
        # With no group the record carries the state alone (a new learner version), so a restart resumes from it.
        written = None
        if self.persist:
            self._write([record(KIND_CONSUMED, [msgpack.packb({"ids": list(group_ids), "state": state})])])
            written = Written(self._active, self._size)
            if sync:
                self._sync()
        for loc in locations:
            if loc is not None:
                self.live[loc.segment] -= 1
        self._delete_consumed_prefix()
        return written

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
            hdr = f.read(HEADER.size)
            magic, kind, length, _ = HEADER.unpack(hdr) if len(hdr) == HEADER.size else (b"", 0, 0, 0)
            # (the header is checked before its length is trusted: a damaged one could ask for any size)
            whole = is_magic(magic) and (kind, length) == (KIND_GROUP, loc.length)
            payload = f.read(length) if whole else b""
        if not (whole and holds(hdr, payload)):
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

    @staticmethod
    def _replay_record(kind: int, payload: bytes, loc: Location, out: Recovered, groups: dict, consumed: set,
                       recent: dict) -> None:
        if kind == KIND_GROUP:
            (meta_len,) = _U32.unpack_from(payload, 0)
            group_id, _ = msgpack.unpackb(payload[4:4 + meta_len])
            groups[str(group_id)] = loc
            recent[str(group_id)] = None
        elif kind == KIND_CONSUMED:
            body = msgpack.unpackb(payload)
            ids, state = list(body["ids"]), dict(body.get("state", {}))
            consumed.update(ids)
            out.state.update(state)
        else:
            body = msgpack.unpackb(payload)
            ids, state = list(body.get("recent_ids", [])), dict(body.get("state", {}))
            for gid in ids:
                recent[gid] = None
            out.state.update(state)

    @classmethod
    def _replay(cls, directory: Path, log: Any, truncate: bool) -> Recovered:
        out = Recovered()
        groups: collections.OrderedDict[str, Location] = collections.OrderedDict()
        consumed: set[str] = set()
        recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        existing = _segments(directory)
        out.missing_segments = [n for a, b in zip(existing, existing[1:]) for n in range(a + 1, b)]
        for seg in existing:
            path = directory / _segment_name(seg)
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # scanning a live log: the broker deleted a consumed segment
                continue
            # A stretch that is no record, with none after it, is a torn tail (a write a crash cut short, never
            # acked). With one after it: bytes changed on disk, or a hole a crash left among unsynced ones. Cutting
            # there, as recovery did until 2026-12-04, deleted every acked group after it: one flipped byte lost the
            # rest of its segment. It is skipped, and so is a whole record whose content does not decode.
            stretches, pos = walk(data, _KINDS)
            for start, end, whole in stretches:
                if whole:
                    try:
                        cls._replay_record(HEADER.unpack_from(data, start)[1], data[start + HEADER.size:end],
                                           Location(seg, start, end - start - HEADER.size), out, groups, consumed,
                                           recent)
                        continue
                    except (ValueError, TypeError, KeyError, AttributeError, struct.error, msgpack.UnpackException):
                        pass
                out.damaged.append({"segment": seg, "offset": start, "bytes": end - start,
                                    "group_ids": _stated_group_ids(data, start, end)})
            if pos < len(data):
                # A torn tail: the write was never acknowledged. Cut it so later appends stay readable. A record in
                # it whose header is whole and whose length fits, but whose CRC does not hold, may also be one of the
                # segment's last records changed on disk, acked: named as damaged too (the audit counts a group
                # lost only if it was acked). A write cut short is longer, by its header, than what is left.
                stated = _stated_group_ids(data, pos, len(data), whole_sized=True)
                if stated:
                    out.damaged.append({"segment": seg, "offset": pos, "bytes": len(data) - pos,
                                        "group_ids": stated})
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


def _stated_group_ids(data: bytes, start: int, end: int, whole_sized: bool = False) -> list[str]:
    """The ids that group records starting in ``data[start:end]`` still state (``_stated_group_id``); with
    ``whole_sized``, only those whose header's length fits before ``end``."""
    ids = []
    pos = find_header(data, start, end)
    while pos != -1:
        if end - pos >= HEADER.size:
            _, kind, length, _ = HEADER.unpack_from(data, pos)
            if kind == KIND_GROUP and (not whole_sized or pos + HEADER.size + length <= end):
                group_id = _stated_group_id(data, pos)
                if group_id:
                    ids.append(group_id)
        pos = find_header(data, pos + 1, end)
    return ids


def _stated_group_id(data: bytes, pos: int) -> str:
    """The group id a damaged record at ``pos`` still states (its header and the id at its payload's start intact,
    the damage further on), or ""."""
    try:
        magic, kind, _, _ = HEADER.unpack_from(data, pos)
        if not is_magic(magic) or kind != KIND_GROUP:
            return ""
        (meta_len,) = _U32.unpack_from(data, pos + HEADER.size)
        start = pos + HEADER.size + 4
        group_id, _ = msgpack.unpackb(data[start:start + min(meta_len, 1 << 16)])
        return group_id if isinstance(group_id, str) else ""
    except (ValueError, TypeError, struct.error, msgpack.UnpackException):
        return ""


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
        self._written: list[list] = []  # rounds awaiting the sync stage, each its jobs
        self._carried: list[tuple[list, list]] = []  # consumed records to write again (the writer's own)
        self._recarry: queue.SimpleQueue = queue.SimpleQueue()  # from the sync stage: written but not made durable
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
            items = [it for kind, its, _ in batch if kind == "groups" for it in its]
            locs: list[Location] | None
            try:
                locs = self.spill.append_groups(items, sync=False) if items else []
            except BaseException as exc:  # a full or failing disk: nothing of it is acked
                self.error = exc
                locs = None
            jobs: list[tuple[Any, list | None, list | None]] = []  # (token, records written or None, consumed ids)
            pos = 0
            for kind, payload, token in batch:
                if kind == "groups":
                    jobs.append((token, None if locs is None else locs[pos:pos + len(payload)], None))
                    pos += len(payload)
                else:
                    jobs.append(self._write_consumed(*payload, token))
            with self._cond:
                self._written.append(jobs)
                self._cond.notify()
        with self._cond:
            self._writing_done = True
            self._cond.notify()

    def _write_consumed(self, ids: list, locations: list, state: dict, token: Any) -> tuple:
        """A consumed record, carrying the ids of every earlier one that failed or was not made durable: a group
        whose consumed record is lost would be delivered again after a restart (and a committed one trained
        twice). Their locations were counted off their segments already, or ride along until written."""
        while True:
            try:
                self._carried.append(self._recarry.get_nowait())
            except queue.Empty:
                break
        for old_ids, old_locations in self._carried:
            ids, locations = old_ids + ids, old_locations + locations
        self._carried = []
        try:
            written = self.spill.mark_consumed(ids, locations, state, sync=False)
        except BaseException as exc:
            self.error = exc
            self._carried.append((ids, locations))  # (not counted off: the write failed before that)
            return token, None, ids
        return token, [written] if written else [], ids

    def _sync_rounds(self) -> None:
        while True:
            with self._cond:
                while not self._written and not self._writing_done:
                    self._cond.wait()
                rounds, self._written = self._written, []
                finished = self._writing_done
            if rounds:
                try:
                    self.spill.sync_written()  # one fdatasync for every round written so far
                except BaseException as exc:
                    self.error = exc
                self._complete(rounds)
            if finished and not rounds:
                break
        self._wake.close(0)

    def _complete(self, rounds: list) -> None:
        """Each job of these rounds, acked only if every record of it is durable. A failed group job is not acked;
        the actor's retry writes it again, into a later round. A consumed record not durable rides on the next."""
        woke = False
        for jobs in rounds:
            for token, written, consumed_ids in jobs:
                ok = written is not None and self.spill.durable(written)
                if consumed_ids is not None:
                    if written is not None and not ok:
                        self._recarry.put((consumed_ids, []))
                        woke = True  # (the loop rotates away from a broken segment when woken)
                    if token is None:
                        continue
                    self.done.put((token, [] if ok else None))
                else:
                    if written is not None and not ok:
                        self.spill.forget(written)
                    self.done.put((token, written if ok else None))
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

"""The broker's spill log and its commit thread on a disk that fails and a machine that crashes: a Hypothesis state
machine.

The log's ``os`` is a disk that can be told to fail its next call: a write that stops partway with ``ENOSPC``
(after any number of bytes), an fdatasync or directory fsync that fails with ``EIO``, a truncation or a file
creation that fails. It keeps, per file, what a successful fdatasync made durable; after a failed one, nothing of
that file beyond what was durable before ever becomes durable (the kernel may have dropped those pages and still
report the next fdatasync a success). A crash then keeps each file's durable bytes and does anything to the rest:
loses it, keeps it, cuts it anywhere, or zeroes a stretch of it (a hole); a file whose directory entry no fsync
covered may vanish.

The rules play the broker's side, one commit-thread job at a time, as the loop does: actors' groups submitted (and
retried while not acked), a learner's commits (retried while not acked), rotations of full or broken segments
after every job, faults armed, crashes followed by recovery. After every crash, by group id: every acked group not
committed is recovered with its frames intact; no group whose commit was acked is; nothing is recovered that was
never submitted. And the log goes on: with no fault armed, every job is acked. A bit may also change on disk while
the broker is stopped: then only the record holding it may be lost (a group's, which is named where its id is
intact, or a consumed record's, whose groups come back), and every other acked group is recovered intact.

150 examples in all: 50 in the quick tier, 100 more in the whole suite. ``COMPUTERRL_SPILL_EXAMPLES=N`` runs N in all
instead (a soak)."""

from __future__ import annotations

import errno
import os
import shutil
import struct
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import zmq
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import msgpack

import broker.spill as spill_mod
from broker import records
from broker.spill import CommitThread, SpillLog
from common import log as L

EXAMPLES = int(os.environ.get("COMPUTERRL_SPILL_EXAMPLES", "0")) or 150
QUICK_EXAMPLES = min(50, EXAMPLES)
"""of them, those the quick tier runs (about 5 s); the whole suite runs the rest as a slow test"""
REAL_OS = os
FAULTS = st.one_of(st.none(), st.tuples(st.sampled_from(["writev", "fdatasync", "dirsync", "ftruncate", "open"]),
                                        st.integers(0, 400)))
"""A fault armed for the next call of its kind (and, for a write, the bytes written before it fails), or none"""


class FailingDisk:
    """``os`` for the spill log: the real calls, but the next one of a kind fails when armed, and what each file
    holds durably is tracked (by path) for the crash."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.armed: dict[str, int | None] = {}  # call kind -> bytes to write first (writev) or None
        self.durable: dict[str, int] = {}  # file name -> bytes a successful fdatasync made durable
        self.poisoned: set[str] = set()  # files with a failed fdatasync: their durable bytes never grow again
        self.entry_durable: set[str] = set()  # files whose directory entry an fsync of the directory covered
        self.failures = 0

    def __getattr__(self, name):
        return getattr(REAL_OS, name)

    def _name(self, fd: int) -> str:
        return Path(REAL_OS.readlink(f"/proc/self/fd/{fd}")).name

    def _fail(self, kind: str) -> bool:
        if kind in self.armed:
            self.failures += 1
            return True
        return False

    def writev(self, fd, parts):
        if self._fail("writev"):
            flat = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
            cut = min(self.armed.pop("writev") or 0, len(flat))
            if cut:
                REAL_OS.write(fd, flat[:cut])
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return REAL_OS.writev(fd, parts)

    def _sync(self, fd, real) -> None:
        if REAL_OS.path.isdir(REAL_OS.readlink(f"/proc/self/fd/{fd}")):
            if self._fail("dirsync"):
                del self.armed["dirsync"]
                raise OSError(errno.EIO, "Input/output error (injected)")
            real(fd)
            self.entry_durable |= {p.name for p in self.dir.glob("seg-*.log")}
            return
        name = self._name(fd)
        if self._fail("fdatasync"):
            del self.armed["fdatasync"]
            self.poisoned.add(name)
            raise OSError(errno.EIO, "Input/output error (injected)")
        real(fd)
        if name not in self.poisoned:
            self.durable[name] = max(self.durable.get(name, 0), REAL_OS.fstat(fd).st_size)

    def fdatasync(self, fd):
        self._sync(fd, REAL_OS.fdatasync)

    def fsync(self, fd):
        self._sync(fd, REAL_OS.fsync)

    def ftruncate(self, fd, length):
        if self._fail("ftruncate"):
            del self.armed["ftruncate"]
            raise OSError(errno.EIO, "Input/output error (injected)")
        REAL_OS.ftruncate(fd, length)

    def open(self, path, flags, mode=0o777, **kw):
        if flags & REAL_OS.O_CREAT and self._fail("open"):
            del self.armed["open"]
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        if flags & REAL_OS.O_CREAT and not REAL_OS.path.exists(path):
            # a new file, though perhaps under the name of one deleted before: nothing of that one carries over
            name = Path(path).name
            self.durable.pop(name, None)
            self.poisoned.discard(name)
            self.entry_durable.discard(name)
        return REAL_OS.open(path, flags, mode, **kw)

    def crash(self, choose) -> None:
        """What the disk holds after the machine stops here: ``choose(options)`` picks each file's fate."""
        for path in sorted(self.dir.glob("seg-*.log")):
            data = path.read_bytes()
            keep = self.durable.get(path.name, 0)
            if path.name not in self.entry_durable and choose(["stays", "vanishes"]) == "vanishes":
                path.unlink()
                continue
            if len(data) > keep:
                fate = choose(["lost", "all", "cut", "hole"])
                if fate == "lost":
                    data = data[:keep]
                elif fate == "cut":
                    data = data[:keep + choose(list(range(len(data) - keep)))]
                elif fate == "hole":
                    at = keep + choose(list(range(len(data) - keep)))
                    n = 1 + choose(list(range(min(64, len(data) - at))))
                    data = data[:at] + bytes(n) + data[at + n:]
                path.write_bytes(data)
        self.all_durable()

    def all_durable(self) -> None:
        """What is on disk is all durable now (the reopened log starts from it)."""
        self.durable = {p.name: p.stat().st_size for p in self.dir.glob("seg-*.log")}
        self.entry_durable = {p.name for p in self.dir.glob("seg-*.log")}
        self.poisoned.clear()
        self.armed.clear()


class SpillRun(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="spill-model-"))
        self.disk = FailingDisk(self.dir)
        self.saved_os, self.saved_retry = spill_mod.os, spill_mod.ROTATE_RETRY_S
        spill_mod.os = self.disk
        spill_mod.ROTATE_RETRY_S = 0.0  # (the loop's next turn retries a failed rotation: here, the next job's)
        self.log = L.setup("test", "test", 0, None, "critical", quiet=True)
        self.ctx = zmq.Context.instance()
        self.frames: dict[str, list[bytes]] = {}  # every group submitted, by id
        self.unacked: list[str] = []  # submitted, not acked: the actor retries
        self.acked: dict[str, object] = {}  # acked, not consumed: id -> its location
        self.committing: list[str] = []  # commits not acked: the learner retries (the broker forgot them)
        self.committed: set[str] = set()  # commits acked
        self.tokens = 0
        self.spill = self.commit = self.wake = None
        self.crashes = 0

    @initialize(segment_bytes=st.sampled_from([1, 600, 4000, 1 << 20]))
    def start(self, segment_bytes: int) -> None:
        self.segment_bytes = segment_bytes
        self._open()

    def _open(self) -> None:
        self.spill = SpillLog(self.dir, True, self.segment_bytes, self.log)
        rec = self.spill.recover()
        self.spill.open(rec.recent_ids, rec.state)
        addr = f"inproc://spill-model-{uuid.uuid4().hex}"
        self.wake = self.ctx.socket(zmq.PULL)
        self.wake.bind(addr)
        self.commit = CommitThread(self.spill, self.ctx, addr)
        return rec

    def _close(self) -> None:
        self.commit.close()
        self.wake.close(0)
        self.spill.close()

    def _job(self, submit, fault: tuple[str, int] | None) -> object:
        """One job through the commit thread; its result once completed; then the loop's rotation. ``fault``: armed
        first, it fails the job's write or sync, or the rotation after it, or (not met by either) a later call."""
        if fault is not None:
            self.disk.armed[fault[0]] = fault[1] if fault[0] == "writev" else None
        self.tokens += 1
        token = self.tokens
        # with no fault armed, a job on a log that is not broken is acked, and the loop's rotation then leaves it
        # unbroken (a log broken by an earlier fault is rotated away from after the job that found it so)
        must_ack = not self.disk.armed and self.spill.writable
        faults_armed = bool(self.disk.armed)
        submit(token)
        deadline = time.monotonic() + 10
        result = ...
        while result is ... and time.monotonic() < deadline:
            if self.wake.poll(50):
                self.wake.recv()
            for t, locations in self.commit.completed():
                assert t == token
                result = locations
        assert result is not ..., "the commit thread completes every job with a token"
        if must_ack:
            assert result is not None, "with no fault armed, a job on an unbroken log is acked"
        self.spill.maybe_rotate(lambda: (list(self.frames), {"tokens": self.tokens}))
        if not faults_armed:
            assert self.spill.writable, "the log goes on"
        return result

    @rule(n=st.integers(1, 3), size=st.integers(1, 300), fault=FAULTS)
    def actor_submits(self, n: int, size: int, fault) -> None:
        """New groups, and the retries of every one not acked yet."""
        new = [uuid.uuid4().hex for _ in range(n)]
        for i, gid in enumerate(new):
            self.frames[gid] = [gid.encode() * (1 + (size * (i + 1)) // 32), bytes([i]) * size]
        ids = self.unacked + new
        locations = self._job(lambda token: self.commit.submit([(g, self.frames[g]) for g in ids], token), fault)
        if locations is None:
            self.unacked = ids
            return
        self.unacked = []
        for gid, loc in zip(ids, locations):
            self.acked[gid] = loc

    @precondition(lambda self: self.acked or self.committing)
    @rule(k=st.integers(1, 4), fault=FAULTS)
    def learner_commits(self, k: int, fault) -> None:
        """A checkpoint's commit of up to ``k`` acked groups, or the retry of one not acked (the broker forgot its
        groups at the first try, as its ledger does: a retry names none)."""
        if self.committing:
            ids, locations = [], []
        else:
            ids = list(self.acked)[:k]
            locations = [self.acked.pop(g) for g in ids]
            self.committing = ids
        result = self._job(lambda token: self.commit.submit_consumed(ids, locations, {"v": self.tokens}, token),
                           fault)
        if result is not None:
            self.committed |= set(self.committing)
            self.committing = []

    @rule(data=st.data())
    def machine_crashes(self, data) -> None:
        self.commit.close()  # (no job is in flight: each rule waits for its own)
        self.wake.close(0)
        REAL_OS.close(self.spill._fd) if self.spill._fd is not None else None
        self.disk.crash(lambda options: data.draw(st.sampled_from(options)))
        self.crashes += 1
        rec = self._open()
        found = {gid: self.spill.read(loc) for gid, loc in rec.groups}
        lost = set(self.acked) - set(found)
        assert not lost, f"acked groups lost in the crash: {sorted(lost)}"
        assert not (self.committed & set(found)), "a group whose commit was acked came back"
        assert set(found) <= set(self.frames), "recovered a group never submitted"
        for gid, frames in found.items():
            assert [bytes(f) for f in frames] == self.frames[gid], f"group {gid} came back damaged"
        # The restarted broker queues what it found: acked groups keep their (new) locations; a group whose commit
        # was not acked is queued again (its learner commits it again at resume); one never acked is now queued too.
        self.acked = {gid: loc for gid, loc in rec.groups}
        self.committing = []
        self.unacked = [g for g in self.unacked if g not in found]

    @rule(data=st.data())
    def a_bit_changes_on_disk(self, data) -> None:
        """The broker stopped, one bit of a segment changed (a failing disk, a bad copy), the broker restarted. Only
        the record holding that bit may be lost: a group's (it is missing), or a consumed record's (its groups come
        back: nothing says they were committed). Every other acked group is recovered intact."""
        self._close()
        segments = [p for p in sorted(self.dir.glob("seg-*.log")) if p.stat().st_size]
        at_risk_lost: set[str] = set()
        at_risk_back: set[str] = set()
        at = readable_id_end = 0  # the changed byte; where the hit group record's id ends (a change before: unnamed)
        if segments:
            path = data.draw(st.sampled_from(segments))
            raw = bytearray(path.read_bytes())
            at = data.draw(st.integers(0, len(raw) - 1))
            stretches, _ = records.walk(bytes(raw), spill_mod._KINDS)
            hit = next(((a, b) for a, b, whole in stretches if whole and a <= at < b), None)
            if hit is not None:
                kind, payload = raw[hit[0] + 4], bytes(raw[hit[0] + records.HEADER.size:hit[1]])
                try:
                    if kind == spill_mod.KIND_GROUP:
                        (meta_len,) = spill_mod._U32.unpack_from(payload, 0)
                        at_risk_lost.add(msgpack.unpackb(payload[4:4 + meta_len])[0])
                        readable_id_end = hit[0] + records.HEADER.size + 4 + meta_len
                    elif kind == spill_mod.KIND_CONSUMED:
                        at_risk_back |= set(msgpack.unpackb(payload).get("ids", []))
                except (ValueError, TypeError, AttributeError, struct.error, msgpack.UnpackException):
                    pass
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
            path.write_bytes(bytes(raw))
        self.disk.all_durable()
        rec = self._open()
        found = {gid: self.spill.read(loc) for gid, loc in rec.groups}
        lost = set(self.acked) - set(found)
        assert lost <= at_risk_lost, f"acked groups lost beside the changed record: {sorted(lost - at_risk_lost)}"
        back = self.committed & set(found)
        assert back <= at_risk_back, "a committed group came back though its consumed record is whole"
        assert set(found) <= set(self.frames), "recovered a group never submitted"
        for gid, frames in found.items():
            assert [bytes(f) for f in frames] == self.frames[gid], f"group {gid} came back damaged"
        named = {g for d in rec.damaged for g in d["group_ids"]}
        assert not lost or lost <= named or at < readable_id_end, "a group lost to damage is named where its id is intact"
        self.acked = {gid: loc for gid, loc in rec.groups}
        self.committed -= back  # queued again: the learner's checkpoint covers them, its resume commits them again
        self.committing = []
        self.unacked = [g for g in self.unacked if g not in found]

    @invariant()
    def nothing_committed_is_queued(self) -> None:
        assert not (self.committed & set(self.acked))

    def teardown(self) -> None:
        self.disk.armed.clear()
        try:
            if self.commit is not None:
                self._close()
        finally:
            spill_mod.os, spill_mod.ROTATE_RETRY_S = self.saved_os, self.saved_retry
            shutil.rmtree(self.dir, ignore_errors=True)


class test_nothing_acked_is_lost_nothing_committed_returns_and_the_log_goes_on(SpillRun.TestCase):
    settings = settings(max_examples=QUICK_EXAMPLES, stateful_step_count=40, deadline=None)


@pytest.mark.slow  # more of the same examples: the quick tier's budget holds 50
class test_nothing_acked_is_lost_nothing_committed_returns_and_the_log_goes_on_over_more_runs(SpillRun.TestCase):
    settings = settings(max_examples=max(1, EXAMPLES - QUICK_EXAMPLES), stateful_step_count=40, deadline=None)

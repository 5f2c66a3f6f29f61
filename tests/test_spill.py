"""Spill log: durable appends, recovery, torn tails, consumed records, segment deletion; success store."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import zmq

import broker.spill as spill_mod
from broker import records
from broker.records import HEADER
from broker.spill import CommitThread, SpillLog
from broker.store import SuccessStore
from common import protocol as P
from tests.conftest import make_group, make_traj


def _open(path, log, persist=True, segment_bytes=1 << 20):
    s = SpillLog(path, persist, segment_bytes, log)
    rec = s.recover() if persist else None
    s.open(rec.recent_ids if rec else [], rec.state if rec else {})
    return s, rec


def test_append_recover_consume(tmp_path, quiet_log):
    s, _ = _open(tmp_path, quiet_log)
    groups = [make_group(version=i) for i in range(5)]
    locs = s.append_groups([(g.group_id, P.encode(g)) for g in groups])
    assert P.decode(s.read(locs[2])).group_id == groups[2].group_id
    s.mark_consumed([groups[0].group_id, groups[1].group_id], locs[:2], {"version": 3})
    s.close()
    s2, rec = _open(tmp_path, quiet_log)
    assert [gid for gid, _ in rec.groups] == [g.group_id for g in groups[2:]]
    assert set(g.group_id for g in groups) <= set(rec.recent_ids)
    assert rec.state["version"] == 3
    back = P.decode(s2.read(rec.groups[0][1]))
    np.testing.assert_array_equal(back.trajectories[0].prompt_ids, groups[2].trajectories[0].prompt_ids)


def _two_groups_on_disk(tmp_path, log):
    """Write two groups and close; returns them and the segment file holding them."""
    s, _ = _open(tmp_path, log)
    g1, g2 = make_group(), make_group()
    s.append_groups([(g1.group_id, P.encode(g1)), (g2.group_id, P.encode(g2))])
    s.close()
    return g1, g2, sorted(tmp_path.glob("seg-*.log"))[-1]


def test_torn_tail_is_cut_and_log_stays_appendable(tmp_path, quiet_log):
    g1, _, seg = _two_groups_on_disk(tmp_path, quiet_log)
    data = seg.read_bytes()
    seg.write_bytes(data[:-7])  # a kill -9 in the middle of the second record
    s2, rec = _open(tmp_path, quiet_log)
    assert [gid for gid, _ in rec.groups] == [g1.group_id] and rec.truncated_bytes > 0
    g3 = make_group()
    s2.append_groups([(g3.group_id, P.encode(g3))])
    s2.close()
    _, rec3 = _open(tmp_path, quiet_log)
    assert [gid for gid, _ in rec3.groups] == [g1.group_id, g3.group_id]


def test_corrupt_record_stops_replay_of_that_segment(tmp_path, quiet_log):
    g1, _, seg = _two_groups_on_disk(tmp_path, quiet_log)
    data = bytearray(seg.read_bytes())
    data[-20] ^= 0xFF  # flip a byte inside the last record: its CRC fails
    seg.write_bytes(bytes(data))
    _, rec = _open(tmp_path, quiet_log)
    assert [gid for gid, _ in rec.groups] == [g1.group_id]


def test_consumed_segments_deleted_oldest_first_and_dedupe_survives(tmp_path, quiet_log):
    s, _ = _open(tmp_path, quiet_log, segment_bytes=1)  # every append rotates first
    gs = [make_group() for _ in range(4)]
    locs = []
    for g in gs:
        s.maybe_rotate(lambda: ([x.group_id for x in gs], {}))
        locs += s.append_groups([(g.group_id, P.encode(g))])
    def segments():
        return {int(p.stem.split("-")[1]) for p in tmp_path.glob("seg-*.log")}

    s.mark_consumed([gs[1].group_id], [locs[1]], {})  # g1's segment waits behind g0's
    assert {locs[0].segment, locs[1].segment} <= segments()
    s.mark_consumed([gs[0].group_id], [locs[0]], {})
    assert not {locs[0].segment, locs[1].segment} & segments()
    assert {locs[2].segment, locs[3].segment} <= segments()
    s.close()
    _, rec = _open(tmp_path, quiet_log)
    assert [gid for gid, _ in rec.groups] == [gs[2].group_id, gs[3].group_id]
    assert gs[0].group_id in rec.recent_ids  # kept by the snapshot heading a later segment


def test_short_writev_is_completed_exactly(tmp_path, quiet_log, monkeypatch):
    real_writev = os.writev

    def half_writev(fd, parts):  # a writev interrupted after half of what it was given
        flat = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        return real_writev(fd, [flat[: len(flat) // 2]])

    s, _ = _open(tmp_path, quiet_log)
    monkeypatch.setattr(spill_mod.os, "writev", half_writev)
    groups = [make_group(), make_group()]
    locs = s.append_groups([(g.group_id, P.encode(g)) for g in groups])
    monkeypatch.setattr(spill_mod.os, "writev", real_writev)
    assert P.decode(s.read(locs[1])).group_id == groups[1].group_id
    s.close()
    _, rec = _open(tmp_path, quiet_log)
    assert [gid for gid, _ in rec.groups] == [g.group_id for g in groups] and rec.truncated_bytes == 0


def test_persist_off_wipes_old_segments(tmp_path, quiet_log):
    s, _ = _open(tmp_path, quiet_log)
    g = make_group()
    s.append_groups([(g.group_id, P.encode(g))])
    s.close()
    s2 = SpillLog(tmp_path, False, 1 << 20, quiet_log)
    assert not list(tmp_path.glob("seg-*.log")) and s2.persist is False


def test_success_store_dedupes_caps_and_persists(tmp_path, quiet_log):
    path = tmp_path / "success.log"
    st = SuccessStore(per_task=2, max_tasks=2, path=path, log=quiet_log)
    t1, t2, t3 = make_traj(seed=1), make_traj(seed=2), make_traj(seed=3)
    assert st.add("a", t1) and not st.add("a", t1) and st.duplicates == 1
    st.add("a", t2)
    st.add("a", t3)  # per-task cap 2: t1 goes
    st.add("b", t1)
    st.add("c", t1)  # task cap 2: "a" (least recently added) goes
    assert sorted(st.tasks) == ["b", "c"]
    st.close()
    st2 = SuccessStore(per_task=2, max_tasks=2, path=path, log=quiet_log)
    assert sorted(st2.tasks) == ["b", "c"] and len(st2) == 2
    samples = st2.sample(k_per_task=5, max_tasks=0, seed=0)
    assert sorted(s.task_id for s in samples) == ["b", "c"]
    np.testing.assert_array_equal(samples[0].trajectory.output_ids, t1.output_ids)


def test_a_success_changed_on_disk_is_dropped_alone_and_an_older_file_without_checksums_still_loads(tmp_path):
    """Found by hand (2026-12-04): a byte flipped in success.log loaded without a word, its trajectory changed, and
    SFT phases would imitate it as a success. Records now carry the spill log's checksum (``broker/records.py``): a
    damaged one is dropped, alone, and said; a torn tail is dropped as before; a file from before, with no checksums,
    loads as it did and is rewritten with them."""
    import struct

    from broker import store as store_mod

    errors: list[tuple[str, dict]] = []

    class Log:
        def __getattr__(self, level):
            return lambda event, **kw: errors.append((event, kw)) if level in ("error", "warning") else None
    path = tmp_path / "success.log"
    st = SuccessStore(per_task=4, max_tasks=10, path=path, log=Log())
    trajs = [make_traj(seed=s) for s in range(4)]
    for i, t in enumerate(trajs):
        st.add(f"task/{i}", t)
    st.close()
    data = bytearray(path.read_bytes())
    starts = [i for i in range(len(data)) if data.startswith(records.MAGIC, i)]
    assert len(starts) == 4
    data[(starts[1] + starts[2]) // 2] ^= 0x04  # inside the second record
    path.write_bytes(bytes(data[:-5]))  # and the last one torn
    back = SuccessStore(per_task=4, max_tasks=10, path=path, log=Log())
    assert sorted(back.tasks) == ["task/0", "task/2"]
    np.testing.assert_array_equal(back.tasks["task/2"][store_mod.solution_key(trajs[2])].output_ids,
                                  trajs[2].output_ids)
    assert ("success_store_records_damaged", {"records": 1, "path": str(path)}) in errors
    assert [e for e, _ in errors].count("success_store_tail_dropped") == 1
    back.close()

    # the layout before checksums: the same payloads back to back
    legacy = tmp_path / "legacy.log"
    with open(legacy, "wb") as f:
        for i, t in enumerate(trajs[:3]):
            frames = P.encode(P.SuccessBatch(samples=[P.SuccessSample(task_id=f"task/{i}", trajectory=t)]))
            bufs = [bytes(memoryview(x).cast("B")) for x in frames]
            f.write(struct.pack("<II", len(bufs[0]), len(bufs) - 1) + struct.pack(f"<{len(bufs) - 1}Q",
                                                                                *(len(b) for b in bufs[1:])))
            f.write(b"".join(bufs))
    old = SuccessStore(per_task=4, max_tasks=10, path=legacy, log=Log())
    assert sorted(old.tasks) == ["task/0", "task/1", "task/2"]
    old.close()
    assert legacy.read_bytes().startswith(records.MAGIC), "rewritten with checksums"
    assert sorted(SuccessStore(per_task=4, max_tasks=10, path=legacy, log=Log()).tasks) == sorted(old.tasks)


def test_replay_finds_the_newest_success_sampled_within_the_bound(quiet_log):
    st = SuccessStore(per_task=4, max_tasks=100, path=None, log=quiet_log)
    st.add("sim:train:sheet_sum/1", make_traj(version=3, seed=1))
    st.add("sim:train:sheet_sum/1", make_traj(version=5, seed=2))
    st.add("sim:train:files_move/7", make_traj(version=6, seed=3))
    st.add("sim:train:sheet_sum/2", make_traj(version=7, seed=4))
    newest_of_task = st.newest_fresh("sim:train:sheet_sum/1", "task", min_version=4)
    assert int(newest_of_task.versions.min()) == 5
    assert st.newest_fresh("sim:train:sheet_sum/1", "task", min_version=6) is None, "older than the bound"
    assert st.newest_fresh("sim:train:sheet_sum/9", "task", min_version=0) is None, "never solved"
    # family: any instance of sheet_sum (the id before its last '/'), never another family's
    assert int(st.newest_fresh("sim:train:sheet_sum/9", "family", min_version=4).versions.min()) == 7
    assert st.newest_fresh("sim:train:editor_append/0", "family", min_version=0) is None
    assert st.newest_fresh("sim:train:sheet_sum/9", "family", min_version=8) is None


def test_commit_thread_acks_in_order_only_after_a_sync_covering_the_data(tmp_path, quiet_log, monkeypatch):
    """Writes and flushes overlap; a job completes only after an fdatasync that started after its write,
    rotation in between keeps earlier rounds durable, and recovery sees every completed group."""
    s, _ = _open(tmp_path, quiet_log, segment_bytes=4096)  # tiny segments: rotations between rounds
    written_at: dict[str, int] = {}
    syncs_started = []
    real_append, real_sync = s.append_groups, s.sync_written

    def append(items, sync=None):
        out = real_append(items, sync)
        for gid, _ in items:
            written_at[gid] = len(syncs_started)
        s.maybe_rotate(lambda: ([], {}))
        return out

    def slow_sync():
        syncs_started.append(time.monotonic())
        time.sleep(0.01)  # a slow disk: later rounds get written while this flush runs
        real_sync()

    monkeypatch.setattr(s, "append_groups", append)
    monkeypatch.setattr(s, "sync_written", slow_sync)
    ctx = zmq.Context.instance()
    wake = ctx.socket(zmq.PULL)
    wake.bind("inproc://test-commit")
    commit = CommitThread(s, ctx, "inproc://test-commit")
    groups = [make_group(version=i) for i in range(30)]
    for i, g in enumerate(groups):
        commit.submit([(g.group_id, P.encode(g))], i)
        if i % 7 == 0:
            time.sleep(0.005)
    done = []
    deadline = time.monotonic() + 10
    while len(done) < len(groups) and time.monotonic() < deadline:
        if wake.poll(100):
            wake.recv()
        for token, locs in commit.completed():
            assert locs is not None
            # the flush that acked it began after the group was written
            assert len(syncs_started) > written_at[groups[token].group_id]
            done.append(token)
    commit.close()
    wake.close(0)
    assert done == list(range(len(groups)))
    assert len(syncs_started) < len(groups), "rounds were grouped, not one flush per group"
    s.close()
    _, rec = _open(tmp_path, quiet_log)
    assert [gid for gid, _ in rec.groups] == [g.group_id for g in groups]


@pytest.mark.parametrize("where", ["payload", "header"])
def test_bytes_changed_inside_a_segment_lose_their_record_alone_and_are_named(tmp_path, quiet_log, where):
    """Found by hand (2026-12-04): one byte flipped in the middle of a stopped run's spill segment, and recovery took
    it for a torn tail and cut the segment there, deleting the 19 acked groups after it (the audit: 20 lost). A
    stretch that is not a record, with whole records after it, is skipped: only what it held is lost, named by the
    group id its record still states where it does, and nothing is cut from the file."""
    s, _ = _open(tmp_path, quiet_log)
    groups = [make_group() for _ in range(5)]
    locs = s.append_groups([(g.group_id, P.encode(g)) for g in groups])
    s.close()
    seg = sorted(tmp_path.glob("seg-*.log"))[-1]
    data = bytearray(seg.read_bytes())
    hit = locs[2].offset + (HEADER.size + locs[2].length - 3 if where == "payload" else 1)
    data[hit] ^= 0xFF
    seg.write_bytes(bytes(data))
    _, rec = _open(tmp_path, quiet_log)
    assert [gid for gid, _ in rec.groups] == [g.group_id for i, g in enumerate(groups) if i != 2]
    assert rec.truncated_bytes == 0 and seg.stat().st_size == len(data), "nothing cut"
    (d,) = rec.damaged
    assert (d["segment"], d["offset"]) == (locs[2].segment, locs[2].offset)
    assert d["bytes"] == locs[3].offset - locs[2].offset
    assert d["group_ids"] == ([groups[2].group_id] if where == "payload" else [])
    assert SpillLog.scan(tmp_path).damaged == rec.damaged, "the audit's read-only scan sees the same"
    assert rec.missing_segments == []


def test_a_kind_byte_changed_on_disk_is_caught_and_records_written_before_the_crc_covered_it_still_read(
        tmp_path, quiet_log):
    """Found by the spill model (2026-12-04): the CRC covered a record's payload alone, so one bit changed in a consumed
    record's kind byte made it a whole snapshot, and the groups it cancelled came back with nothing said. Since
    ``CRL2`` the CRC covers the kind and length: the record is damaged, named, and its groups come back (nothing says
    they were committed) beside a damage report. A segment of ``CRL1`` records (written before) recovers as it did."""
    import struct
    import zlib

    s, _ = _open(tmp_path, quiet_log)
    groups = [make_group() for _ in range(3)]
    locs = s.append_groups([(g.group_id, P.encode(g)) for g in groups])
    s.mark_consumed([groups[0].group_id], locs[:1], {"version": 1})
    later = make_group()  # (a record after it: a changed last record reads as a torn tail, as a crash leaves one)
    (later_loc,) = s.append_groups([(later.group_id, P.encode(later))])
    groups.append(later)
    s.close()
    seg = sorted(tmp_path.glob("seg-*.log"))[-1]
    data = bytearray(seg.read_bytes())
    consumed_at = data.rfind(records.MAGIC, 0, later_loc.offset)
    assert data[consumed_at + 4] == spill_mod.KIND_CONSUMED
    data[consumed_at + 4] = spill_mod.KIND_SNAPSHOT  # (0b10 -> 0b11: one bit)
    seg.write_bytes(bytes(data))
    rec = SpillLog.scan(tmp_path)
    assert [gid for gid, _ in rec.groups] == [g.group_id for g in groups], "its group is back, not cancelled"
    assert [(d["offset"], d["group_ids"]) for d in rec.damaged] == [(consumed_at, [])], "and the damage is named"

    # The same log as a broker before CRL2 wrote it: every CRC over the payload alone.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    data[consumed_at + 4] = spill_mod.KIND_CONSUMED
    old, pos = bytearray(), 0
    for start, end, whole in records.walk(bytes(data), spill_mod._KINDS)[0]:
        assert whole
        _, kind, length, _ = HEADER.unpack_from(data, start)
        payload = bytes(data[start + HEADER.size:end])
        old += HEADER.pack(records.MAGIC_PAYLOAD_CRC, kind, length, zlib.crc32(payload)) + payload
    (legacy / seg.name).write_bytes(bytes(old))
    s2, rec2 = _open(legacy, quiet_log)
    assert [gid for gid, _ in rec2.groups] == [g.group_id for g in groups[1:]] and rec2.damaged == []
    assert P.decode(s2.read(rec2.groups[0][1])).group_id == groups[1].group_id
    assert rec2.state["version"] == 1
    s2.close()
    assert struct.unpack_from("<4s", old)[0] == b"CRL1"


def test_a_segment_gone_from_between_others_is_named(tmp_path, quiet_log):
    """The log deletes only its oldest segments, so one missing between two others was removed or lost by hand: what
    it held is lost, and recovery says which."""
    for seg in (3, 4, 7):
        (tmp_path / f"seg-{seg:08d}.log").write_bytes(b"")
    assert SpillLog.scan(tmp_path).missing_segments == [5, 6]


def test_a_write_that_fails_halfway_is_cut_back_and_the_next_record_reads_and_recovers(tmp_path, quiet_log,
                                                                                          monkeypatch):
    """A full disk stops a write partway (``ENOSPC``): the log cuts the half record off again, so the next group's
    offset is right and a restart finds it (before, the next read asked for a length of garbage and recovery stopped
    at the half record, losing every acked group after it). ``tests/test_spill_model.py`` draws many such faults."""
    s, _ = _open(tmp_path, quiet_log)
    real_writev = os.writev
    g0, g1, g2 = make_group(), make_group(), make_group()
    s.append_groups([(g0.group_id, P.encode(g0))])

    def full_disk(fd, parts):
        flat = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        real_writev(fd, [flat[: len(flat) // 2]])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spill_mod.os, "writev", full_disk)
    with pytest.raises(OSError):
        s.append_groups([(g1.group_id, P.encode(g1))])
    monkeypatch.setattr(spill_mod.os, "writev", real_writev)
    assert s.write_failures == 1 and not s.broken
    (loc2,) = s.append_groups([(g2.group_id, P.encode(g2))])
    assert P.decode(s.read(loc2)).group_id == g2.group_id
    s.close()
    _, rec = _open(tmp_path, quiet_log)
    assert [gid for gid, _ in rec.groups] == [g0.group_id, g2.group_id] and rec.truncated_bytes == 0


def test_a_success_store_whose_write_failed_rewrites_itself_whole_once_a_retry_succeeds(tmp_path, quiet_log):
    """A failed write (a full disk) lets the file go, counted; the next addition after the retry interval rewrites
    the whole store from memory, so the file holds every success again and none after a torn record."""
    class FullDisk:
        def write(self, data):
            raise OSError(28, "No space left on device")

        flush = close = lambda self: FullDisk.write(self, b"")

    path = tmp_path / "success.log"
    st = SuccessStore(per_task=4, max_tasks=10, path=path, log=quiet_log)
    st.add("a", make_traj(seed=1))
    st.flush()
    st._f.close()
    st._f = FullDisk()
    st.add("a", make_traj(seed=2))  # fails: let go, counted
    assert st.write_failures == 1 and st._f is None
    st._rewrite_at = 0.0  # (the retry interval is over)
    st.add("b", make_traj(seed=3))  # the retry: the whole store rewritten, this one with it
    st.close()
    again = SuccessStore(per_task=4, max_tasks=10, path=path, log=quiet_log)
    assert len(again) == 3 and sorted(again.tasks) == ["a", "b"]

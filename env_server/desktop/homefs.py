"""The host's side of a desktop's home folder, which the desktop itself can change at any moment.

The host (root, when the sandbox drops to ``nobody``) touches the home in two places: the verifier reads
the files the desktop saved, and a reset wipes the home and writes the next task's files. Both would be
an escape if they followed a link the desktop planted (``Documents -> /etc``, ``report.txt -> /dev/zero``).
So neither uses paths into the home: every step opens one name relative to its parent's descriptor with
``O_NOFOLLOW`` (a link is refused where it stands, even one swapped in mid-walk), and reads are capped.

- ``snapshot`` copies the home's regular files and folders into a private folder (links, devices, FIFOs
  and sockets are left out and counted; sizes capped), and the verifier reads that copy.
- ``refill`` empties the home and writes a staged folder's contents into it. When the sandbox runs as
  another user, the home is first taken from it (owned by root, not writable by others), so the desktop
  cannot create anything in it while the reset runs; the entries are handed back, deepest first, at the end.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO must not block the open


class HomeError(OSError):
    """The home could not be read or reset without leaving it (a planted link, a racing change)."""


@dataclass
class SnapshotLimits:
    max_file_bytes: int = 64 << 20
    max_total_bytes: int = 256 << 20
    max_entries: int = 10_000
    max_depth: int = 16


@dataclass
class SnapshotReport:
    files: int = 0
    bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1


def _open_dir(name: str | Path, dir_fd: int | None = None) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise HomeError(exc.errno, f"{name} is not a folder (a link?): refused") from None
        raise


def snapshot(home: Path, dest: Path, limits: SnapshotLimits | None = None) -> SnapshotReport:
    """Copy ``home``'s regular files and folders into the empty folder ``dest``, following no link."""
    limits = limits or SnapshotLimits()
    report = SnapshotReport()
    src = _open_dir(home)
    try:
        _copy_tree(src, dest, limits, report, 0)
    finally:
        os.close(src)
    return report


def _copy_tree(src_fd: int, dest: Path, limits: SnapshotLimits, report: SnapshotReport, depth: int) -> None:
    for entry in sorted(os.listdir(src_fd)):
        if report.files >= limits.max_entries:
            report.skip("too_many_entries")
            return
        try:
            st = os.stat(entry, dir_fd=src_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed while we walk
        if stat.S_ISDIR(st.st_mode):
            if depth >= limits.max_depth:
                report.skip("too_deep")
                continue
            try:
                sub = _open_dir(entry, src_fd)
            except (HomeError, FileNotFoundError):
                report.skip("changed_while_read")
                continue
            try:
                (dest / entry).mkdir()
                _copy_tree(sub, dest / entry, limits, report, depth + 1)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            _copy_file(src_fd, entry, dest / entry, limits, report)
        else:
            report.skip("link" if stat.S_ISLNK(st.st_mode) else "special_file")


def _copy_file(src_fd: int, name: str, out: Path, limits: SnapshotLimits, report: SnapshotReport) -> None:
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=src_fd)
    except OSError:  # swapped for a link (ELOOP), or removed, since the stat
        report.skip("changed_while_read")
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            report.skip("special_file")
            return
        budget = min(limits.max_file_bytes, limits.max_total_bytes - report.bytes)
        if st.st_size > budget:
            report.skip("too_large")
            return
        chunks, got = [], 0
        while got <= budget:
            chunk = os.read(fd, min(1 << 20, budget + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > budget:  # it grew while we read
            report.skip("too_large")
            return
    finally:
        os.close(fd)
    out.write_bytes(b"".join(chunks))
    report.files += 1
    report.bytes += got


def refill(home: Path, staged: Path, owner: int | None) -> None:
    """Empty ``home`` and copy ``staged`` (a host folder the desktop cannot reach) into it, following no
    link. ``owner``: the uid (and gid) the desktop runs as when it is not ours; it gets the home back at
    the end, and has no write access to it until then."""
    parent = _open_dir(home.parent)
    try:
        home_fd = _open_dir(home.name, parent)
    finally:
        os.close(parent)
    try:
        if owner is not None:
            os.fchown(home_fd, 0, 0)  # from here the desktop can add nothing to the home's top level
            os.fchmod(home_fd, 0o755)
        for entry in os.listdir(home_fd):
            st = os.stat(entry, dir_fd=home_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(entry, dir_fd=home_fd)  # descriptor-based: it never follows a link
            else:
                os.unlink(entry, dir_fd=home_fd)
        src = _open_dir(staged)
        try:
            _write_tree(src, home_fd, owner)
        finally:
            os.close(src)
        if owner is not None:
            os.fchown(home_fd, owner, owner)
    finally:
        os.close(home_fd)


def _write_tree(src_fd: int, dst_fd: int, owner: int | None) -> None:
    for entry in sorted(os.listdir(src_fd)):
        st = os.stat(entry, dir_fd=src_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(entry, 0o755, dir_fd=dst_fd)
            sub_src, sub_dst = _open_dir(entry, src_fd), _open_dir(entry, dst_fd)
            try:
                _write_tree(sub_src, sub_dst, owner)
                if owner is not None:  # deepest first: the desktop gets a folder once it is complete
                    os.fchown(sub_dst, owner, owner)
            finally:
                os.close(sub_src)
                os.close(sub_dst)
        elif stat.S_ISLNK(st.st_mode):  # from the operator's home template: created, never followed
            os.symlink(os.readlink(entry, dir_fd=src_fd), entry, dir_fd=dst_fd)
            if owner is not None:
                os.chown(entry, owner, owner, dir_fd=dst_fd, follow_symlinks=False)
        elif stat.S_ISREG(st.st_mode):
            fd_in = os.open(entry, _READ_FLAGS, dir_fd=src_fd)
            fd_out = os.open(entry, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             stat.S_IMODE(st.st_mode) | 0o600, dir_fd=dst_fd)
            try:
                while chunk := os.read(fd_in, 1 << 20):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd_out, view):]
                if owner is not None:
                    os.fchown(fd_out, owner, owner)
            finally:
                os.close(fd_in)
                os.close(fd_out)

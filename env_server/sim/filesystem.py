"""The simulated file system: folders and text files under the home folder."""

from __future__ import annotations

import posixpath
from typing import Any

from env_server.actions import ActionError


HOME = "/home/user"


class FileSystem:
    """Folders and text files under /home/user; paths may be absolute or relative to home."""

    def __init__(self) -> None:
        self.dirs: set[str] = {HOME}
        self.files: dict[str, str] = {}
        self.mtime: dict[str, int] = {}
        self.clock = 0

    def norm(self, path: Any) -> str:
        if not isinstance(path, str) or not path.strip():
            raise ActionError("a path must be a non-empty string")
        p = path.strip()
        p = posixpath.normpath(p if p.startswith("/") else posixpath.join(HOME, p))
        if p != HOME and not p.startswith(HOME + "/"):
            raise ActionError(f"{path!r} is outside {HOME}")
        return p

    def exists(self, p: str) -> bool:
        return p in self.dirs or p in self.files

    # The file-system interface ``apis.files_call`` runs the shared Files API on (absolute paths).
    def isdir(self, p: str) -> bool:
        return p in self.dirs

    def makedirs(self, p: str) -> None:
        p = self.norm(p)
        parent = posixpath.dirname(p)
        if parent not in self.dirs:
            self.makedirs(parent)
        self.mkdir(p)

    def rename(self, src: str, dst: str) -> None:
        self.move(self.norm(src), self.norm(dst))

    def remove(self, p: str) -> None:
        self.delete(self.norm(p))

    rmdir = remove

    def read_text(self, p: str, limit: int) -> str:
        return self.read(self.norm(p))[:limit]

    def write_text(self, p: str, text: str) -> None:
        self.write(self.norm(p), text)

    def listdir(self, d: str) -> list[str]:
        return [name for name, _ in self.entries(self.norm(d))]

    def entries(self, d: str) -> list[tuple[str, bool]]:
        """(name, is_dir) sorted folders first."""
        prefix = d.rstrip("/") + "/"
        out = [(p[len(prefix):], True) for p in self.dirs if p.startswith(prefix) and "/" not in p[len(prefix):]]
        out += [(p[len(prefix):], False) for p in self.files if p.startswith(prefix) and "/" not in p[len(prefix):]]
        return sorted(out, key=lambda e: (not e[1], e[0].lower()))

    def mkdir(self, p: str) -> None:
        if self.exists(p):
            raise ActionError(f"{p} already exists")
        if posixpath.dirname(p) not in self.dirs:
            raise ActionError(f"no folder {posixpath.dirname(p)}")
        self.dirs.add(p)

    def write(self, p: str, text: str) -> None:
        if p in self.dirs:
            raise ActionError(f"{p} is a folder")
        if posixpath.dirname(p) not in self.dirs:
            raise ActionError(f"no folder {posixpath.dirname(p)}")
        self.files[p] = text
        self.clock += 1
        self.mtime[p] = self.clock

    def read(self, p: str) -> str:
        if p not in self.files:
            raise ActionError(f"no file {p}")
        return self.files[p]

    def move(self, src: str, dst: str) -> None:
        if not self.exists(src):
            raise ActionError(f"no file or folder {src}")
        if self.exists(dst):
            raise ActionError(f"{dst} already exists")
        if posixpath.dirname(dst) not in self.dirs:
            raise ActionError(f"no folder {posixpath.dirname(dst)}")
        if src in self.dirs:
            if dst == src or dst.startswith(src + "/"):
                raise ActionError("cannot move a folder into itself")
            for d in sorted(x for x in self.dirs if x == src or x.startswith(src + "/")):
                self.dirs.discard(d)
                self.dirs.add(dst + d[len(src):])
            for f in [x for x in self.files if x.startswith(src + "/")]:
                self.files[dst + f[len(src):]] = self.files.pop(f)
                self.mtime[dst + f[len(src):]] = self.mtime.pop(f, 0)
        else:
            self.files[dst] = self.files.pop(src)
            self.mtime[dst] = self.mtime.pop(src, 0)

    def delete(self, p: str) -> None:
        if p == HOME:
            raise ActionError("cannot delete the home folder")
        if p in self.files:
            del self.files[p]
            self.mtime.pop(p, None)
        elif p in self.dirs:
            for d in [x for x in self.dirs if x == p or x.startswith(p + "/")]:
                self.dirs.discard(d)
            for f in [x for x in self.files if x.startswith(p + "/")]:
                del self.files[f]
        else:
            raise ActionError(f"no file or folder {p}")

"""The Files API (``apis.files_call``) on the sandbox's own file system.

Part of the in-desktop agent (``agent.py``): runs inside the sandbox on the system python3, imported by name
from the agent's folder."""

from __future__ import annotations

import os

import apis  # a sibling file: agent.py put this folder on the path
from agent_base import ActionFailure


class HostFiles:
    """The sandbox's own file system, as ``apis.files_call`` reads and changes it."""

    isdir = staticmethod(os.path.isdir)
    exists = staticmethod(os.path.lexists)
    listdir = staticmethod(os.listdir)
    makedirs = staticmethod(os.makedirs)
    rename = staticmethod(os.rename)
    remove = staticmethod(os.remove)
    rmdir = staticmethod(os.rmdir)

    @staticmethod
    def read_text(path: str, limit: int) -> str:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(limit)

    @staticmethod
    def write_text(path: str, text: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def files_call(method: str, a: dict):
    try:
        return apis.files_call(method, a, HostFiles)
    except apis.FilesError as exc:
        raise ActionFailure(str(exc)) from None

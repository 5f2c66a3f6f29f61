"""Worker processes of the benchmarks: a common start line, results that never hang on a dead worker."""

from __future__ import annotations

import queue
import time
from typing import Any, Callable, Sequence


def start_together(procs: Sequence[Any], barrier: tuple[Any, Any], what: str, timeout_s: float = 120.0,
                   watch: Sequence[Any] = (), go: bool = True) -> None:
    """Start ``procs``; each releases ``barrier[0]`` once set up, and all go when ``barrier[1]`` is set (at once, or
    by the caller when ``go`` is False, to measure between ready and go). A worker, or a process in ``watch`` (the
    server they set up against), that dies meanwhile fails the bench at once."""
    ready, start = barrier
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for _ in procs:
        while not ready.acquire(timeout=0.5):
            dead = [p for p in [*procs, *watch] if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{what}: {dead[0].name} exited with code {dead[0].exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not become ready within {timeout_s:.0f} s")
    if go:
        start.set()


def await_go(barrier: tuple[Any, Any], poll: Callable[[float], Any]) -> None:
    """A worker's side of ``start_together``: report ready, then keep its links alive (``poll``: heartbeats)
    until everyone is ready."""
    ready, go = barrier
    ready.release()
    while not go.is_set():
        poll(0.05)


def await_result(results: Any, procs: Sequence[Any], timeout_s: float) -> Any:
    """The next result; a worker that crashed fails the bench at once instead of hanging it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.terminate()
                raise RuntimeError(f"bench worker {dead[0].name} exited with code {dead[0].exitcode}")
    raise RuntimeError(f"no result within {timeout_s:.0f} s")


def reap(procs: Sequence[Any], timeout_s: float = 10.0) -> None:
    """Join the workers; terminate those that do not end in time."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(5)

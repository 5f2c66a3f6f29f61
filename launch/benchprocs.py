"""Worker processes of the benchmarks: a common start line, results that never hang on a dead worker."""

from __future__ import annotations

import queue
import time
from typing import Any, Sequence


def start_together(procs: Sequence[Any], barrier: tuple[Any, Any], what: str, timeout_s: float = 120.0) -> None:
    """Start ``procs``; each releases ``barrier[0]`` once set up, and all go when ``barrier[1]`` is set."""
    ready, go = barrier
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=timeout_s):
            raise RuntimeError(f"{what} did not become ready within {timeout_s:.0f} s")
    go.set()


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

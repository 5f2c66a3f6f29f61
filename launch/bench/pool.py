"""N desktops at once, in threads as the env_server's workers run them, each playing its tasks' scripted solvers
(``Backend.scripted_actions``): the concurrency figure of the real-desktop and MiniWoB benches."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Callable

from launch.procmem import mem_available_mb, pss_mb


def play_concurrently(make: Callable[[], Any], task_id: Callable[[int], str], workers: int, total_steps: int,
                      process_root: Callable[[Any], int], unit: str = "desktop", ramp_s: float = 0.0,
                      warm_episodes: int = 1, restarts: Callable[[Any], int] | None = None,
                      max_seconds: float = 1800.0) -> dict:
    """``workers`` desktops from ``make()`` play task ``task_id(seed)`` (seeds k, k + workers, ...) until
    ``total_steps`` steps are done. Desktops start ``ramp_s`` apart (as sessions arrive); one that fails is closed
    and replaced, as the env_server does, and the failure counted. Memory is the PSS of ``process_root(desktop)``'s
    process tree once a desktop has played ``warm_episodes`` episodes; ``restarts(desktop)`` counts rebuilds a
    desktop did by itself. Figures are named after ``unit`` (desktops, browsers)."""
    free_before = mem_available_mb()
    lock = threading.Lock()
    counts = {"steps": 0, "episodes": 0, "solved": 0, "failures": 0, "restarts": 0}
    errors: list[str] = []
    unsolved: list[dict] = []
    pss: list[float] = []
    deadline = time.monotonic() + max_seconds

    def play(k: int) -> None:
        time.sleep(k * ramp_s)
        backend = make()
        seed, measured = k, False
        try:
            while True:
                with lock:
                    if counts["steps"] >= total_steps or time.monotonic() > deadline:
                        return
                try:
                    backend.reset(task_id(seed))
                    refused = []
                    for action in backend.scripted_actions():
                        r = backend.step(action)
                        if r.action_error or r.format_error:
                            refused.append(f"{action} -> {r.obs['last_result']}"[:200])
                        with lock:
                            counts["steps"] += 1
                        if r.done:
                            break
                    solved = backend.evaluate()["success"]
                    with lock:
                        counts["episodes"] += 1
                        counts["solved"] += bool(solved)
                        if not solved:  # which task, and what the desktop refused on the way
                            unsolved.append({"task": backend.task.task_id, "refused": refused[:3]})
                    if not measured and seed >= k + warm_episodes * workers:
                        pss.append(pss_mb(process_root(backend)))
                        measured = True
                except Exception as exc:  # counted and reported: the figure is how many there were
                    with lock:
                        counts["failures"] += 1
                        errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    backend.close()
                    backend = make()
                seed += workers
        finally:
            if restarts is not None:
                with lock:
                    counts["restarts"] += restarts(backend)
            backend.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=play, args=(k,)) for k in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    per_unit = statistics.median(pss) if pss else 0.0
    out = {f"{unit}s": workers, "steps": counts["steps"], "episodes": counts["episodes"],
           "solver_success": round(counts["solved"] / max(1, counts["episodes"]), 3), "unsolved": unsolved[:5],
           "failures": counts["failures"], "errors": errors[:5], "steps_per_s": round(counts["steps"] / wall, 2),
           "episodes_per_s": round(counts["episodes"] / wall, 2), f"memory_per_{unit}_mb": round(per_unit, 1),
           f"{unit}s_per_node_by_memory": int(free_before // per_unit) if per_unit else 0, "wall_s": round(wall, 1)}
    if restarts is not None:
        out["rebuilt_on_reset"] = counts["restarts"]
    return out

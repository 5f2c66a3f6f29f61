"""``computerrl bench env --backend xvfb``: real desktops — step latency, resets, concurrency and memory.

Three figures, each with its baseline measured in the same run:
- step latency on the GTK editor: a full backend step (parse the action, XTEST input, JPEG screenshot, AT-SPI
  tree, observation assembly) against the raw agent round trips doing the same input and grabs without the
  backend (``overhead`` is their ratio);
- reset time with LibreOffice (fresh home, document loaded through UNO);
- N desktops at once, each playing every task's scripted solver until the steps run out, as the env_server's
  worker threads would: failures, solver success, steps/s, and memory per desktop (PSS of the sandbox's
  processes), from which desktops per node follow for this host's free memory.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

from env_server.desktop import tasks as desk_tasks
from env_server.desktop.backend import DesktopConfig, XvfbBackend
from launch.procmem import mem_available_mb, pss_mb


def editor_latency(steps: int) -> dict:
    """Median step on the GTK editor: backend step vs the agent's raw round trips for the same work."""
    backend = XvfbBackend(DesktopConfig(office=False, screenshot="jpeg", settle_s=0.0))
    try:
        backend.reset("desk:train:editor_append/0")
        full, raw = [], []
        for i in range(steps):
            t = time.perf_counter()
            backend.step(f"type({chr(97 + i % 26)!r})")
            full.append(time.perf_counter() - t)
            t = time.perf_counter()
            backend.agent.call("type", text=chr(97 + i % 26))
            backend.agent.call("observe", screenshot="jpeg", quality=75, cap=300, child_cap=60, settle=0.0)
            raw.append(time.perf_counter() - t)
        return {"editor_step_ms_median": round(1000 * statistics.median(full), 1),
                "editor_step_ms_p90": round(1000 * sorted(full)[int(0.9 * len(full))], 1),
                "raw_agent_step_ms_median": round(1000 * statistics.median(raw), 1),
                "overhead": round(statistics.median(full) / statistics.median(raw), 3)}
    finally:
        backend.close()


def office_resets(n: int) -> dict:
    backend = XvfbBackend(DesktopConfig(office=True, screenshot="jpeg"))
    try:
        t = time.perf_counter()
        backend.reset("desk:train:calc_set_cell/0")  # the first one starts the sandbox and LibreOffice
        first = time.perf_counter() - t
        times = []
        for i in range(n):
            t = time.perf_counter()
            backend.reset(f"desk:train:calc_set_cell,writer_replace/{i + 1}")
            times.append(time.perf_counter() - t)
        return {"office_first_reset_s": round(first, 2), "office_reset_s_median": round(statistics.median(times), 2),
                "office_reset_s_max": round(max(times), 2)}
    finally:
        backend.close()


def concurrent(desktops: int, total_steps: int, ramp_s: float = 1.0, max_seconds: float = 1800.0) -> dict:
    """``desktops`` desktops in threads playing solvers of every family until ``total_steps`` are done.

    Desktops start ``ramp_s`` apart (as sessions arrive at an env_server); a desktop that fails is closed and
    replaced, as the env_server does, and the failure counted."""
    free_before = mem_available_mb()
    lock = threading.Lock()
    counts = {"steps": 0, "episodes": 0, "solved": 0, "failures": 0, "rebuilt_on_reset": 0}
    errors: list[str] = []
    unsolved: list[dict] = []
    pss: list[float] = []
    deadline = time.monotonic() + max_seconds

    def play(k: int) -> None:
        time.sleep(k * ramp_s)
        backend = XvfbBackend(DesktopConfig(office=True, screenshot="jpeg"))
        seed, measured = k, False
        try:
            while True:
                with lock:
                    if counts["steps"] >= total_steps or time.monotonic() > deadline:
                        return
                try:
                    backend.reset(f"desk:train/{seed}")
                    refused = []
                    for action in desk_tasks.solver(backend.task):
                        r = backend.step(action)
                        if r.action_error or r.format_error:
                            refused.append(f"{action} -> {r.obs['last_result']}"[:200])
                        with lock:
                            counts["steps"] += 1
                    solved = backend.evaluate()["success"]
                    with lock:
                        counts["episodes"] += 1
                        counts["solved"] += bool(solved)
                        if not solved:  # which task, and what the desktop refused on the way
                            unsolved.append({"task": backend.task.task_id, "refused": refused[:3]})
                    if not measured and seed >= k + desktops:  # after its second episode: apps loaded and warm
                        pss.append(pss_mb(backend.sandbox.proc.pid))
                        measured = True
                except Exception as exc:  # counted and reported: the figure is how many there were
                    with lock:
                        counts["failures"] += 1
                        errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    backend.close()
                    backend = XvfbBackend(DesktopConfig(office=True, screenshot="jpeg"))
                seed += desktops
        finally:
            with lock:
                counts["rebuilt_on_reset"] += backend.restarts
            backend.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=play, args=(k,)) for k in range(desktops)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    per_desktop = statistics.median(pss) if pss else 0.0
    return {"desktops": desktops, "steps": counts["steps"], "episodes": counts["episodes"],
            "solver_success": round(counts["solved"] / max(1, counts["episodes"]), 3),
            "unsolved": unsolved[:5], "failures": counts["failures"], "rebuilt_on_reset": counts["rebuilt_on_reset"],
            "errors": errors[:5],
            "steps_per_s": round(counts["steps"] / wall, 2), "memory_per_desktop_mb": round(per_desktop, 1),
            "desktops_per_node_by_memory": int(free_before // per_desktop) if per_desktop else 0,
            "wall_s": round(wall, 1)}


def run_bench(desktops: int, steps: int, latency_steps: int = 60, resets: int = 10) -> dict:
    out = {"backend": "xvfb"}
    out.update(editor_latency(latency_steps))
    out.update(office_resets(resets))
    out.update(concurrent(desktops, steps))
    out["host_cpus"] = os.cpu_count()
    return out

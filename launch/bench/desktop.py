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
import time

from env_server.desktop.backend import DesktopConfig, XvfbBackend
from launch.bench.pool import play_concurrently


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


def concurrent(desktops: int, total_steps: int, ramp_s: float = 1.0) -> dict:
    """``desktops`` desktops playing every family's solver until ``total_steps`` are done, started ``ramp_s`` apart;
    memory measured after a desktop's second episode (apps loaded and warm)."""
    return play_concurrently(lambda: XvfbBackend(DesktopConfig(office=True, screenshot="jpeg")),
                             lambda seed: f"desk:train/{seed}", desktops, total_steps,
                             lambda b: b.sandbox.proc.pid, "desktop", ramp_s, warm_episodes=1,
                             restarts=lambda b: b.restarts)


def run_bench(desktops: int, steps: int, latency_steps: int = 60, resets: int = 10) -> dict:
    out = {"backend": "xvfb"}
    out.update(editor_latency(latency_steps))
    out.update(office_resets(resets))
    out.update(concurrent(desktops, steps))
    out["host_cpus"] = os.cpu_count()
    return out

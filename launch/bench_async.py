"""``computerrl bench async``: the same learner steps synchronously (η = 0) and asynchronously (η ≥ 1).

Both runs are ``computerrl run`` on the same config, with slow and uneven desktops (sim latency injection:
lognormal step delays, and a per-desktop speed factor). With η = 0 admission grants exactly the groups of
the current version, so actors wait for every update (synchronous RL); with η ≥ 1 they keep rolling out
while the learner trains. Printed: wall seconds of each run (every role ready -> the learner's last step),
``speedup`` = sync / async, and the final held-out success of each (from the run's last evaluation), so
the speed is compared at equal quality.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from launch.local import free_port_overrides


@dataclass
class AsyncBenchSetup:
    """What both runs share, and the asynchronous run's staleness bound."""

    steps: int = 10
    """learner steps in each run"""
    async_eta: int = 2
    """staleness bound of the asynchronous run (the synchronous one has 0)"""
    latency_s: float = 1.0
    """mean injected env step delay (lognormal, sigma 0.5)"""
    spread: float = 0.7
    """lognormal sigma of per-desktop speed factors (some desktops are several times slower)"""
    max_groups: int = 4
    """groups each actor keeps in flight; with eta = 0 admission still grants one batch per version"""
    eval_episodes: int = 25
    """held-out episodes per family evaluated on each run's final checkpoint"""


def _run(config: str, setup: AsyncBenchSetup, eta: int, run_dir: Path, extra: list[str]) -> dict:
    overrides = [f"broker.eta={eta}", f"learner.total_steps={setup.steps}", "learner.checkpoint_every=0",
                 f"actor.max_groups={setup.max_groups}", f"local.eval_episodes={setup.eval_episodes}",
                 "local.eval_start=false",  # only the final policies are compared; nothing else shares the cores
                 "env_server.sim.latency=lognormal", f"env_server.sim.latency_mean_s={setup.latency_s}",
                 "env_server.sim.latency_sigma=0.5", f"env_server.sim.latency_desktop_sigma={setup.spread}",
                 *free_port_overrides(), *extra]
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "run", config, *overrides, "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # The clock starts when every role is up (the supervisor's "started" line): process start-up and model
    # loading cost both runs the same and are not what the staleness bound changes.
    ready_at = None
    tail: list[str] = []
    for line in proc.stdout:
        if ready_at is None and line.startswith("[computerrl] started:"):
            ready_at = time.time()
        tail = (tail + [line])[-40:]
    if proc.wait() != 0 or ready_at is None:
        raise RuntimeError(f"run with eta={eta} failed:\n{''.join(tail)}")
    # Until the learner's last step: the final evaluation and the shutdown are not part of the comparison.
    steps_done = [json.loads(x) for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()]
    seconds = steps_done[-1]["time"] - ready_at
    evals = [json.loads(x) for x in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics" / "eval.jsonl").exists() else []
    return {"seconds": seconds, "heldout_success": evals[-1]["success_rate"] if evals else None}


def run_bench(config: str, setup: AsyncBenchSetup, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        sync = _run(config, setup, 0, Path(tmp) / "sync", extra)
        asyn = _run(config, setup, setup.async_eta, Path(tmp) / "async", extra)
    return {"steps": setup.steps, "async_eta": setup.async_eta, "latency_mean_s": setup.latency_s,
            "desktop_spread": setup.spread, "max_groups": setup.max_groups,
            "sync_seconds": round(sync["seconds"], 1), "async_seconds": round(asyn["seconds"], 1),
            "speedup": round(sync["seconds"] / asyn["seconds"], 3),
            "sync_heldout_success": sync["heldout_success"], "async_heldout_success": asyn["heldout_success"],
            "heldout_episodes": setup.eval_episodes}

"""``computerrl bench async``: the same learner steps synchronously (η = 0) and asynchronously (η ≥ 1).

Both runs are ``computerrl run`` on the same config, with slow and uneven desktops (sim latency injection:
lognormal step delays, and a per-desktop speed factor). With η = 0 admission grants exactly the groups of
the current version, so actors wait for every update (synchronous RL); with η ≥ 1 they keep rolling out
while the learner trains. Printed: wall seconds of each run (every role ready -> the learner's last step),
``speedup`` = sync / async, and the final held-out success of each (from the run's last evaluation), so
the speed is compared at equal quality.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common.metrics.records import read_records
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
    learner = read_records(run_dir / "metrics" / "learner.jsonl")
    end = learner[-1]["time"]
    seconds = end - ready_at
    evals = read_records(run_dir / "metrics" / "eval.jsonl")
    return {"seconds": seconds, "heldout_success": evals[-1]["success_rate"] if evals else None,
            **_learner_bound(learner[-1], seconds), **_role_idle(run_dir / "metrics", ready_at, end)}


def _learner_bound(last: dict, seconds: float) -> dict:
    """The learner-bound limit: the learner's own busy time (steps, weight rounds, bookkeeping) from its loop's
    time split. A run can go no faster than that; its idle fraction is the rest of the timed window."""
    busy = sum(v for k, v in last.items() if k.startswith("time_") and k.endswith("_s") and k != "time_wait_s")
    return {"learner_busy_s": busy, "learner_train_s": last.get("time_train_s", 0.0),
            "learner_broadcast_s": last.get("time_broadcast_s", 0.0),
            "learner_idle_frac": max(0.0, 1 - busy / seconds) if seconds > 0 else None}


def _role_idle(metrics: Path, t0: float, t1: float) -> dict:
    """Each role's own idle ratio over the timed window: what held the learner back when it waited."""
    def window(name: str) -> list[dict]:
        return [r for r in read_records(metrics / name) if t0 <= r.get("time", 0) <= t1 + 5]

    actors = [recs[-1]["engine_idle_ratio"] for f in sorted(metrics.glob("actor-*.jsonl"))
              if (recs := window(f.name)) and "engine_idle_ratio" in recs[-1]]
    env = [1 - r["busy_sessions"] / r["sessions"] for f in sorted(metrics.glob("env_server-*.jsonl"))
           for r in window(f.name) if r.get("sessions")]
    broker = [r["busy_fraction"] for r in window("broker.jsonl") if "busy_fraction" in r]
    mean = (lambda xs: round(sum(xs) / len(xs), 3) if xs else None)
    return {"actor_engine_idle_ratio": mean(actors), "env_session_idle_ratio": mean(env),
            "broker_busy_fraction": mean(broker)}


def run_bench(config: str, setup: AsyncBenchSetup, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        sync = _run(config, setup, 0, Path(tmp) / "sync", extra)
        asyn = _run(config, setup, setup.async_eta, Path(tmp) / "async", extra)
    return {"steps": setup.steps, "async_eta": setup.async_eta, "latency_mean_s": setup.latency_s,
            "desktop_spread": setup.spread, "max_groups": setup.max_groups,
            # three decimals, not one: the ratios below are derived from these, and a reader checks them so
            "sync_seconds": round(sync["seconds"], 3), "async_seconds": round(asyn["seconds"], 3),
            "speedup": round(sync["seconds"] / asyn["seconds"], 3),
            "sync_heldout_success": sync["heldout_success"], "async_heldout_success": asyn["heldout_success"],
            "heldout_episodes": setup.eval_episodes,
            **{f"async_{k}": round(v, 3) if isinstance(v, float) else v for k, v in asyn.items()
               if k not in ("seconds", "heldout_success")},
            "async_over_learner_bound": round(asyn["seconds"] / asyn["learner_busy_s"], 3)
            if asyn["learner_busy_s"] else None,
            "sync_learner_idle_frac": round(sync["learner_idle_frac"], 3)}

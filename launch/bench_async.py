"""``computerrl bench async``: the same learner steps synchronously (η = 0) and asynchronously (η ≥ 1).

Both runs are ``computerrl run`` on the same config, with slow and uneven desktops (sim latency injection:
lognormal step delays, and a per-desktop speed factor). With η = 0 admission grants exactly the groups of
the current version, so actors wait for every update (synchronous RL); with η ≥ 1 they keep rolling out
while the learner trains. Printed: wall seconds of each run, ``speedup`` = sync / async, and the final
held-out success of each (from the run's last evaluation), so the speed is compared at equal quality.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.net import free_port


def _run(config: str, eta: int, steps: int, latency_s: float, spread: float, run_dir: Path, extra: list[str]) -> dict:
    port = free_port()
    overrides = [f"broker.eta={eta}", f"learner.total_steps={steps}", "learner.checkpoint_every=0",
                 "env_server.sim.latency=lognormal", f"env_server.sim.latency_mean_s={latency_s}",
                 "env_server.sim.latency_sigma=0.5", f"env_server.sim.latency_desktop_sigma={spread}",
                 f"net.broker_front_port={free_port()}", f"net.broker_back_port={free_port()}",
                 f"net.broker_control_port={free_port()}", f"env_server.port={port}",
                 f"actor.env_servers=['127.0.0.1:{port}']", f"weights.port={free_port()}", *extra]
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "launch.cli", "run", config, *overrides, "--run-dir", str(run_dir)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"run with eta={eta} failed:\n{out.stdout[-2000:]}")
    # Until the learner's last step: the final evaluation and the shutdown are not part of the comparison.
    steps_done = [json.loads(x) for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()]
    seconds = steps_done[-1]["time"] - t0
    evals = [json.loads(x) for x in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics" / "eval.jsonl").exists() else []
    return {"seconds": seconds, "heldout_success": evals[-1]["success_rate"] if evals else None}


def run_bench(config: str, steps: int, async_eta: int, latency_s: float, spread: float, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        sync = _run(config, 0, steps, latency_s, spread, Path(tmp) / "sync", extra)
        asyn = _run(config, async_eta, steps, latency_s, spread, Path(tmp) / "async", extra)
    return {"steps": steps, "async_eta": async_eta, "latency_mean_s": latency_s, "desktop_spread": spread,
            "sync_seconds": round(sync["seconds"], 1), "async_seconds": round(asyn["seconds"], 1),
            "speedup": round(sync["seconds"] / asyn["seconds"], 3),
            "sync_heldout_success": sync["heldout_success"], "async_heldout_success": asyn["heldout_success"]}

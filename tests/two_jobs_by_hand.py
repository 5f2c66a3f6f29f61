"""Two runs' jobs on one node of a throwaway three-node Slurm cluster, both on the default ports: how docs/slurm.md
("Two jobs on one node") was measured. Not a test (minutes per case): run it by hand, as root, with Slurm installed
(``bash launch/slurm-packages.sh``).

    python -m tests.two_jobs_by_hand                    # slurm.ports: auto, the default
    python -m tests.two_jobs_by_hand slurm.ports=config # every port as configured: the second job cannot bind

It prints each job's attempts, the ports its broker bound, its learner steps and ``computerrl audit``, and leaves
the cluster's logs and the run directories where it says."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from launch.slurm import attempts_ended
from tests.slurm_cluster import SlurmCluster, by_hand_root
from tests.test_slurm import _cli, _learner_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="run config overrides (dotted key=value) for both jobs")
    ap.add_argument("--steps", type=int, default=4, help="learner steps of each run")
    args = ap.parse_args()
    root = by_hand_root("computerrl-two-jobs-")
    cluster = SlurmCluster(root, nodes=3)
    cluster.start()
    jobs: dict[str, Path] = {}
    try:
        for name in ("first", "second"):
            run_dir = root / name
            # One node each, the same node for both (nodes are shared: slurm.exclusive is off); CURVE on, as
            # across real nodes; Slurm is the point, not the recipe.
            out = _cli(cluster, "slurm", "submit", "configs/local.yaml", "net.curve=on", "slurm.nodes=1",
                       "slurm.sbatch_lines=['--nodelist=cn1']", "local.actors=1", "local.eval_episodes=0",
                       "weights.join_window_s=0.5", f"learner.total_steps={args.steps}", "learner.anchor.suite=",
                       "broker.group_size=4", "local.max_restarts=2", *args.overrides, "--run-dir", str(run_dir))
            jobs[out.split("submitted job ")[1].split(";")[0]] = run_dir
        deadline = time.monotonic() + 900
        while any(cluster.job_state(job) for job in jobs) and time.monotonic() < deadline:
            time.sleep(2)
    finally:
        for job in jobs:
            cluster.run("scancel", job, check=False)
        cluster.stop()
    for job, run_dir in jobs.items():
        log = (run_dir / "logs" / f"slurm-{job}.out").read_text(errors="replace")
        print(f"== job {job} ({run_dir.name})")
        print("\n".join(line for line in log.splitlines() if any(w in line for w in ("ports", "outcome", "giving up"))))
        for a in attempts_ended(run_dir):
            print(f"attempt {a['attempt']}: {a['ended']} (exit {a['exit_code']}), {a['after']}")
        print("learner steps:", [r["step"] for r in _learner_steps(run_dir)])
        print(_cli(cluster, "audit", str(run_dir), check=False))
    print(f"the cluster's logs and the run directories: {root}")


if __name__ == "__main__":
    main()

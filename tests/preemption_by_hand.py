"""A run preempted for real on a throwaway three-node Slurm cluster, under the preemption mode and grace time given:
how the table of docs/slurm.md ("A preemption by a higher-priority job") was measured. Not a test (it takes minutes
per case and measures what the test asserts only once): run it by hand, as root, with Slurm installed
(``bash launch/slurm-packages.sh``).

    python -m tests.preemption_by_hand REQUEUE 60                        # the partition's PreemptMode, GraceTime
    python -m tests.preemption_by_hand CANCEL 0 slurm.rollout.separate=true   # run overrides after them
    python -m tests.preemption_by_hand --suspend 40 REQUEUE 60           # scontrol suspend / resume instead
    python -m tests.preemption_by_hand --stop learner REQUEUE 60 local.hang_timeout_s=10   # a task hung for good
    python -m tests.preemption_by_hand --urgent-nodes cn2,cn3 REQUEUE 60 slurm.rollout.separate=true \\
        slurm.partition=urgent slurm.rollout.partition=test             # only the rollout nodes asked for

It prints how long the urgent job waited (its submission to its start, from slurmctld's log), the job's log, the
attempts and ``computerrl audit``, and leaves the cluster's logs and the run directory where it says."""

from __future__ import annotations

import argparse
import os
import re
import signal
import time
from datetime import datetime

from launch.chaos import role_pids
from launch.slurm import attempts_ended
from tests.slurm_cluster import SlurmCluster, by_hand_root
from tests.test_slurm import _cli, _learner_steps, _submit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["REQUEUE", "CANCEL"], help="the test partition's PreemptMode")
    ap.add_argument("grace_s", type=int, help="the test partition's GraceTime")
    ap.add_argument("overrides", nargs="*", help="run config overrides (dotted key=value)")
    ap.add_argument("--suspend", type=float, default=0.0, help="suspend the job this many seconds, not preempt it")
    ap.add_argument("--stop", default="", help="stop this role's task for good (SIGSTOP), not preempt the job: its "
                    "supervisor must find it hung (local.hang_timeout_s) and restart it")
    ap.add_argument("--urgent-nodes", default="cn1,cn2,cn3", help="the nodes the urgent job asks for")
    ap.add_argument("--steps", type=int, default=6, help="learner steps of the run (preempted after its second)")
    args = ap.parse_args()
    root = by_hand_root("computerrl-slurm-")
    cluster = SlurmCluster(root, nodes=3, settings=("PreemptType=preempt/partition_prio", f"PreemptMode={args.mode}"),
                           partitions=(
        "PartitionName=test Nodes={nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES PriorityTier=1 "
        f"PreemptMode={args.mode} GraceTime={args.grace_s}",
        "PartitionName=urgent Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF"))
    run_dir = root / "run"
    cluster.start()
    job = ""
    try:
        job = _submit(cluster, run_dir, f"learner.total_steps={args.steps}", "learner.checkpoint_every=10",
                      *args.overrides)
        deadline = time.monotonic() + 900
        while len(_learner_steps(run_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(1)
        print(f"job {job}: step {_learner_steps(run_dir)[-1]['step']} trained", flush=True)
        if args.stop:
            pids = role_pids(run_dir, args.stop)  # the cluster's nodes are this machine: the task is a process here
            os.kill(pids[0], signal.SIGSTOP)
            print(f"{args.stop} task (pid {pids[0]}) stopped for good", flush=True)
        elif args.suspend:
            cluster.run("scontrol", "suspend", job)
            time.sleep(args.suspend)
            cluster.run("scontrol", "resume", job)
        else:
            nodes = args.urgent_nodes.split(",")
            urgent = cluster.run("sbatch", "--parsable", "--partition=urgent", f"--nodes={len(nodes)}",
                                 f"--nodelist={args.urgent_nodes}", "--exclusive", f"--output={root}/urgent.out",
                                 "--wrap", "sleep 5")
        while cluster.job_state(job) and time.monotonic() < deadline:
            time.sleep(1)
        ctld = (root / "log" / "slurmctld.log").read_text()
        if not (args.suspend or args.stop):
            stamps = [re.search(rf"\[([^\]]+)\] {what} JobId={urgent}\b", ctld)
                      for what in ("_slurm_rpc_submit_batch_job:", "sched: Allocate")]
            if all(stamps):
                submitted, started = (datetime.fromisoformat(m.group(1)) for m in stamps)
                print(f"the urgent job waited {(started - submitted).total_seconds():.1f} s")
    finally:
        if job:
            cluster.run("scancel", job, check=False)
        cluster.stop()
    print((run_dir / "logs" / f"slurm-{job}.out").read_text()[-4000:])
    for a in attempts_ended(run_dir):
        print(f"attempt {a['attempt']}: {a['ended']} (exit {a['exit_code']}), {a['after']}")
    print(_cli(cluster, "audit", str(run_dir), check=False))
    print("learner steps:", [r["step"] for r in _learner_steps(run_dir)])
    print(f"the cluster's logs and the run directory: {root}")


if __name__ == "__main__":
    main()

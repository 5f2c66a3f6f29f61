"""A throwaway Slurm cluster for tests: munged, slurmctld and one slurmd per node started as root from a private
slurm.conf on free ports (the machine's own Slurm, if any, is not touched), stopped afterwards.

Its nodes are all this machine: node ``cnI`` is a slurmd started with ``-N cnI`` on its own port, at the loopback
address ``127.0.0.I``. Roles placed on different nodes so bind different addresses, as on a real cluster, and
``srun --nodelist`` really goes through each node's slurmd."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from common.net import free_port

BINARIES = ("sbatch", "scontrol", "squeue", "scancel", "slurmctld", "slurmd", "munged")

# Preemption by partition priority, as clusters with a scavenger or low-priority queue set it: a job of the
# "urgent" partition takes the nodes of the "test" partition's jobs. Slurm then signals every step of the job it
# preempts (TERM), waits out its grace time, and requeues it.
PREEMPTION_GRACE_S = 120
PREEMPTION = ("PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE")
PARTITIONS = (
    "PartitionName=test Nodes={nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES PriorityTier=1 "
    f"PreemptMode=REQUEUE GraceTime={PREEMPTION_GRACE_S}",
    "PartitionName=urgent Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF")


def missing() -> str:
    """Why no cluster can start here ("" = it can)."""
    if os.geteuid() != 0:
        return "a test Slurm cluster needs root (slurmd runs jobs as their users)"
    absent = [b for b in BINARIES if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    return f"Slurm not installed ({', '.join(absent)}): bash launch/slurm-packages.sh" if absent else ""


def by_hand_root(prefix: str) -> Path:
    """A by-hand measurement's folder for its cluster and run directories (left behind for reading), or exit with
    why no cluster can start here."""
    import tempfile

    if missing():
        raise SystemExit(missing())
    root = Path(tempfile.mkdtemp(prefix=prefix))
    root.chmod(0o755)  # the jobs' users reach their run directories through it
    return root


class SlurmCluster:
    def __init__(self, root: Path, nodes: int = 1, settings: tuple[str, ...] = PREEMPTION,
                 partitions: tuple[str, ...] = PARTITIONS):
        """``settings``: slurm.conf lines besides the cluster's own; ``partitions``: its PartitionName= lines, where
        "{nodes}" stands for the node list (other values try other preemption modes and grace times)."""
        self.root = root
        self.settings, self.partitions = settings, partitions
        self.host = socket.gethostname().split(".")[0]
        self.nodes = [f"cn{i + 1}" for i in range(nodes)]
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60.0) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        r = self.root
        self.conf.write_text("\n".join([
            # Loopback addresses: the node's name need not resolve (a CI container's often does not).
            "ClusterName=computerrl-test", f"SlurmctldHost={self.host}(127.0.0.1)", "AuthType=auth/munge",
            "CredType=cred/munge", "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={free_port()}",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2", "MpiDefault=none",
            "JobRequeue=1", "KillWait=30", "SchedulerParameters=sched_interval=1",
            # Slurm holds a requeued job for the step credential's lifetime plus a second (22.05's
            # batch_requeue_fini; newer releases take SchedulerParameters=requeue_delay first): 120 s by default,
            # which was most of the preemption test. 10 s still leaves a step launch its credential's time.
            "AuthInfo=cred_expire=10",
            *(f"NodeName={n} NodeHostname={n} NodeAddr=127.0.0.{i + 1} Port={free_port()} CPUs={os.cpu_count()} "
              "State=UNKNOWN" for i, n in enumerate(self.nodes)),
            *self.settings,
            *(p.format(nodes=",".join(self.nodes)) for p in self.partitions),
            ""]))
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"], check=True)
        subprocess.run([shutil.which("slurmctld") or "/usr/sbin/slurmctld", "-f", str(self.conf)], env=self.env,
                       check=True)
        for node in self.nodes:
            subprocess.run([shutil.which("slurmd") or "/usr/sbin/slurmd", "-f", str(self.conf), "-N", node],
                           env=self.env, check=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())  # a node per partition
            if states == {n: "idle" for n in self.nodes}:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the test Slurm nodes never became idle:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return "\n".join(f.read_text(errors="replace")[-2000:] for f in sorted((self.root / "log").glob("*.log")))

    def run(self, *argv: str, check: bool = True) -> str:
        out = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, check=False)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")
        return out.stdout.strip()

    def job_state(self, job: str) -> str:
        """PENDING, RUNNING, ... or "" once the job left the queue."""
        return self.run("squeue", "-h", "-j", job, "-o", "%T", check=False)

    def stop(self) -> None:
        for pid_file in [*sorted(self.root.glob("slurmd-*.pid")), self.root / "slurmctld.pid"]:
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text().strip()), 15)
                except (ProcessLookupError, ValueError):
                    pass

"""A throwaway one-node Slurm cluster for tests: munged, slurmctld and slurmd started as root from a private
slurm.conf on free ports (the machine's own Slurm, if any, is not touched), stopped afterwards."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from common.net import free_port

BINARIES = ("sbatch", "scontrol", "squeue", "scancel", "slurmctld", "slurmd", "munged")


def missing() -> str:
    """Why no cluster can start here ("" = it can)."""
    if os.geteuid() != 0:
        return "a test Slurm cluster needs root (slurmd runs jobs as their users)"
    absent = [b for b in BINARIES if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    return f"Slurm not installed ({', '.join(absent)}): bash launch/slurm-packages.sh" if absent else ""


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[str] = []

    def start(self, timeout_s: float = 60.0) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        r = self.root
        self.conf.write_text("\n".join([
            # Loopback addresses: the node's name need not resolve (a CI container's often does not).
            "ClusterName=computerrl-test", f"SlurmctldHost={self.host}(127.0.0.1)", "AuthType=auth/munge",
            "CredType=cred/munge", "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2", "MpiDefault=none",
            "JobRequeue=1", "KillWait=30", "SchedulerParameters=sched_interval=1",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
            f"PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES", ""]))
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"], check=True)
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([shutil.which(daemon) or f"/usr/sbin/{daemon}", "-f", str(self.conf)], env=self.env,
                           check=True)
            self.procs.append(daemon)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
            if out.stdout.strip() == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the test Slurm node never became idle:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return "\n".join((self.root / "log" / f).read_text(errors="replace")[-2000:]
                         for f in ("slurmctld.log", "slurmd.log") if (self.root / "log" / f).exists())

    def run(self, *argv: str, check: bool = True) -> str:
        out = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, check=False)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")
        return out.stdout.strip()

    def job_state(self, job: str) -> str:
        """PENDING, RUNNING, ... or "" once the job left the queue."""
        return self.run("squeue", "-h", "-j", job, "-o", "%T", check=False)

    def stop(self) -> None:
        for daemon in ("slurmd", "slurmctld"):
            pid_file = self.root / f"{daemon}.pid"
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text().strip()), 15)
                except (ProcessLookupError, ValueError):
                    pass

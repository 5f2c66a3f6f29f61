"""Slurm: the sbatch script a run renders, its preemption handling (a signal checkpoints and requeues), and — on a
real one-node Slurm cluster of our own — a run preempted mid-way that resumes in its next attempt and finishes
with every acked group trained once or dropped with a reason."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.exitcodes import EXIT_RESUMABLE
from common.net import free_port
from launch.slurm import SlurmConfig, render_script
from tests.conftest import REPO


def test_the_script_carries_the_slurm_section_and_slurms_preemption_conventions(tmp_path):
    cfg = SlurmConfig(partition="gpu", account="proj7", qos="high", time="02:00:00", gres="gpu:1", mem="64G",
                      cpus_per_task=16, signal_grace_s=240, sbatch_lines=["--constraint=a100"],
                      modules=["cuda/12.4"], setup=["source /opt/venv/bin/activate"], env={"NCCL_DEBUG": "WARN"},
                      python="/opt/venv/bin/python")
    script = render_script(cfg, tmp_path / "run", tmp_path / "run" / "config.yaml")
    for line in ("#SBATCH --partition=gpu", "#SBATCH --account=proj7", "#SBATCH --qos=high", "#SBATCH --time=02:00:00",
                 "#SBATCH --gres=gpu:1", "#SBATCH --mem=64G", "#SBATCH --cpus-per-task=16", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR2@240", "#SBATCH --open-mode=append", "#SBATCH --constraint=a100",
                 "module load cuda/12.4", "source /opt/venv/bin/activate", "export NCCL_DEBUG=WARN"):
        assert line in script.splitlines(), line
    assert "/opt/venv/bin/python -m launch.cli run" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "--no-requeue" in render_script(SlurmConfig(requeue=False), tmp_path, tmp_path / "c.yaml")
    for bad, match in [(SlurmConfig(nodes=2), "one node"), (SlurmConfig(sbatch_lines=["rm -rf /"]), "sbatch option"),
                       (SlurmConfig(signal_grace_s=70000), "0..65535")]:
        with pytest.raises(ValueError, match=match):
            bad.validate()


def _fake_tools(bin_dir: Path, log: Path) -> Path:
    """A stand-in for `computerrl run` (exits 75 on SIGTERM, as the supervisor does) and a recording scontrol."""
    bin_dir.mkdir()
    run = bin_dir / "fake-python"
    run.write_text(f"#!/bin/bash\necho \"run $*\" >> {log}\nsleep 30 & pid=$!\n"
                   f"trap 'kill $pid; echo stopped >> {log}; exit {EXIT_RESUMABLE}' TERM\nwait $pid\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\necho \"scontrol $*\" >> {log}\n")
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    return run


@pytest.mark.parametrize("requeue", [True, False])
def test_a_preemption_notice_stops_the_run_resumably_and_requeues_the_job(tmp_path, requeue):
    log = tmp_path / "calls.log"
    python = _fake_tools(tmp_path / "bin", log)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    script = tmp_path / "job.sbatch"
    script.write_text(render_script(SlurmConfig(python=str(python), requeue=requeue), run_dir, run_dir / "config.yaml"))
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    job = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 10
    while not (log.exists() and log.read_text().startswith("run ")):
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.05)
    job.send_signal(12)  # SIGUSR2: Slurm's notice before the time limit (--signal=B:USR2@grace)
    out, _ = job.communicate(timeout=20)
    calls = log.read_text().splitlines()
    assert job.returncode == EXIT_RESUMABLE, out
    assert calls[0].startswith(f"run -m launch.cli run {run_dir / 'config.yaml'} --run-dir {run_dir}")
    assert "--resume" not in calls[0], "no checkpoint yet: a fresh start"
    assert calls[1] == "stopped", "the run got the notice (it checkpoints and stops)"
    assert (calls[2:] == ["scontrol requeue 4242"]) == requeue, calls
    # The next attempt, with a checkpoint on disk, resumes.
    (run_dir / "checkpoints" / "latest").write_text("step-00000002")
    job = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True)
    while sum(line.startswith("run ") for line in log.read_text().splitlines()) < 2:
        time.sleep(0.05)
    job.terminate()  # a preemption's SIGTERM is a notice too
    job.communicate(timeout=20)
    assert log.read_text().splitlines()[-1 if not requeue else -2] == "stopped"
    assert "--resume" in [c for c in log.read_text().splitlines() if c.startswith("run ")][1]


@pytest.mark.slow
def test_a_run_preempted_on_a_real_slurm_resumes_in_its_next_attempt_and_loses_nothing(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    env_port = free_port()
    overrides = [f"net.broker_front_port={free_port()}", f"net.broker_back_port={free_port()}",
                 f"net.broker_control_port={free_port()}", f"env_server.port={env_port}",
                 f"actor.env_servers=['127.0.0.1:{env_port}']", f"weights.port={free_port()}",
                 "weights.join_window_s=0.5", "local.eval_episodes=0", "learner.total_steps=6",
                 "learner.checkpoint_every=1", "slurm.signal_grace_s=60", "slurm.time=00:30:00"]
    env = {**slurm_cluster.env, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "launch.cli", "slurm", "submit", "configs/local.yaml", *overrides,
                          "--run-dir", str(run_dir)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.split("submitted job ")[1].split(";")[0]
    metrics = run_dir / "metrics" / "learner.jsonl"
    deadline = time.monotonic() + 600
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline and slurm_cluster.job_state(job), "the job never trained"
            time.sleep(1)
        slurm_cluster.run("scancel", "--batch", "--signal=USR2", job)  # what a preemption notice does
        while slurm_cluster.job_state(job):  # requeued (Slurm holds a requeued job ~2 min), then run again
            assert time.monotonic() < deadline, f"the job did not finish:\n{slurm_cluster.log_tail()}"
            time.sleep(2)
    finally:
        slurm_cluster.run("scancel", job, check=False)
    job_log = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert "attempt 1" in job_log and f"requeueing job {job}" in job_log and "attempt 2" in job_log, job_log[-3000:]
    assert "outcome: finished" in job_log, job_log[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000006"
    audit = subprocess.run([sys.executable, "-m", "launch.cli", "audit", str(run_dir), "--json"], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=120)
    result = json.loads(audit.stdout)
    assert audit.returncode == 0 and result["lost"] == 0 and result["trained_twice"] == 0, result
    assert result["learner_starts"] == 2, "the second attempt resumed the learner from its checkpoint"

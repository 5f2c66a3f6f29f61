"""One run and one process per role instance in a run directory (``common/claims.py``): a second one is refused,
naming the first, before it writes anything; a holder's death, however it dies, gives the claim back."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from common import claims
from conftest import REPO, whole_checkpoint

REPO_CONFIG = REPO / "configs" / "local.yaml"


def _holder(run_dir, name: str) -> subprocess.Popen:
    """Another process holding ``name`` in ``run_dir`` until its stdin closes or it is killed."""
    code = ("import sys; from common import claims; claims.claim(sys.argv[1], sys.argv[2]); print('held', flush=True); "
            "sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir), name], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_claim_another_process_holds_is_refused_naming_it_and_freed_by_its_kill_9(tmp_path):
    holder = _holder(tmp_path, "broker-0")
    try:
        with pytest.raises(claims.ClaimHeld) as refused:
            claims.claim(tmp_path, "broker-0")
        assert f"pid {holder.pid} on host " in str(refused.value) and ": broker-0 is held" in str(refused.value)
        assert claims.claim(tmp_path, "broker-1").enforced  # another instance of the role is another claim
        # A claim waiting for its holder gets it once the holder dies, however it dies: no file to clean up.
        threading.Timer(0.5, os.kill, (holder.pid, signal.SIGKILL)).start()
        started = time.monotonic()
        got = claims.claim(tmp_path, "broker-0", wait_s=20)
        assert got.enforced and 0.3 < time.monotonic() - started < 10
        assert f'"pid": {os.getpid()}' in got.path.read_text()  # the holder's record is now this process's
        assert claims.claim(tmp_path, "broker-0") == got  # held already by this process: the same claim
    finally:
        holder.kill()
        holder.wait()


def test_a_wait_that_ends_with_the_holder_alive_says_how_long_it_waited(tmp_path):
    holder = _holder(tmp_path, "run")
    try:
        with pytest.raises(claims.ClaimHeld, match=r"\(waited \d+ s\)"):
            claims.claim(tmp_path, "run", wait_s=0.6)
    finally:
        holder.kill()
        holder.wait()


def test_a_file_system_that_cannot_lock_runs_unclaimed_and_says_why(tmp_path, monkeypatch):
    """Lustre without ``-o flock``: flock fails with ENOSYS. Refusing to start there would stop every run on it."""
    def no_locks(fd, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(claims.fcntl, "flock", no_locks)
    got = claims.claim(tmp_path, "learner-0")
    assert not got.enforced and "does not lock" in got.why and "learner-0.lock" in got.why


def test_a_role_whose_instance_is_running_exits_before_it_writes_its_record(tmp_path):
    """A second `computerrl broker` of one run directory (the same --rank) overwrote the first one's config record and
    appended to its logs and spill log; it exits 1 (a supervisor restarts a role that failed: a restart that came
    before its last incarnation ended gets the claim on a later try). In a Slurm job it waits
    ``slurm.claim_wait_s`` (0 here) rather than ``ROLE_CLAIM_WAIT_S``."""
    holder = _holder(tmp_path, "broker-0")
    try:
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "launch.cli", "broker", "--config", str(REPO_CONFIG), "--run-dir",
                              str(tmp_path), "slurm.claim_wait_s=0"], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "SLURM_JOB_ID": "7"}, timeout=60)
        assert out.returncode == 1, out.stderr
        assert f"{tmp_path}: broker-0 is held by another process: pid {holder.pid}" in out.stderr
        assert "or --rank" in out.stderr and time.monotonic() - started < 9
        assert not (tmp_path / "config.broker-0.yaml").exists() and not (tmp_path / "logs" / "broker-0.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_second_run_of_a_running_run_directory_is_refused_before_it_writes_or_checks_ports(tmp_path):
    """Tried by hand: `computerrl run --resume` of a running run on ports of its own resumed a second learner beside
    the first, and two learners and two brokers wrote into one directory (``common/claims.py``)."""
    from launch.cli.base import main, prepare_run
    from launch.config import load_run_config

    run = tmp_path / "run"
    prepare_run(load_run_config(REPO_CONFIG, ["learner.total_steps=4"]), str(run))
    whole_checkpoint(run / "checkpoints", 4)
    claims.release_all()  # the run's supervisor is another process
    requested = (run / "config.requested.yaml").read_text()
    holder = _holder(run, claims.RUN)
    try:
        out = CliRunner().invoke(main, ["run", str(REPO_CONFIG), "--run-dir", str(run), "--resume",
                                        "local.port_base=31000", "learner.total_steps=8"])
        assert out.exit_code == 1, out.output
        assert f"{run}: run is held by another process: pid {holder.pid}" in out.output
        assert (run / "config.requested.yaml").read_text() == requested
        # A Slurm submission into it is refused the same way (its script and config would replace the run's).
        out = CliRunner().invoke(main, ["slurm", "submit", str(REPO_CONFIG), "--run-dir", str(run)])
        assert out.exit_code == 1 and f"pid {holder.pid}" in out.output, out.output
        assert not (run / "slurm").exists()
    finally:
        holder.kill()
        holder.wait()

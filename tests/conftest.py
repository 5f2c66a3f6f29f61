"""Shared fixtures: brokers on free loopback ports (in a thread, or as a real process), trajectory builders, real
desktops (where their Debian packages are installed)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from broker.config import BrokerConfig
from common import log as L
from common import protocol as P
from common.net import NetConfig, free_port
from common.net.config import PORT_RANGE_ENV
from common.rundir import RunDir
from env_server.desktop.sandbox import missing_packages

REPO = Path(__file__).resolve().parents[1]

WORKER_PORTS = 1000
"""ports per parallel test worker, from 20000 up: below the kernel's ephemeral range (32768 on), so no outgoing
connection takes a port a test picked, and each worker's own, so two workers never pick the same one"""


ONE_WORKER_FILES = ("tests/test_slurm.py",)
"""test files whose tests all run on one parallel worker: the Slurm tests share the session's test cluster, and a
second worker would start a second cluster on the same munge and node addresses"""


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: without it installed, nothing to schedule
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's load balancing, except that each of ``ONE_WORKER_FILES`` is one unit of work. (xdist's own
    ``--dist loadgroup`` renames test ids to group them, which pytest 9.2 no longer lets a plugin do: every test was
    its own unit again.)"""
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerFiles(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in ONE_WORKER_FILES else nodeid

    return OneWorkerFiles(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """Longest first, for the parallel workers: the slow tests of ``ONE_WORKER_FILES`` (one worker runs them one
    after the other), then the other slow ones, then the quick ones filling the gaps, so the suite does not end
    waiting on a long test that started last. (Pytest's own order is kept within each rank.)"""
    def rank(item) -> int:
        slow = item.get_closest_marker("slow") is not None
        return 0 if slow and item.nodeid.split("::", 1)[0] in ONE_WORKER_FILES else 1 if slow else 2
    items.sort(key=rank)  # stable


def pytest_configure(config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ... under pytest-xdist
    if worker.startswith("gw"):
        lo = 20000 + WORKER_PORTS * int(worker[2:])
        if lo + WORKER_PORTS > 32768:
            raise pytest.UsageError(f"too many test workers for their port ranges ({worker}): at most 12")
        os.environ[PORT_RANGE_ENV] = f"{lo}-{lo + WORKER_PORTS - 1}"  # children (runs, roles) inherit it


def make_net(**kw) -> NetConfig:
    # Liveness 2 s: with the suite's parallel workers a busy machine holds a loop up for a second at times, and
    # 0.6 s turned that into deaths the tests never meant. Tests of death detection wait 2 s for one.
    base = dict(broker_front_port=free_port(), broker_back_port=free_port(), broker_control_port=free_port(),
                heartbeat_s=0.2, liveness=10, reconnect_min_s=0.05, reconnect_max_s=0.5, request_timeout_s=2.0)
    base.update(kw)
    return NetConfig(**base)


def make_traj(version: int = 0, reward: float = 1.0, turns: int = 2, prompt_len: int = 12, out_len: int = 5,
              seed: int = 0, traj_id: str | None = None) -> P.Trajectory:
    rng = np.random.default_rng(seed)
    tv = [P.TurnView(rng.integers(0, 256, prompt_len, dtype=np.int32), rng.integers(0, 256, out_len, dtype=np.int32),
                     -rng.random(out_len, dtype=np.float32), np.full(out_len, version, np.int32),
                     np.ones(out_len, np.uint8), reward, False, f"obs {i}", f"click({i})") for i in range(turns)]
    return P.Trajectory.from_turns(traj_id or uuid.uuid4().hex[:8], reward, reward > 0, tv)


def make_group(ticket: P.Ticket | None = None, version: int | None = None, rewards=(1.0, 0.0),
               group_id: str | None = None, complete: bool = True, actor_id: str = "a") -> P.TrajectoryGroup:
    v = version if version is not None else (ticket.policy_version if ticket else 0)
    trajs = [make_traj(v, r, seed=i) for i, r in enumerate(rewards)]
    return P.TrajectoryGroup(group_id=group_id or uuid.uuid4().hex, ticket_id=ticket.ticket_id if ticket else "none",
                             task_id=ticket.task_id if ticket else "sim:train/0", actor_id=actor_id,
                             trajectories=trajs, behavior_version_min=v, behavior_version_max=v,
                             created_at=time.monotonic(), complete=complete)


@dataclass
class ThreadBroker:
    broker: object
    thread: threading.Thread
    net: NetConfig
    run_dir: RunDir

    def stop(self) -> None:
        self.broker.request_stop()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture(autouse=True)
def _claims_given_back():
    """A command a test runs in-process (``CliRunner``, ``prepare_run``) claims its run directory for the process's
    life, as a real one does (``common/claims.py``); a test worker lives on, so each test gives its claims back."""
    from common import claims

    yield
    claims.release_all()


@pytest.fixture
def quiet_log():
    return L.setup("test", "test", 0, None, "warning", quiet=True)


@pytest.fixture
def start_broker(tmp_path, quiet_log):
    """Start an in-process broker thread: ``start_broker(cfg=..., net=...)``."""
    from broker.server import Broker

    started: list[ThreadBroker] = []

    def _start(cfg: BrokerConfig | None = None, net: NetConfig | None = None, run_dir: Path | None = None,
               run_id: str = ""):
        cfg = cfg or BrokerConfig(groups_per_batch=2, group_size=2, eta=1, metrics_interval_s=0.5)
        net = net or make_net()
        rd = RunDir.create(run_dir or tmp_path / f"run-{len(started)}", run_id)
        b = Broker(cfg, net, rd, quiet_log)
        t = threading.Thread(target=b.run, daemon=True)
        t.start()
        tb = ThreadBroker(b, t, net, rd)
        started.append(tb)
        return tb

    yield _start
    for tb in started:
        if tb.thread.is_alive():
            tb.stop()


def broker_process(run_dir: Path, net: NetConfig, *overrides: str) -> subprocess.Popen:
    """A real ``computerrl broker`` process on the given ports."""
    args = [sys.executable, "-m", "launch.cli", "broker", "--run-dir", str(run_dir),
            f"net.broker_front_port={net.broker_front_port}", f"net.broker_back_port={net.broker_back_port}",
            f"net.broker_control_port={net.broker_control_port}", f"net.heartbeat_s={net.heartbeat_s}",
            f"net.liveness={net.liveness}",
            f"net.curve={net.curve}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def pump(clients, seconds: float, until=None) -> None:
    """Poll clients for up to ``seconds`` or until ``until()`` is true."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for c in clients:
            c.poll(0.02)
        if until is not None and until():
            return
    if until is not None:
        raise AssertionError(f"condition not met within {seconds}s")


def vanish(client) -> None:
    """A client that dies without a word (``kill -9``, a lost node): its link closes without a Goodbye."""
    client.link.ready = False
    client.close()


def kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


# ----- real desktops -------------------------------------------------------------------------------------------

MISSING_DESKTOP_PACKAGES = missing_packages()
needs_desktop = pytest.mark.skipif(bool(MISSING_DESKTOP_PACKAGES),
                                   reason=f"Debian packages missing: {' '.join(MISSING_DESKTOP_PACKAGES)} "
                                          "(as root: bash launch/desktop-packages.sh)")


@pytest.fixture
def work_dir():
    """Desktops' host folders: under /tmp, not pytest's tmp_path (0700), so a sandbox that drops root to
    nobody can reach them."""
    path = Path(tempfile.mkdtemp(prefix="computerrl-test-desktops-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def desktop(work_dir):
    """A factory of xvfb desktops, each closed (and its folder checked gone) after the test."""
    from env_server.desktop.backend import DesktopConfig, XvfbBackend
    made = []

    def make(**kw):
        b = XvfbBackend(DesktopConfig(work_dir=str(work_dir), **kw))
        made.append(b)
        return b
    yield make
    for b in made:
        b.close()
    assert not list(work_dir.glob("desktop-*")), "a closed desktop left its folder behind"


# ----- a test Slurm cluster ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A three-node Slurm cluster of our own on this machine (root and the slurm-wlm packages needed, else the test
    skips), whose "urgent" partition preempts its default one."""
    from tests.slurm_cluster import SlurmCluster, missing

    why = missing()
    if why:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="computerrl-slurm-"))
    root.chmod(0o755)
    cluster = SlurmCluster(root, nodes=3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def stage_weights_before_window(engine, window: int, named, version: int) -> None:
    """Make new weights arrive mid-generation: ``engine`` (an HFEngine) stages ``named`` just before its
    ``window``-th decode window from now, as a weight round landing on the actor's other thread would."""
    seen = {"windows": 0}

    def hook() -> None:
        seen["windows"] += 1
        if seen["windows"] == window:
            engine.load_weights(named, version)

    engine.step_hook = hook


def children_of_run(run_dir: Path) -> list[int]:
    """Processes whose command line names ``run_dir``: a run's roles (and anything else it started)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(run_dir) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def whole_checkpoint(checkpoints: Path, version: int) -> Path:
    """The smallest checkpoint directory a resume's checks take for whole (``learner/checkpoint.py: damage``): a
    state.json with its version, one weights file, a trainer.pt; ``latest`` pointed at it. For tests of what the
    commands around a resume decide, which never load it."""
    import torch
    from safetensors.torch import save_file

    path = checkpoints / f"step-{version:08d}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps({"version": version}))
    save_file({"w": torch.zeros(1)}, str(path / "model.safetensors"))
    torch.save({}, path / "trainer.pt")
    (checkpoints / "latest").write_text(path.name)
    return path

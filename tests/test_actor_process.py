"""Real processes: an actor keeps publishing across a ``kill -9`` and restart of the broker and of the
env_server, and stops cleanly on Control."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from broker.client import LearnerBrokerClient
from common.net import free_port
from tests.conftest import REPO, broker_process, kill9, make_net

pytestmark = pytest.mark.slow

BROKER = ("broker.groups_per_batch=1", "broker.group_size=2", "broker.eta=8", "broker.persist=true")


def _role(args: list[str], run_dir, net) -> subprocess.Popen:
    ports = [f"net.broker_front_port={net.broker_front_port}", f"net.broker_back_port={net.broker_back_port}",
             f"net.broker_control_port={net.broker_control_port}", f"net.heartbeat_s={net.heartbeat_s}",
             f"net.liveness={net.liveness}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "launch.cli", *args, "--run-dir", str(run_dir), *ports],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_actor_survives_broker_kill9_and_stops_on_control(tmp_path, quiet_log):
    net = make_net(request_timeout_s=2.0)
    run_dir = tmp_path / "run"
    env_port = free_port()
    broker = broker_process(run_dir, net, *BROKER)
    env = _role(["env-server", f"env_server.port={env_port}"], run_dir, net)
    actor = _role(["actor", f"actor.env_servers=['127.0.0.1:{env_port}']", "actor.max_steps=2",
                   "actor.sampling.max_new_tokens=12", "actor.prompt.max_prompt_tokens=768", "model.hidden_size=32",
                   "model.intermediate_size=64", "actor.metrics_interval_s=1"], run_dir, net)
    learner = LearnerBrokerClient(net, None, quiet_log)
    procs = [broker, env, actor]
    try:
        learner.connect(60)
        version = 0
        learner.set_control(version)
        seen: list[str] = []

        def take(n: int) -> None:
            nonlocal version
            for _ in range(n):
                learner.grant(1)
                batch = learner.next_batch(90)
                assert batch is not None, "no batch: " + actor.stderr.read1().decode()[-2000:] \
                    if actor.poll() is not None else "no batch within 90 s"
                seen.extend(g.group_id for g in batch.groups)
                for g in batch.groups:
                    assert g.complete and len(g.trajectories) == 2
                version += 1
                # As a learner does: trained, then checkpointed. One that never settles holds its batches as untrained
                # forever; declared dead on a loaded machine (it polls only here), its Holding note then kept them
                # counted ahead of its version, and every group after went stale.
                learner.settle([g.group_id for g in batch.groups])
                learner.checkpoint_durable(version)
                learner.set_control(version)

        take(2)
        kill9(broker)
        broker = procs[0] = broker_process(run_dir, net, *BROKER)
        take(2)  # the actor reconnected and kept publishing (its unacked groups were re-sent)
        kill9(env)
        env = procs[1] = _role(["env-server", f"env_server.port={env_port}"], run_dir, net)
        take(2)  # sessions died with the env_server: those episodes were played again on new sessions
        assert len(seen) == len(set(seen)) == 6
        assert actor.poll() is None
        learner.set_control(version, stop=True)
        learner.poll(1.0)
        assert actor.wait(60) == 0, actor.stderr.read().decode()[-2000:]
        log = (run_dir / "logs" / "actor-0.jsonl").read_text()
        assert '"actor_stopping"' in log
        assert ('"episode_aborted"' in log) or ('"server_restarted"' in log), "the env_server restart was noticed"
    finally:
        learner.close()
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(20)

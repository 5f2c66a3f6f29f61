"""A whole run in one process: broker, env_servers, actors and the learner as threads, linked over ZeroMQ
``inproc://`` (``net.transport=inproc``) instead of TCP.

It is the suite's in-process tier: the async pipeline (tickets, admission, staleness, groups acked once durable,
batches, commits, weight rounds, drops by reason) trains a few steps in seconds with nothing to spawn, so a broken
pipeline fails a quick test rather than only the slow suite. It is also a way to step through every role in one
debugger. What only separate processes show (kill -9, CURVE over TCP, Slurm, real desktops, several learner ranks)
stays with ``computerrl run`` and its process-level tests.

The roles are the same classes the per-role commands run; only their links change. Weight rounds still go over
the learner's TCPStore and a gloo group on loopback (``weights.port``), as they do between processes. Logging is
per process, so every role writes to one ``logs/inprocess-0.jsonl``, each line carrying its role.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from common import log as L
from common.rundir import RunDir


@dataclass
class RoleThread:
    """One role running on a thread of this process; ``error`` is what ended it, if it raised."""

    name: str
    thread: threading.Thread
    stop: Callable[[], None] = lambda: None
    result: Any = None
    error: BaseException | None = None


@dataclass
class InProcessRun:
    """Every role of ``cfg`` as threads; ``run`` returns once the learner finished and the others stopped."""

    cfg: Any
    run_dir: RunDir
    timeout_s: float = 300.0
    """the whole run's deadline: past it every role is asked to stop and ``run`` raises"""
    roles: list[RoleThread] = field(default_factory=list)

    def _start(self, name: str, target: Callable[[], Any], stop: Callable[[], None] = lambda: None) -> RoleThread:
        def body() -> None:
            try:
                role.result = target()
            except BaseException as exc:  # reported by run(), which stops the others
                role.error = exc

        role = RoleThread(name, threading.Thread(target=body, name=name, daemon=True), stop)
        role.thread.start()
        self.roles.append(role)
        return role

    def run(self) -> bool:
        """Run to the learner's end; returns whether it finished its steps. A role that raised stops the run
        and is re-raised with its name; so is the deadline."""
        from actor.agent import Actor
        from actor.demos import load_run_demos, record_run_demos
        from actor.engine_factory import actor_engine, cross_policy_engine
        from actor.workflow_explorer import workflow_explorer
        from broker.server import Broker
        from env_server.server import EnvServer
        from launch.local import fit_to_local_run
        from learner.process import main as learner_main

        cfg = self.cfg
        cfg.net.transport = "inproc"
        fit_to_local_run(cfg)
        log = L.setup("inprocess", cfg.run.run_id, 0, self.run_dir.logs, cfg.run.log_level, quiet=True)
        deadline = time.monotonic() + self.timeout_s
        engines: list = []
        others: list = []  # cross-policy engines
        try:
            broker = Broker(cfg.broker, cfg.net, self.run_dir, log.bind(role="broker"), seed=cfg.run.seed)
            self._start("broker", broker.run, broker.request_stop)
            server = EnvServer(cfg.env_server, cfg.net, self.run_dir, log.bind(role="env_server"), seed=cfg.run.seed)
            self._start("env_server", server.run, server.request_stop)
            record_run_demos(cfg, self.run_dir, log)
            anchor_demos = load_run_demos(cfg, self.run_dir, "anchor")
            workflow_demos = load_run_demos(cfg, self.run_dir, "workflows")
            # Models are loaded one at a time, here, before the learner's thread loads its own: transformers'
            # loading switches process-wide state (the default device) and two loads at once break each other.
            engines += [actor_engine(cfg, rank) for rank in range(cfg.local.actors)]
            crosses = [cross_policy_engine(cfg, rank) for rank in range(cfg.local.actors)]
            others += [e for e in crosses if e is not None]
            learner = self._start("learner", lambda: learner_main(cfg, self.run_dir, log.bind(role="learner"),
                                                                  False, anchor_demos))
            actors = []
            for rank, engine in enumerate(engines):
                a = Actor(cfg.actor, engine, cfg.net, cfg.weights, self.run_dir, log.bind(role="actor", rank=rank),
                          rank=rank, cross_engine=crosses[rank], explorer=workflow_explorer(cfg, workflow_demos, rank))
                actors.append(self._start(f"actor-{rank}", lambda a=a: _connect_and_run(a)))
            self._wait([learner], deadline)
            self._wait(actors, min(deadline, time.monotonic() + cfg.local.stop_timeout_s))
        finally:
            stuck = self._stop_all()
            for engine in engines + others:  # their actors have stopped (or are reported stuck)
                engine.close()
        if stuck:
            raise TimeoutError(f"in-process roles did not stop: {stuck}")
        return learner.result == 0

    def _wait(self, roles: list[RoleThread], deadline: float) -> None:
        """Wait for ``roles`` to end; any role's error, or the deadline, raises."""
        while any(r.thread.is_alive() for r in roles):
            failed = next((r for r in self.roles if r.error is not None), None)
            if failed is not None:
                raise RuntimeError(f"{failed.name} failed: {failed.error!r}") from failed.error
            if time.monotonic() > deadline:
                alive = [r.name for r in self.roles if r.thread.is_alive()]
                raise TimeoutError(f"in-process run past its deadline; still running: {alive}")
            time.sleep(0.05)
        failed = next((r for r in roles if r.error is not None), None)
        if failed is not None:
            raise RuntimeError(f"{failed.name} failed: {failed.error!r}") from failed.error

    def _stop_all(self) -> list[str]:
        """Ask every role to stop and wait for it; returns the roles still running after ``local.stop_timeout_s``."""
        for r in self.roles:
            r.stop()
        deadline = time.monotonic() + self.cfg.local.stop_timeout_s
        for r in self.roles:
            r.thread.join(max(0.0, deadline - time.monotonic()))
        return [r.name for r in self.roles if r.thread.is_alive()]


def _connect_and_run(actor: Any) -> None:
    try:
        actor.connect()
        actor.run()
    finally:
        actor.close()


"""``computerrl run``: every role of a run as its own OS process on this machine, supervised.

Start order follows readiness, not sleeps: the broker, once it answers a Hello; the env_server, once it
does; then the learner and the actors, which wait for their peers themselves. While the run goes:
- any role that exits before the run is over is restarted with exponential back-off (up to
  ``max_restarts`` each): an actor or env_server as it was, the broker from its spill log, the learner
  (every rank of it) with ``--resume`` from its latest checkpoint; the broker re-delivers whatever the
  learner had not committed, so no acked group is lost or trained twice (``computerrl audit`` checks);
- a role that keeps crashing ends the run with the reason and the tail of its stderr; the run directory
  stays resumable (learner checkpoints, broker spill log): ``computerrl run ... --resume``. A role that exits
  ``EXIT_CONFIG`` (its configuration cannot work: a checkpoint not there) ends it at once, with exit code 78;
- a role that hangs for good (a deadlock, a process stopped and never continued) never exits: its main loop's pulse
  (``common/pulse.py``) stops, and past ``hang_timeout_s`` the role is killed, its stacks kept, and restarted as above;
- SIGINT/SIGTERM/SIGUSR2/SIGHUP stop the learner first (it checkpoints), then actors, env_server and broker; whatever
  has not exited after ``stop_timeout_s`` (the learner: ``learner_stop_timeout_s``, time to finish its step and
  checkpoint) is killed, and every child dies with the supervisor (PDEATHSIG);
- with its roles as a scheduler's job steps (``scheduler_steps``: a Slurm allocation), a role that stopped on a
  signal the supervisor did not send means the scheduler is taking the job back (a preemption signals every step's
  tasks): the run stops as above, resumable, instead of restarting the role. Every role but the learner only counts
  such a TERM (``common/signals.py``), so the learner, which checkpoints and exits on it, is the one that tells.
The terminal shows the live view (`launch/live_view.py`), built from the roles' metrics files; their logs go to the run
dir.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from common.config import ConfigError
from common.exitcodes import EXIT_CONFIG, EXIT_RESUMABLE
from common.metrics.records import read_records
from common.pulse import PULSE_ENV
from common.rundir import RunDir
from common.signals import DEFER_TERM_ENV, STOP_SIGNALS
from launch.live_view import render_view
from launch.placement import Role, fabric_roles, local_roles

PR_SET_PDEATHSIG = 1
SUPERVISOR_GAP_S = 10.0
"""a pass of the supervisor's loop this long after the one before (its loop sleeps 0.2 s): the supervisor itself was
stopped (a suspended job stops every process of it) or starved, and what its roles did not beat meanwhile is not held
against them"""
PULSE_CHECKS_PER_TIMEOUT = 20
"""the pulse files are read this many times per ``hang_timeout_s`` (every 30 s at 600 s; at most every 0.5 s): a
hung role is seen within a twentieth of the timeout of it, and a run of many roles on a shared file system costs its
metadata server a stat per role that often, not five a second"""
# How a role that stopped on a stop signal exits: 75 (a role's own stop), 128 + N (a command unwound by signal N, or
# srun reporting a task it signalled), -N (a process the signal ended).
SIGNALLED_EXITS = {EXIT_RESUMABLE, *(128 + s for s in STOP_SIGNALS), *(-s for s in STOP_SIGNALS)}


@dataclass
class LocalConfig:
    """The local supervisor (``computerrl run``)."""

    actors: int = 2
    """actor processes"""
    max_restarts: int = 5
    """restarts of one role in a row (see restart_reset_s) before the run gives up"""
    restart_backoff_s: float = 1.0
    """first restart delay; doubles per restart of the same role, up to 30 s"""
    restart_reset_s: float = 600.0
    """a role that ran this long before it exited starts its count of restarts (and back-off) afresh; 0 = never"""
    ready_timeout_s: float = 120.0
    """how long the broker and env_server may take to answer their first Hello"""
    stop_timeout_s: float = 30.0
    """how long each role but the learner may take to exit after SIGTERM before it is killed"""
    learner_stop_timeout_s: float = 240.0
    """how long the learner may take after SIGTERM to finish its step and checkpoint before it is killed"""
    hang_timeout_s: float = 600.0
    """a role whose loop gave no sign of life (common/pulse.py) this long is hung: killed and restarted (0 = never)"""
    view_interval_s: float = 1.0
    """refresh period of the terminal view"""
    torch_threads: int = 1
    """torch CPU threads per actor and learner process (the machine's cores are shared by every role)"""
    eval_episodes: int = 0
    """held-out episodes per family evaluated on each new checkpoint (0 = no periodic evaluation)"""
    eval_suite: str = "sim:heldout"
    """suite of the periodic evaluation"""
    eval_start: bool = True
    """with eval_episodes > 0, also evaluate the starting policy (model.path) as step 0 of a new run"""
    eval_timeout_s: float = 1800.0
    """longest one held-out evaluation may run; past it the evaluation is killed and logged as failed"""
    learner_ranks: int = 1
    """learner processes; above 1 the model is sharded over them with FSDP2 (gloo on CPU, NCCL on GPUs)"""
    learner_dist_port: int = 25560
    """loopback port of the learner ranks' rendezvous (MASTER_PORT) when learner_ranks > 1"""
    netns: str = ""
    """file of a network fabric (launch/netns.py) whose namespaces the roles run in, one each ("" = none)"""
    port_base: int = 0
    """every port the run binds numbered from this one up, the actors pointed at its env_server (0 = each key's own)"""

    def validate(self) -> None:
        if self.actors < 1 or self.learner_ranks < 1:
            raise ValueError("local.actors and local.learner_ranks must be >= 1")
        if self.port_base and not 1024 <= self.port_base <= 65535 - len(PORT_KEYS):
            raise ValueError(f"local.port_base must be 0 or within 1024..{65535 - len(PORT_KEYS)}")
        if self.stop_timeout_s <= 0 or self.learner_stop_timeout_s <= 0 or self.eval_timeout_s <= 0:
            raise ValueError("local.stop_timeout_s, local.learner_stop_timeout_s and local.eval_timeout_s must be > 0")
        if self.hang_timeout_s < 0:
            raise ValueError("local.hang_timeout_s must be >= 0 (0 = never)")
        if self.max_restarts < 0 or self.restart_reset_s < 0:
            raise ValueError("local.max_restarts and local.restart_reset_s must be >= 0")
        if self.netns:
            from launch.netns import Fabric
            Fabric.load(self.netns)


PORT_KEYS = ("net.broker_front_port", "net.broker_back_port", "net.broker_control_port", "weights.port",
             "local.learner_dist_port", "env_server.port")
"""every port a local run binds"""


def free_port_overrides(taken: set[int] | None = None) -> list[str]:
    """Overrides giving one local run free ports of its own (the actors pointed at its env_server), so several
    runs share a machine (sweeps, benchmarks, tests). Ports in ``taken`` are avoided, and those picked are added
    to it, so runs started together never pick the same one."""
    from common.net import free_port

    taken = set() if taken is None else taken
    picked: list[int] = []
    while len(picked) < len(PORT_KEYS):
        port = free_port()
        if port not in taken:
            taken.add(port)
            picked.append(port)
    return [*(f"{k}={p}" for k, p in zip(PORT_KEYS, picked)), f"actor.env_servers=['127.0.0.1:{picked[-1]}']"]


def port_of(cfg: Any, key: str) -> int:
    """The value of one of ``PORT_KEYS`` in ``cfg``."""
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def local_ports(cfg: Any) -> dict[str, int]:
    """Each port of ``PORT_KEYS`` as the run will have it: numbered from ``local.port_base`` when that is set."""
    base = cfg.local.port_base
    return {key: base + i if base else port_of(cfg, key) for i, key in enumerate(PORT_KEYS)}


def check_ports_free(cfg: Any) -> None:
    """ConfigError naming the key when a port this run binds is already listened on here. On loopback the links
    are not encrypted (``net.curve: auto``), so the supervisor's readiness probe took a Ready from another run's
    broker on the same ports, and this run's learner and actors then joined that run: they took its tickets,
    played on its desktops and received its learner's weights, while this run's own broker and env_server failed
    to bind at every restart. Bound with ``SO_REUSEADDR`` as the servers bind, so a port a finished run left in
    TIME_WAIT is free."""
    for key, port in local_ports(cfg).items():
        if key == "local.learner_dist_port" and cfg.local.learner_ranks < 2:
            continue  # bound only by several learner ranks
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("0.0.0.0", port))
            except OSError as exc:
                why = ("something on this machine already listens there (another run? `ss -ltnp 'sport = :"
                       f"{port}'` names it)") if exc.errno == errno.EADDRINUSE else exc.strerror
                raise ConfigError(f"{key}={port}: {why}; give this run ports of its own, e.g. local.port_base=N "
                                  f"numbers them all from N") from None


def fit_to_local_run(cfg: Any) -> list[str]:
    """Settings a local run derives from its own shape (every role on this machine, their number known);
    returns a note for each value it changed."""
    notes = []
    base = cfg.local.port_base
    if base:
        for key, port in local_ports(cfg).items():
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, port)
        if all(a.split(":")[0] in ("127.0.0.1", "localhost") for a in cfg.actor.env_servers):
            cfg.actor.env_servers = [f"127.0.0.1:{cfg.env_server.port}"]
        notes.append(f"ports {base}..{base + len(PORT_KEYS) - 1} (local.port_base): {', '.join(PORT_KEYS)}")
    if cfg.learner.expected_actors == 0:
        # Every actor of this run is known: a weight round closes as soon as they all joined.
        cfg.learner.expected_actors = cfg.local.actors * cfg.actor.engine.weight_receivers
    # Every episode in flight holds a desktop: a smaller pool makes actors queue for desktops.
    in_flight = cfg.local.actors * cfg.actor.max_groups * cfg.broker.group_size
    if cfg.env_server.pool_size < in_flight:
        notes.append(f"env_server.pool_size {cfg.env_server.pool_size} -> {in_flight} (local.actors x "
                     f"actor.max_groups x broker.group_size episodes run at once)")
        cfg.env_server.pool_size = in_flight
    return notes


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the supervisor's own signal handling still stops the children
        pass


def probe(host: str, port: int, timeout_s: float, net: Any, keys_dir: Path, alive: Callable[[], bool],
          run_id: str = "") -> None:
    """Wait until a server answers Hello with Ready (its sockets are bound and its loop runs), through the
    same handshake every role's link does. A broker of another run than ``run_id`` answering there is an error
    (``OtherRunError``, a RuntimeError), not a server up."""
    import structlog
    import zmq

    from common import protocol as P
    from common.net import ServerLink, security_for
    from common.net.server import PROBE_ROLE

    ctx = zmq.Context.instance()
    security = security_for(ctx, net, keys_dir, host)
    hello = P.Hello(role=PROBE_ROLE, peer_id=f"probe-{os.getpid()}", run_id=run_id)
    link = ServerLink(ctx, net.address(port, host=host), hello, net, security,
                      log=structlog.ReturnLogger())  # a server not up yet is expected: no warnings
    deadline = time.monotonic() + timeout_s
    try:
        while not link.ready:
            if not alive():
                raise RuntimeError("the process exited before it became ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no Ready from {host}:{port} within {timeout_s:.0f} s")
            link.poll(0.2)
    finally:
        link.close()
        security.close()


def evaluated_step(run_dir: RunDir) -> int:
    """The newest checkpoint version ``eval.jsonl`` holds a result for; -1 when none (an evaluation that was killed
    or failed wrote none, so a resumed run evaluates that checkpoint again)."""
    steps = [r["step"] for r in read_records(run_dir.metrics / "eval.jsonl")
             if isinstance(r.get("step"), int) and "success_rate" in r]
    return max(steps, default=-1)


class Supervisor:
    def __init__(self, cfg: Any, config_path: Path, run_dir: RunDir, resume: bool, out: Any = None,
                 roles: list[Role] | None = None, launcher: Callable[[Role], list[str]] | None = None,
                 log_suffix: str = "", stop_signal: int = signal.SIGTERM, scheduler_steps: bool = False,
                 kill_step: Callable[[Role], str] | None = None):
        """``roles`` default to every role on this machine; ``launcher`` gives the command a role runs under
        (``srun ...`` in a Slurm allocation; nothing locally), ``log_suffix`` marks its stderr file's name,
        ``stop_signal`` is what asks a role to stop (under srun, one that srun passes on to the role);
        ``scheduler_steps``: the roles are a scheduler's job steps, which the scheduler may signal itself (above);
        ``kill_step`` kills a role's tasks where they run (a Slurm step's, ``launch/slurm.py``) when the supervisor kills
        it: killing the local ``srun`` alone leaves them to the scheduler's own, slower, clean-up."""
        self.cfg, self.local = cfg, cfg.local
        self.local.validate()
        self.run_dir = run_dir
        self.out = out or sys.stdout
        self.tty = hasattr(self.out, "isatty") and self.out.isatty()
        common_args = ["--config", str(config_path), "--run-dir", str(run_dir.root)]
        if roles is None and self.local.netns:  # every role in its own network namespace
            from launch.netns import Fabric
            fabric = Fabric.load(self.local.netns)
            roles = fabric_roles(cfg, fabric, common_args, resume)
            launcher = launcher or (lambda role: fabric.exec_prefix(role.label))
        self.roles = roles if roles is not None else local_roles(cfg, common_args, resume)
        self.launcher = launcher or (lambda role: [])
        self.log_suffix = log_suffix
        self.stop_signal = stop_signal
        self.scheduler_steps = scheduler_steps
        self.kill_step = kill_step
        self.config_path = config_path
        self.eval_proc: subprocess.Popen | None = None
        # Checkpoint version being (or last) evaluated. A resumed run starts past the ones it recorded: a run
        # resumed after its last evaluation (a preemption, or --resume of a finished run) evaluated that checkpoint
        # again, a second point at one step on the curve and a second set of its episodes in the viewer.
        self.eval_step = evaluated_step(self.run_dir) if resume else -1
        self.resume = resume
        self.eval_deadline = 0.0  # monotonic time past which the running evaluation is killed
        # The curve starts from the policy RL starts from (a fresh model from config has nothing to show).
        start = Path(cfg.model.path) if cfg.model.path else None
        self.start_policy = start if (self.local.eval_start and not resume and start and start.is_dir()) else None
        self.stopping = False
        self.outcome = ""
        self.config_error = False  # the run ended on a role that cannot run with the config (EXIT_CONFIG)
        self.t0 = self._last_pass = time.monotonic()
        self._next_pulse_check = 0.0
        self._view_lines = 0

    # ----- processes -----------------------------------------------------------------------------

    def _spawn(self, role: Role) -> None:
        where = f"@{'+'.join(n.name for n in role.nodes)}" if role.nodes else ""
        role.stderr_path = self.run_dir.logs / f"{role.label}{where}{self.log_suffix}.stderr"
        env = {**os.environ, "COMPUTERRL_QUIET": "1", "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": str(self.local.torch_threads), **role.env}
        if self.scheduler_steps and role.name != "learner":
            env[DEFER_TERM_ENV] = "1"
        role.pulse = self.run_dir.pulse / role.label
        try:  # a file left by the process before this one must not stand for this one's first beat
            role.pulse.parent.mkdir(exist_ok=True)
            role.pulse.unlink(missing_ok=True)
        except OSError:
            pass
        env[PULSE_ENV], role.pulse_mtime = str(role.pulse), None
        argv = [*self.launcher(role), sys.executable, "-m", "launch.cli", *role.args]
        with open(role.stderr_path, "ab") as err:
            role.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        role.started_at = time.monotonic()

    def _stderr_tail(self, role: Role, n: int = 15) -> str:
        try:
            lines = role.stderr_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def start(self) -> None:
        net = self.cfg.net
        from common.demofile import run_demo_sets
        if run_demo_sets(self.cfg):  # the learner and actors load them; recorded here once, before they start
            from actor.demos import record_run_demos
            t0 = time.monotonic()
            for name, n in record_run_demos(self.cfg, self.run_dir).items():
                self._event(f"{name} demonstrations: {n} in {self.run_dir.demos(name)} "
                            f"({time.monotonic() - t0:.1f} s)")
        # Servers first, each answering Hello before the next starts; the learner and actors then find them.
        for server in [r for r in self.roles if r.ready is not None]:
            self._spawn(server)
            host, port = server.ready
            try:
                probe(host, port, self.local.ready_timeout_s, net, self.run_dir.keys,
                      lambda: server.proc.poll() is None, self.run_dir.run_id)
            except RuntimeError as exc:  # which role, and why (a port taken, a bad config): its stderr says
                raise RuntimeError(f"{server.label}: {exc}; its stderr ends:\n{self._stderr_tail(server, 4)}") from None
        for role in self.roles:
            if role.proc is None:
                self._spawn(role)

    def stop(self, reason: str) -> None:
        """Learner first (it checkpoints), then actors, env_server, broker; kill what lingers."""
        if not self.outcome:
            self.outcome = reason
        self.stopping = True
        order = ["learner", "actor", "env_server", "broker"]
        for name in order:
            group = [r for r in self.roles if r.name == name and r.proc is not None and r.proc.poll() is None]
            for r in group:
                r.proc.send_signal(self.stop_signal)
            # The learner finishes the step it is in, then checkpoints: a step can outlast other roles' exits.
            timeout = self.local.learner_stop_timeout_s if name == "learner" else self.local.stop_timeout_s
            deadline = time.monotonic() + timeout
            for r in group:
                try:
                    r.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._kill(r, f"did not exit within {timeout:g} s of being asked to stop", stacks=True)
            if name == "learner":
                self._say_unsaved_steps(group)
        for r in self.roles:  # anything a role started in its own group goes too
            if r.proc is not None:
                try:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _say_unsaved_steps(self, learners: list[Role]) -> None:
        """After the learner was asked to stop: a rank that exited otherwise than stopped (its checkpoint on the way
        out refused by a full disk, a crash in its last step) leaves its steps since the latest checkpoint unsaved,
        which the outcome alone ("interrupted") does not say. Its stderr may be on that full disk, so the supervisor
        says it here."""
        for r in learners:
            rc = r.proc.poll()
            if rc is None or rc in (0, EXIT_RESUMABLE, -signal.SIGKILL):  # (a kill is said where it is sent)
                continue
            latest = self.run_dir.latest_checkpoint()
            unsaved = (f"the steps after {latest}, the latest checkpoint, are not saved" if latest
                       else "no step is saved (no checkpoint was written)")
            tail = self._stderr_tail(r, 4)
            self._event(f"{r.label} exited {rc} while stopping, its checkpoint on the way out not confirmed: "
                        f"{unsaved}; with --resume the run goes on from there and trains them again (their groups "
                        "stay the broker's)" + (f"\n{tail}" if tail else ""))

    def _kill(self, role: Role, why: str, stacks: bool = False, reap_s: float = 10.0) -> None:
        """Kill ``role``'s process group, and say so. With ``stacks`` (a role that would not stop), the role first
        prints its threads' stacks into its stderr (SIGUSR1, which every role hands to ``faulthandler``): where it
        hung. A process that outlives SIGKILL for ``reap_s`` (stuck in uninterruptible I/O: the kill lands when that
        returns) is left to the kernel and said, not waited for: the run must still end with its outcome."""
        if stacks:
            try:
                role.proc.send_signal(signal.SIGUSR1)
                role.proc.wait(0.5)  # faulthandler writes from the signal handler itself; a role may also exit now
            except subprocess.TimeoutExpired:
                pass
            why += f"; its threads' stacks are at the end of {role.stderr_path}"
        if self.kill_step is not None:
            why += f"; {self.kill_step(role)}"
        try:
            os.killpg(role.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # already gone, group and all
            pass
        try:
            role.proc.wait(reap_s)
        except subprocess.TimeoutExpired:
            why += f"; still there {reap_s:.0f} s after SIGKILL (pid {role.proc.pid}), left behind"
        self._event(f"{role.label} killed: {why}")

    def _check(self) -> bool:
        """One supervision pass; False once the run is over."""
        now = time.monotonic()
        gap, self._last_pass = now - self._last_pass, now
        watch = bool(self.local.hang_timeout_s) and now >= self._next_pulse_check
        if watch:
            self._next_pulse_check = now + max(0.5, self.local.hang_timeout_s / PULSE_CHECKS_PER_TIMEOUT)
        for role in self.roles:
            if gap > SUPERVISOR_GAP_S:
                role.pulse_seen += gap
            if role.done:
                continue
            if role.proc is None:
                if now >= role.next_start:
                    self._spawn(role)
                continue
            rc = role.proc.poll()
            if rc is None and watch and self._hung(role, now):
                rc = role.proc.poll()  # killed and reaped: restarted below, as a crash
            if rc is None:
                continue
            if role.name == "learner" and role.rank > 0 and rc == 0:
                role.done = True  # rank 0 said stop; rank 0's own exit ends the run
                continue
            if role.name == "learner" and rc == 0:
                self._finish()
                return False
            if self.scheduler_steps and rc in SIGNALLED_EXITS:
                self._event(f"{role.label} stopped on a signal the supervisor did not send (exit code {rc}): the "
                            "scheduler is taking the job back (a preemption signals every job step); stopping the "
                            "run, resumable")
                self.stop("interrupted")
                return False
            if rc == 0 and role.name in ("broker", "actor"):
                # Told to stop on Control by a learner that finished: they can leave before the learner
                # does; the learner's own exit (next passes) decides the outcome.
                role.done = True
                continue
            if rc == EXIT_CONFIG:  # it would fail the same way each time: a minute of restarts said nothing more
                self.config_error = True
                self.stop(f"{role.label} cannot run with this configuration (exit code {rc}), so it is not started "
                          "again; fix the configuration and run again (with --resume, a run that has checkpoints "
                          f"continues)\n{self._stderr_tail(role, 4)}")
                return False
            # The learner's ranks live and die together: all restart from the latest checkpoint.
            group = [r for r in self.roles if r.name == "learner"] if role.name == "learner" else [role]
            reset = self.local.restart_reset_s
            if reset and role.restarts and now - role.started_at >= reset:
                # max_restarts stops a crash loop; a role that ran this long was not in one, and a long run's rare
                # crashes (a day apart) must not add up to giving the run up.
                self._event(f"{role.label} ran {now - role.started_at:.0f} s before it exited: its "
                            f"{role.restarts} earlier restarts no longer count")
                for r in group:
                    r.restarts = 0
            if role.restarts >= self.local.max_restarts:
                self.stop(f"{role.label} exited {role.restarts + 1} times (last exit code {rc}); giving up; the "
                          f"run is resumable with --resume\n{self._stderr_tail(role)}")
                return False
            delay = min(30.0, self.local.restart_backoff_s * 2 ** role.restarts)
            for r in group:
                if r is not role and r.proc is not None and r.proc.poll() is None:
                    self._kill(r, f"restarts with {role.label}")
                if r.name == "learner" and "--resume" not in r.args:
                    r.args = [*r.args, "--resume"]
                r.restarts += 1
                r.done = False
                r.proc, r.next_start = None, now + delay
            self._event(f"{role.label} exited with code {rc}; restart {role.restarts} in {delay:.0f} s")
        return True

    def _hung(self, role: Role, now: float) -> bool:
        """Whether ``role``, running, is hung: its pulse file has not changed for ``hang_timeout_s`` (``common/pulse.py``;
        a role not beating yet, still starting, or never, a learner rank past 0, is not watched). A hung one is killed
        with its stacks."""
        limit = self.local.hang_timeout_s
        if not limit or role.pulse is None:
            return False
        try:
            mtime = role.pulse.stat().st_mtime_ns
        except OSError:
            return False
        if mtime != role.pulse_mtime:
            role.pulse_mtime, role.pulse_seen = mtime, now
            return False
        if now - role.pulse_seen < limit:
            return False
        why = f"hung: its main loop gave no sign of life for {now - role.pulse_seen:.0f} s (local.hang_timeout_s)"
        stopped = False
        if not role.nodes:  # what the kernel says it is doing: T stopped, D in uninterruptible I/O, S waiting, R busy
            try:
                state = Path(f"/proc/{role.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                state = "?"
            stopped = state in ("T", "t")
            why += f"; process state {state}" + (" (stopped: it cannot print its stacks)" if stopped else "")
        self._kill(role, why, stacks=not stopped)
        return True

    def _finish(self) -> None:
        """The learner finished its steps and told everyone to stop: let the actors drain, then end."""
        deadline = time.monotonic() + self.local.stop_timeout_s
        for r in self.roles:
            if r.name == "actor" and r.proc is not None:
                try:
                    r.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self.stop("finished")

    def run(self) -> int:
        interrupted = []

        def on_signal(signum, _frame):
            # One interrupt only: a second notice must not cut the stop under way short, nor raise out of the
            # handler that is starting it (a preemption without grace time TERMs the supervisor twice at once:
            # Slurm's own signal and the batch script's forwarded one; the second aborted the run, exit 1).
            if not self.stopping and not interrupted:
                interrupted.append(signum)
                raise KeyboardInterrupt
        old = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
        forwarder = None
        if self.cfg.metrics.forwarded:
            from common import config as configlib
            from common.metrics.sinks import MetricsForwarder
            forwarder = MetricsForwarder(self.run_dir.metrics, self.run_dir.root, self.cfg.metrics,
                                         self.cfg.run.run_id, configlib.to_dict(self.cfg))
        next_forward = 0.0
        try:
            self._event(f"run directory: {self.run_dir.root}")
            done = self._finished_before()
            if done:  # nothing to start: only an evaluation the last attempt did not record is left (below)
                self._event(done)
                self.outcome = "finished"
            else:
                self.start()
                counts = {name: sum(r.name == name for r in self.roles) for name in ("env_server", "actor")}
                self._event(f"started: broker, {counts['env_server']} env_server(s), learner, "
                            f"{counts['actor']} actor(s)")
            next_view = next_curve = 0.0
            while not done and self._check():
                now = time.monotonic()
                if now >= next_view:
                    self._view()
                    next_view = now + self.local.view_interval_s
                if now >= next_curve:
                    self._curve()
                    next_curve = now + 30.0
                if forwarder is not None and now >= next_forward:
                    forwarder = self._forward(forwarder)
                    next_forward = now + self.cfg.metrics.poll_s
                self._poll_eval()
                time.sleep(0.2)
        except KeyboardInterrupt:
            self._event("stopping (signal): the learner checkpoints first")
            self.stop("interrupted")
        except Exception as exc:
            self.stop(f"supervisor error: {exc!r}")
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        if self.outcome == "finished" and self.local.eval_episodes > 0:
            self._finish_evals()
        elif self.eval_proc is not None and self.eval_proc.poll() is None:
            self.eval_proc.kill()
            self.eval_proc.wait()
        self._view(final=True)
        forwarder = self._forward(forwarder) if forwarder is not None else None
        if forwarder is not None:
            forwarder.close()
            self._event(f"metrics forwarded to {', '.join(self.cfg.metrics.forwarded)}: {forwarder.forwarded} records")
        if self._curve():
            self._event(f"learning curve: {self.run_dir.curve_png}")
        self._event(f"outcome: {self.outcome}")
        # Interrupted (a signal, e.g. a scheduler's preemption notice): resumable, and said so by the exit code.
        if self.outcome == "finished":
            return 0
        return EXIT_RESUMABLE if self.outcome == "interrupted" else EXIT_CONFIG if self.config_error else 1

    def _finished_before(self) -> str:
        """On a resume, what to say when the latest checkpoint is already at ``learner.total_steps``; "" otherwise.
        Such a run started every role (20 s here), and its learner finished at once."""
        total = self.cfg.learner.total_steps
        step = self.run_dir.latest_step()
        if not (self.resume and total) or step < total:
            return ""
        return (f"the run finished at step {step} (learner.total_steps={total}): nothing to train; raise "
                f"learner.total_steps to train on")

    def _forward(self, forwarder: Any) -> Any:
        """One forwarding pass; a sink that fails (a full disk, a W&B error) is reported and dropped, never the
        run. Returns the forwarder, or None once it failed."""
        try:
            forwarder.poll()
            return forwarder
        except Exception as exc:
            self._event(f"metrics forwarding stopped: {exc!r} (the JSONL records are complete; "
                        f"`computerrl metrics {self.run_dir.root}` forwards them later)")
            return None

    def _finish_evals(self) -> None:
        """The final checkpoint's evaluation belongs on the curve: finish any running one (within its deadline),
        then run it."""
        for _ in range(2):
            if self.eval_proc is not None:
                try:
                    self.eval_proc.wait(max(0.0, self.eval_deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass  # _poll_eval kills it and says so
            self._poll_eval(final=True)

    def _poll_eval(self, final: bool = False) -> None:
        """Evaluate each new checkpoint on held-out tasks in a separate process; results go to eval.jsonl."""
        if self.local.eval_episodes <= 0:
            return
        out = self.run_dir.logs / "eval.out"
        if self.eval_proc is not None:
            if self.eval_proc.poll() is None:
                if time.monotonic() < self.eval_deadline:
                    return
                self.eval_proc.kill()  # a hung desktop or engine: the run goes on, the evaluation is a failure
                self.eval_proc.wait()
                self._event(f"held-out eval at step {self.eval_step} killed after local.eval_timeout_s="
                            f"{self.local.eval_timeout_s:g} s")
            lines = out.read_text(errors="replace").strip().splitlines() if out.exists() else []
            try:
                result = json.loads(lines[-1])
                self._event(f"held-out eval at step {self.eval_step}: success {result['success_rate']:.3f}")
                with open(self.run_dir.metrics / "eval.jsonl", "a") as f:
                    f.write(json.dumps({"step": self.eval_step, **result}) + "\n")
            except (ValueError, IndexError, KeyError):
                self._event(f"held-out eval at step {self.eval_step} failed (see {out} and eval.stderr)")
            except OSError as exc:  # a full disk: the result is lost to the curve, the run goes on
                self._event(f"held-out eval at step {self.eval_step} not recorded: {exc!r}")
            self.eval_proc = None
        if self.stopping and not final:
            return
        if self.start_policy is not None and self.eval_step < 0:
            ckpt, step = self.start_policy, 0
        else:
            step = self.run_dir.latest_step()
            if step < 0 or step <= self.eval_step:
                return  # none yet, or that one evaluated already
            ckpt = self.run_dir.checkpoints / self.run_dir.latest_checkpoint()
        self.eval_step = step
        args = [sys.executable, "-m", "launch.cli", "eval", "--checkpoint", str(ckpt), "--suite",
                self.local.eval_suite, "--episodes", str(self.local.eval_episodes), "--config",
                str(self.config_path), "--record", str(self.run_dir.episodes), "--json"]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.local.torch_threads)}
        try:
            with open(out, "w") as f, open(self.run_dir.logs / "eval.stderr", "ab") as err:
                self.eval_proc = subprocess.Popen(args, stdout=f, stderr=err, env=env,
                                                  start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as exc:  # (a full disk: this checkpoint goes unevaluated, the run goes on)
            self._event(f"held-out eval at step {step} not started: {exc!r}")
            return
        self.eval_deadline = time.monotonic() + self.local.eval_timeout_s

    def _curve(self) -> bool:
        from launch.curve import render_curve

        try:
            return render_curve(self.run_dir.metrics, self.run_dir.curve_png, f"run {self.run_dir.root.name}")
        except Exception as exc:  # a drawing problem never stops a run
            self._event(f"learning curve not drawn: {exc!r}")
            return False

    # ----- terminal view (launch/live_view.py draws it) ----------------------------------------------

    def _event(self, text: str) -> None:
        self._view_lines = 0
        self._say(f"[computerrl] {text}\n")

    def _say(self, text: str) -> None:
        """To the terminal, or to the file a batch system put there: on a full disk that is lost, not the run."""
        try:
            self.out.write(text)
            self.out.flush()
        except OSError:
            pass

    def _view(self, final: bool = False) -> None:
        lines = render_view(self.run_dir, self.cfg, time.monotonic() - self.t0,
                            {r.label: (r.proc is not None and r.proc.poll() is None, r.restarts) for r in self.roles})
        if self.tty and not final:
            self._say((f"\x1b[{self._view_lines}F\x1b[J" if self._view_lines else "") + "\n".join(lines) + "\n")
            self._view_lines = len(lines)
        elif final or int(time.monotonic() - self.t0) % 10 < self.local.view_interval_s:
            self._say(" | ".join(lines) + "\n")

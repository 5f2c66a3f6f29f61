"""The local supervisor's own duties, without starting a run's roles."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time

import pytest

from common.rundir import RunDir
from launch.config import load_run_config
from launch.local import Supervisor
from tests.conftest import REPO


def test_a_hung_evaluation_is_killed_at_its_deadline_and_the_next_checkpoint_is_evaluated(tmp_path, monkeypatch,
                                                                                         request):
    """A periodic evaluation that never ends (a hung desktop or engine) held every later evaluation back and, at the
    run's end, held the supervisor's exit forever: it now has a deadline, is killed there and logged as failed."""
    started: list[subprocess.Popen] = []
    request.addfinalizer(lambda: [p.kill() for p in started])
    real_popen = subprocess.Popen

    def hanging_eval(args, **kw):  # the evaluation the supervisor starts, standing still
        started.append(real_popen(["sleep", "600"], **kw))
        return started[-1]
    monkeypatch.setattr("launch.local.subprocess.Popen", hanging_eval)
    cfg = load_run_config(REPO / "configs" / "local.yaml", ["local.eval_episodes=1", "local.eval_timeout_s=0.5",
                                                            "local.eval_start=false"])
    rd = RunDir.create(tmp_path / "run")
    out = io.StringIO()
    sup = Supervisor(cfg, REPO / "configs" / "local.yaml", rd, resume=False, out=out, roles=[])

    def checkpoint(step: int) -> None:
        (rd.checkpoints / f"step-{step:08d}").mkdir()
        (rd.checkpoints / "latest").write_text(f"step-{step:08d}")
    checkpoint(1)
    sup._poll_eval()
    assert len(started) == 1 and sup.eval_step == 1
    checkpoint(2)
    sup._poll_eval()
    assert len(started) == 1, "one evaluation at a time, within its deadline"
    time.sleep(0.6)
    sup._poll_eval()
    assert started[0].poll() is not None, "killed at its deadline"
    assert "held-out eval at step 1 killed after local.eval_timeout_s=0.5 s" in out.getvalue()
    assert "held-out eval at step 1 failed" in out.getvalue()
    assert len(started) == 2 and sup.eval_step == 2, "the next checkpoint's evaluation started"
    # At the run's end the final checkpoint's evaluation is waited for, within its deadline, not forever.
    checkpoint(3)
    t0 = time.monotonic()
    sup._finish_evals()
    assert time.monotonic() - t0 < 5 and all(p.poll() is not None for p in started), "every hung one killed"
    assert sup.eval_proc is None and sup.eval_step == 3 and len(started) == 3
    assert "held-out eval at step 3 killed" in out.getvalue()


def test_a_resumed_run_evaluates_no_checkpoint_its_evaluations_already_recorded(tmp_path, monkeypatch):
    """A run resumed after its last checkpoint's evaluation (`--resume` of a finished run, a preemption right after
    an evaluation) evaluated that checkpoint again: a second point at one step on the curve, a second set of its
    episodes in the viewer. A checkpoint whose evaluation left no result (killed, failed) is evaluated again."""
    started: list[list[str]] = []

    class Evaluation:
        def __init__(self, args, **kw):
            started.append(args)

        def poll(self):
            return None
    monkeypatch.setattr("launch.local.subprocess.Popen", Evaluation)
    cfg = load_run_config(REPO / "configs" / "local.yaml", ["local.eval_episodes=1"])
    rd = RunDir.create(tmp_path / "run")
    for step in (10, 20):
        (rd.checkpoints / f"step-{step:08d}").mkdir()
    (rd.checkpoints / "latest").write_text("step-00000020")

    def resumed() -> Supervisor:
        sup = Supervisor(cfg, REPO / "configs" / "local.yaml", rd, resume=True, out=io.StringIO(), roles=[])
        sup._poll_eval()
        return sup
    with open(rd.metrics / "eval.jsonl", "w") as f:
        f.write('{"step": 0, "success_rate": 0.5}\n{"step": 10, "success_rate": 0.6}\n{"step": 20, "succ')  # torn
    assert resumed().eval_step == 20 and len(started) == 1, "step 20's evaluation left no whole record: run again"
    with open(rd.metrics / "eval.jsonl", "a") as f:
        f.write('\n{"step": 20, "success_rate": 0.7}\n')
    sup = resumed()
    assert sup.eval_step == 20 and len(started) == 1, "step 20 is on record: not evaluated again"
    (rd.checkpoints / "step-00000030").mkdir()
    (rd.checkpoints / "latest").write_text("step-00000030")
    sup._poll_eval()
    assert sup.eval_step == 30 and len(started) == 2 and "step-00000030" in " ".join(started[-1])


def test_resuming_a_finished_run_starts_no_role_and_runs_only_the_evaluation_it_lacks(tmp_path, monkeypatch):
    """`--resume` of a run whose latest checkpoint is at learner.total_steps started every role (20 s here), and its
    learner finished at once. Now nothing starts; an evaluation the last attempt did not record (a preemption during
    the final one) still runs."""
    evaluated: list[list[str]] = []

    class Evaluation:  # ends at once with a result
        def __init__(self, args, **kw):
            evaluated.append(args)
            (rd.logs / "eval.out").write_text('{"success_rate": 0.9, "episodes": 1}\n')

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0
    monkeypatch.setattr("launch.local.subprocess.Popen", Evaluation)
    cfg = load_run_config(REPO / "configs" / "local.yaml", ["local.eval_episodes=1", "learner.total_steps=4"])
    rd = RunDir.create(tmp_path / "run")
    (rd.checkpoints / "step-00000004").mkdir()
    (rd.checkpoints / "latest").write_text("step-00000004")

    def resumed() -> tuple[int, str]:
        out = io.StringIO()
        sup = Supervisor(cfg, REPO / "configs" / "local.yaml", rd, resume=True, out=out, roles=[])
        monkeypatch.setattr(sup, "start", lambda: pytest.fail("a role was started"))
        return sup.run(), out.getvalue()
    code, said = resumed()
    assert code == 0 and "the run finished at step 4 (learner.total_steps=4): nothing to train" in said
    assert len(evaluated) == 1 and "held-out eval at step 4: success 0.900" in said, said
    code, said = resumed()
    assert code == 0 and len(evaluated) == 1, "its result is on record: not evaluated again"
    cfg.learner.total_steps = 6  # raised: the run trains on
    sup = Supervisor(cfg, REPO / "configs" / "local.yaml", rd, resume=True, out=io.StringIO(), roles=[])
    assert sup._finished_before() == ""


HANGING_ROLE = """
import signal, sys, time
from launch.cli.base import start_role
start_role("actor", None, sys.argv[1], ())
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a role that will not stop when asked


def hang_here():
    print("ready", flush=True)
    time.sleep(600)


hang_here()
"""


def test_a_role_that_will_not_stop_leaves_its_stacks_and_one_that_outlives_sigkill_does_not_crash_the_stop(
        tmp_path, request):
    """A role that ignores the stop signal is killed at its deadline, after printing where its threads are (every
    role hands SIGUSR1 to faulthandler). One that is still there 10 s after SIGKILL (uninterruptible I/O: seen once,
    an actor at the end of a loaded whole-suite run) used to raise out of the supervisor's stop, so the run exited 1
    instead of resumable; now it is said and left behind."""
    from launch.placement import Role

    cfg = load_run_config(REPO / "configs" / "local.yaml", ["local.stop_timeout_s=0.5"])
    rd = RunDir.create(tmp_path / "run")
    roles = []
    for rank in (0, 1):
        stderr_path = tmp_path / f"actor-{rank}.stderr"
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-c", HANGING_ROLE, str(tmp_path / f"role-{rank}")], cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        request.addfinalizer(proc.kill)
        roles.append(Role("actor", rank, [], True, proc=proc, stderr_path=stderr_path))
    for r in roles:
        assert r.proc.stdout.readline() == b"ready\n"
    outlives = roles[1].proc
    real_wait = outlives.wait

    def never_reaped(timeout=None):  # as a process in uninterruptible I/O: SIGKILL lands, the exit does not come
        time.sleep(min(timeout or 0.5, 0.5))
        raise subprocess.TimeoutExpired(outlives.args, timeout)
    outlives.wait = never_reaped
    out = io.StringIO()
    sup = Supervisor(cfg, REPO / "configs" / "local.yaml", rd, resume=False, out=out, roles=roles)
    t0 = time.monotonic()
    sup.stop("interrupted")
    assert time.monotonic() - t0 < 15
    said = out.getvalue()
    for r in roles:
        assert f"actor-{r.rank} killed: did not exit within 0.5 s of being asked to stop; its threads' stacks are at " \
               f"the end of {r.stderr_path}" in said
        assert "in hang_here" in r.stderr_path.read_text(), "faulthandler's dump of the main thread"
    assert f"still there 10 s after SIGKILL (pid {outlives.pid}), left behind" in said
    assert "actor-0 killed" in said and "left behind" not in said.split("actor-1 killed")[0]
    assert roles[0].proc.poll() == -9 and real_wait(5) == -9, "both killed"


def test_an_evaluation_the_disk_cannot_take_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    """On a full disk the evaluation's output file cannot be opened, nor its result appended to eval.jsonl: each
    is said in the run's events, and the supervisor (the whole run's parent) carries on."""
    import builtins

    cfg = load_run_config(REPO / "configs" / "local.yaml", ["local.eval_episodes=1", "local.eval_start=false"])
    rd = RunDir.create(tmp_path / "run")
    out = io.StringIO()
    sup = Supervisor(cfg, REPO / "configs" / "local.yaml", rd, resume=False, out=out, roles=[])
    (rd.checkpoints / "step-00000001").mkdir()
    (rd.checkpoints / "latest").write_text("step-00000001")
    real_open = builtins.open

    def full_disk(path, mode="r", *args, **kw):
        if any(m in mode for m in "wa"):
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *args, **kw)

    monkeypatch.setattr(builtins, "open", full_disk)
    sup._poll_eval()
    assert sup.eval_proc is None and "held-out eval at step 1 not started" in out.getvalue()

    class Finished:  # an evaluation that ended, its result printed, with the disk full again for eval.jsonl
        def poll(self):
            return 0

    monkeypatch.setattr(builtins, "open", real_open)
    (rd.logs / "eval.out").write_text('{"success_rate": 0.5, "episodes": 1}\n')
    monkeypatch.setattr(builtins, "open", full_disk)
    sup.eval_proc, sup.eval_deadline = Finished(), time.monotonic() + 60
    sup._poll_eval()
    assert "held-out eval at step 1: success 0.500" in out.getvalue()
    assert "held-out eval at step 1 not recorded" in out.getvalue() and sup.eval_proc is None


def test_restarts_count_a_crash_loop_not_a_long_runs_rare_crashes(tmp_path, monkeypatch):
    """``max_restarts`` in a row gives the run up; a role that had run ``restart_reset_s`` before it exited starts
    its count afresh, however many crashes a long run has had."""
    from launch.placement import Role

    def supervised(ran_s: float):
        cfg = load_run_config(REPO / "configs" / "local.yaml", ["local.max_restarts=2", "local.restart_backoff_s=0",
                                                                 "local.restart_reset_s=60"])
        role = Role("actor", 0, [], True)
        out = io.StringIO()
        sup = Supervisor(cfg, REPO / "configs" / "local.yaml", RunDir.create(tmp_path / f"run-{ran_s}"),
                         resume=False, out=out, roles=[role])
        spawned = []

        def crashes(r):  # a role that exits with 3 after it ran ``ran_s``
            r.stderr_path = tmp_path / "actor-0.stderr"
            r.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
            r.proc.wait(30)
            r.started_at = time.monotonic() - ran_s
            spawned.append(r.proc)

        monkeypatch.setattr(sup, "_spawn", crashes)
        crashes(role)
        passes = 0
        while passes < 40 and sup._check():
            passes += 1
        return len(spawned), out.getvalue() + sup.outcome

    starts, said = supervised(0.0)
    assert starts == 3 and "actor-0 exited 3 times (last exit code 3); giving up" in said, said
    starts, said = supervised(120.0)
    assert starts > 10 and "giving up" not in said, said
    assert "actor-0 ran 120 s before it exited: its 1 earlier restarts no longer count" in said


def test_a_role_stopped_by_the_scheduler_stops_the_run_in_order_rather_than_restarting(tmp_path, monkeypatch):
    """With its roles as a scheduler's job steps, a learner that exits 75 unasked (a preemption TERMs every step; the
    learner checkpoints and goes) means the job is being taken back: every other role is asked to stop, in order, and
    the run ends resumable, with nothing restarted. Locally the same exit is a crash and the role restarts. Every role
    but the learner gets ``COMPUTERRL_DEFER_TERM`` only under the scheduler."""
    from common.exitcodes import EXIT_RESUMABLE
    from common.signals import DEFER_TERM_ENV
    from launch.placement import Role

    def supervised(scheduler_steps: bool):
        cfg = load_run_config(REPO / "configs" / "local.yaml", ["local.restart_backoff_s=0",
                                                                 "local.stop_timeout_s=5"])
        roles = [Role("broker", 0, [], True), Role("learner", 0, [], True), Role("actor", 0, [], True)]
        out = io.StringIO()
        sup = Supervisor(cfg, REPO / "configs" / "local.yaml", RunDir.create(tmp_path / f"run-{scheduler_steps}"),
                         resume=False, out=out, roles=roles, scheduler_steps=scheduler_steps)
        spawned, envs = [], {}
        real_popen = subprocess.Popen

        def popen(argv, env=None, **kw):  # what each role was started with; the learner exits 75 at once
            label = env["COMPUTERRL_TEST_ROLE"]
            envs[label] = env.get(DEFER_TERM_ENV)
            code = f"raise SystemExit({EXIT_RESUMABLE})" if label == "learner" else "import time; time.sleep(30)"
            proc = real_popen([sys.executable, "-c", code], **{k: v for k, v in kw.items() if k != "preexec_fn"})
            spawned.append((label, proc))
            return proc

        for r in roles:
            r.env = {"COMPUTERRL_TEST_ROLE": r.name}
        monkeypatch.setattr(subprocess, "Popen", popen)  # restarts included
        for r in roles:
            sup._spawn(r)
        roles[1].proc.wait(30)
        passes = 0
        while passes < 5 and sup._check():
            passes += 1
        alive = [label for label, p in spawned if p.poll() is None]
        for _, p in spawned:
            p.kill()
            p.wait()
        monkeypatch.setattr(subprocess, "Popen", real_popen)
        return out.getvalue(), sup.outcome, envs, alive

    said, outcome, envs, alive = supervised(True)
    assert "learner-0 stopped on a signal the supervisor did not send (exit code 75)" in said, said
    assert outcome == "interrupted" and "restart" not in said, said
    assert not alive, "the broker and the actor were stopped too"
    assert envs == {"broker": "1", "learner": None, "actor": "1"}
    said, outcome, envs, alive = supervised(False)
    assert "learner-0 exited with code 75; restart 1" in said and not outcome, said
    assert envs == {"broker": None, "learner": None, "actor": None}


STOPPABLE_ROLE = "import signal, time; signal.signal(signal.SIGTERM, lambda *a: exit(0)); print('ready', flush=True); " \
                 "time.sleep(60)"


@pytest.mark.parametrize("first", ["SIGTERM", "SIGHUP"])
def test_a_second_stop_signal_while_the_first_starts_the_stop_does_not_abort_the_run(tmp_path, request, first):
    """Under Slurm a preemption without grace time TERMs the supervisor twice at once: Slurm's own signal and the
    batch script's forwarded one. A second signal that landed after the first had interrupted the loop, before the
    stop under way had begun, raised out of the handler starting it: the supervisor left without stopping its roles
    and exited 1 (click's "Aborted!"), so the job was not requeued (one run in five, docs/slurm.md). Here the second
    signal comes exactly there. A HUP (the terminal the run was started from closed) stops it the same way: it used to
    kill the supervisor where it stood, exit 129, its roles TERMed by their parent's death (found by hand, 2026-12-03)."""
    import os
    import signal

    from common.exitcodes import EXIT_RESUMABLE
    from launch.placement import Role

    cfg = load_run_config(REPO / "configs" / "local.yaml", ["local.stop_timeout_s=5", "local.eval_episodes=0"])
    roles = []
    for name in ("learner", "broker"):
        proc = subprocess.Popen([sys.executable, "-c", STOPPABLE_ROLE], stdout=subprocess.PIPE, start_new_session=True)
        request.addfinalizer(proc.kill)
        assert proc.stdout.readline() == b"ready\n"
        roles.append(Role(name, 0, [], True, proc=proc, stderr_path=tmp_path / f"{name}.stderr"))
    out = io.StringIO()
    sup = Supervisor(cfg, REPO / "configs" / "local.yaml", RunDir.create(tmp_path / "run"), resume=False, out=out,
                     roles=roles)
    sup.start = lambda: None  # the roles above are running
    real_check, real_event = sup._check, sup._event

    def check() -> bool:  # the first signal comes during the first supervision pass
        os.kill(os.getpid(), getattr(signal, first))
        return real_check()

    def event(msg: str) -> None:
        real_event(msg)
        if msg.startswith("stopping (signal)"):  # the second: after the interrupt, before the stop
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs at the next bytecode: here, not later
    sup._check, sup._event = check, event
    try:
        rc = sup.run()
    except KeyboardInterrupt:  # caught here: escaping, it would end the whole test session
        pytest.fail(f"the second signal raised out of the supervisor's run:\n{out.getvalue()}")
    assert rc == EXIT_RESUMABLE, out.getvalue()
    assert sup.outcome == "interrupted"
    assert all(r.proc.poll() == 0 for r in roles), "each role asked to stop and stopped"


def test_a_role_that_cannot_run_with_its_config_ends_the_run_at_once_and_says_why(tmp_path, request):
    """A checkpoint gone from model.path (here: moved after the run was checked) failed the actor five times, a
    minute of restarts, before the run gave up calling itself resumable. The real actor command now exits 78
    (EX_CONFIG); the supervisor starts it once, stops the other roles and exits 78 with the actor's reason."""
    from common.exitcodes import EXIT_CONFIG
    from launch.placement import Role

    cfg = load_run_config(REPO / "configs" / "local.yaml", ["local.stop_timeout_s=5", "local.eval_episodes=0",
                                                             "local.restart_backoff_s=0", "learner.anchor.suite="])
    rd = RunDir.create(tmp_path / "run")
    learner = subprocess.Popen([sys.executable, "-c", STOPPABLE_ROLE], stdout=subprocess.PIPE, start_new_session=True)
    request.addfinalizer(learner.kill)
    assert learner.stdout.readline() == b"ready\n"
    gone = tmp_path / "moved-away"
    actor = Role("actor", 0, ["actor", "--config", str(REPO / "configs" / "local.yaml"), "--run-dir", str(rd.root),
                              f"model.path={gone}"], True)
    roles = [Role("learner", 0, [], True, proc=learner, stderr_path=tmp_path / "learner.stderr"), actor]
    out = io.StringIO()
    sup = Supervisor(cfg, REPO / "configs" / "local.yaml", rd, resume=False, out=out, roles=roles)
    starts = []
    real_spawn = sup._spawn

    def spawn(role):
        starts.append(role.label)
        real_spawn(role)
    sup._spawn = spawn
    rc = sup.run()
    said = out.getvalue()
    assert rc == EXIT_CONFIG, said
    assert starts == ["actor-0"], f"started {starts}: a role that cannot run was started again"
    assert "actor-0 cannot run with this configuration (exit code 78)" in said, said
    assert f"model.path {str(gone)!r}: no checkpoint there" in said, "the role's own reason, from its stderr"
    assert "restart" not in said and learner.poll() == 0, "nothing restarted; the learner was asked to stop"


PULSING_ROLE = """
import faulthandler, signal, sys, time
from common import pulse
faulthandler.register(signal.SIGUSR1, all_threads=True)


def stuck_here():  # a call that never returns (a deadlock, a driver that hangs)
    time.sleep(600)


mode, t0 = sys.argv[1], time.monotonic()
while True:  # a role's main loop
    if mode != "never":
        pulse.beat()
    if mode == "stuck" and time.monotonic() - t0 > 0.3:
        stuck_here()
    time.sleep(0.05)
"""


def test_a_role_whose_loop_stops_beating_is_killed_with_its_stacks_and_restarted_and_no_other_is(tmp_path,
                                                                                                 monkeypatch):
    """A role hung for good (its main loop stuck in a call, or the process stopped) never exits, so a supervisor that
    watched exits alone never restarted it and the run stood still. Its pulse file (common/pulse.py) stops changing;
    past ``local.hang_timeout_s`` it is killed, with its stacks where it can print them, and restarted as a crash.
    A role that beats is left alone, so is one that never beat (still starting; a learner rank past 0), and a pause
    of the supervisor itself (a suspended job) is not held against its roles."""
    import os
    import signal

    from launch.placement import Role

    cfg = load_run_config(REPO / "configs" / "local.yaml", ["local.hang_timeout_s=2", "local.restart_backoff_s=0"])
    modes = {"actor-0": "beat", "actor-1": "stuck", "actor-2": "beat", "env_server-0": "never"}
    roles = [Role(label.split("-")[0], int(label.split("-")[1]), [], True) for label in modes]
    for r in roles:
        r.env = {"COMPUTERRL_TEST_ROLE": r.label, "PYTHONPATH": str(REPO)}
    out = io.StringIO()
    sup = Supervisor(cfg, REPO / "configs" / "local.yaml", RunDir.create(tmp_path / "run"), resume=False, out=out,
                     roles=roles)
    spawned: list[tuple[str, subprocess.Popen]] = []
    real_popen = subprocess.Popen

    def popen(argv, env=None, **kw):  # each role as a loop that beats, gets stuck, or never beats
        label = env["COMPUTERRL_TEST_ROLE"]
        proc = real_popen([sys.executable, "-c", PULSING_ROLE, modes[label]], env=env, cwd=REPO,
                          **{k: v for k, v in kw.items() if k != "preexec_fn"})
        spawned.append((label, proc))
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)
    try:
        for r in roles:
            r.pulse = sup.run_dir.pulse / r.label
            r.pulse.parent.mkdir(exist_ok=True)
            r.pulse.write_text("")  # a predecessor's file: removed at the spawn, not taken for this one's beat
            sup._spawn(r)
        stopped = roles[2]
        deadline = time.monotonic() + 60
        while not stopped.pulse.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(stopped.proc.pid, signal.SIGSTOP)  # stopped and never continued
        while sum(label in ("actor-1", "actor-2") for label, _ in spawned) < 4:
            assert time.monotonic() < deadline and sup._check(), out.getvalue()
            time.sleep(0.2)
        said = out.getvalue()
        assert [label for label, _ in spawned].count("actor-0") == 1 and "actor-0" not in said, said
        assert [label for label, _ in spawned].count("env_server-0") == 1 and "env_server-0" not in said, said
        assert not (sup.run_dir.pulse / "env_server-0").exists()
        hung = r"gave no sign of life for [23] s \(local.hang_timeout_s\); process state"
        assert re.search(rf"actor-1 killed: hung: its main loop {hung} S; its threads' stacks are at the end of",
                         said), said
        assert "in stuck_here" in roles[1].stderr_path.read_text(), "faulthandler's dump, from the supervisor's USR1"
        assert re.search(rf"actor-2 killed: hung: its main loop {hung} T \(stopped: it cannot print its stacks\)$",
                         said, re.M), said
        assert "actor-1 exited with code -9; restart 1" in said and "actor-2 exited with code -9; restart 1" in said
        # The supervisor stopped for a minute (a suspended job): a role's file unchanged over that minute is not hung.
        healthy = roles[0]
        sup._check()
        seen = healthy.pulse_seen
        os.kill(healthy.proc.pid, signal.SIGSTOP)
        sup._last_pass -= 60
        healthy.pulse_seen -= 60
        sup._next_pulse_check = 0.0  # (a pass after a minute reads the pulses)
        assert sup._check() and healthy.proc.poll() is None and healthy.pulse_seen >= seen, out.getvalue()
    finally:
        for _, p in spawned:
            p.kill()
            p.wait()


def test_a_beat_creates_its_file_then_touches_it_and_one_it_cannot_write_is_counted_not_raised(tmp_path, monkeypatch):
    """The supervisor removes a role's pulse file before it starts the role: the first beat creates it, later ones
    move its modification time, at most once per BEAT_EVERY_S. A run directory that refuses the beat costs a count in
    the role's counters, never the role."""
    import os

    from common import pulse

    path = tmp_path / "pulse" / "actor-0"
    path.parent.mkdir()
    monkeypatch.setattr(pulse, "_state", {"path": None, "last": -pulse.BEAT_EVERY_S, "failures": 0})
    monkeypatch.setenv(pulse.PULSE_ENV, str(path))
    pulse.beat(now=100.0)
    assert path.exists() and pulse.counters() == {}
    os.utime(path, ns=(0, 0))
    pulse.beat(now=100.0 + pulse.BEAT_EVERY_S / 2)
    assert path.stat().st_mtime_ns == 0, "at most once per BEAT_EVERY_S"
    pulse.beat(now=100.0 + pulse.BEAT_EVERY_S)
    assert path.stat().st_mtime_ns > 0
    path.unlink()
    path.parent.rmdir()  # the run directory's pulse folder gone: the beat cannot be written
    pulse.beat(now=200.0)
    assert pulse.counters() == {"pulse_failures": 1}


STOPPING_LEARNER = """
import signal, sys, time
code = int(sys.argv[1])


def leave(*_):
    print("learner.process.CheckpointFailed: the checkpoint at version 13, taken on the way out, could not be written",
          file=sys.stderr, flush=True)
    sys.exit(code)


signal.signal(signal.SIGTERM, leave)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("exit_code", [1, 75])
def test_a_learner_that_exits_badly_while_stopping_is_said_to_leave_its_steps_unsaved(tmp_path, request, exit_code):
    """A learner whose checkpoint on the way out a full disk refused exits 1 (CheckpointFailed), and the run's
    outcome is still "interrupted" (resumable): the supervisor says which steps a resume trains again, since the
    learner's own stderr may be on the full disk. A learner that stopped as asked (75) is not said to."""
    from launch.placement import Role
    from tests.conftest import whole_checkpoint

    cfg = load_run_config(REPO / "configs" / "local.yaml", [])
    rd = RunDir.create(tmp_path / "run")
    whole_checkpoint(rd.checkpoints, 10)
    stderr_path = tmp_path / "learner-0.stderr"
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", STOPPING_LEARNER, str(exit_code)], stdout=subprocess.PIPE,
                                stderr=err, start_new_session=True)
    request.addfinalizer(proc.kill)
    assert proc.stdout.readline() == b"ready\n"
    out = io.StringIO()
    sup = Supervisor(cfg, REPO / "configs" / "local.yaml", rd, resume=False, out=out,
                     roles=[Role("learner", 0, [], True, proc=proc, stderr_path=stderr_path)])
    sup.stop("interrupted")
    said = out.getvalue()
    assert proc.returncode == exit_code
    if exit_code == 75:
        assert "not saved" not in said, said
        return
    assert ("learner-0 exited 1 while stopping, its checkpoint on the way out not confirmed: the steps after "
            "step-00000010, the latest checkpoint, are not saved; with --resume the run goes on from there") in said, said
    assert "CheckpointFailed: the checkpoint at version 13" in said, "the learner's own last words, where readable"

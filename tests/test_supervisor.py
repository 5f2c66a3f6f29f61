"""The local supervisor's own duties, without starting a run's roles."""

from __future__ import annotations

import io
import subprocess
import time

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

"""`computerrl sweep`: variants x seeds as ordinary runs, the same final evaluation for each, a table with
intervals and curves, and a re-run that continues where the sweep stopped."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.exitcodes import EXIT_RESUMABLE
from launch.sweep import Sweep, SweepSpec, label, parse_variants, parse_vary, spec_from_args
from tests.conftest import REPO, whole_checkpoint

BASE = str(REPO / "configs" / "local.yaml")


def test_vary_parses_values_lists_in_brackets_and_refuses_bad_input():
    assert parse_vary(["learner.lr=1e-4,3e-4", "metrics.sinks=[jsonl,tensorboard],[jsonl]"]) == {
        "learner.lr": ["1e-4", "3e-4"], "metrics.sinks": ["[jsonl,tensorboard]", "[jsonl]"]}
    for bad, msg in (("learner.lr", "write key=value1"), ("=1,2", "write key=value1"), ("a=1,1", "listed twice")):
        with pytest.raises(ValueError, match=msg):
            parse_vary([bad])
    with pytest.raises(ValueError, match="names learner.lr twice"):
        parse_vary(["learner.lr=1", "learner.lr=2"])
    spec = SweepSpec(BASE, {"a": ["1", "2"], "b": ["x", "y"]}, 1)
    assert [label(v) for v in spec.variants()] == ["a=1 b=x", "a=1 b=y", "a=2 b=x", "a=2 b=y"]


def test_every_value_is_checked_against_the_config_before_anything_runs():
    with pytest.raises(ValueError, match="expected a number"):
        spec_from_args(BASE, ("learner.lr=1e-4,fast",), 1, (), "", 5)
    spec = spec_from_args(BASE, ("learner.lr=1e-4,3e-4",), 2, ("learner.total_steps=3",), "", 5)
    assert spec.eval_suite == "sim:heldout:sheet_sort,settings_display,files_create_folder,editor_replace"


def test_listed_variants_keep_settings_together_and_cross_the_grid(tmp_path):
    assert parse_variants(["learner.loss.name=reinforce learner.advantage.name=rloo", "learner.loss.name=grpo"]) == [
        {"learner.loss.name": "reinforce", "learner.advantage.name": "rloo"}, {"learner.loss.name": "grpo"}]
    for bad, msg in (("learner.lr", "write key=value"), ("a=1 a=2", "names a twice"), ("", "at least one")):
        with pytest.raises(ValueError, match=msg):
            parse_variants([bad])
    with pytest.raises(ValueError, match="listed twice"):
        parse_variants(["a=1", "a=1"])
    with pytest.raises(ValueError, match="nothing to compare"):
        spec_from_args(BASE, (), 1, (), "", 5, ("learner.loss.name=grpo",))
    with pytest.raises(ValueError, match="set by both"):
        spec_from_args(BASE, ("learner.loss.name=grpo,reinforce",), 1, (), "", 5, ("learner.loss.name=grpo",))
    with pytest.raises(ValueError, match="expected a number"):
        spec_from_args(BASE, (), 1, (), "", 5, ("learner.lr=fast", "learner.lr=1e-4"))
    with pytest.raises(ValueError, match="'group' estimator only"):  # each variant is loaded as a whole
        spec_from_args(BASE, ("learner.advantage.level=trajectory,step",), 1, (), "", 5,
                       ("learner.loss.name=reinforce learner.advantage.name=rloo", "learner.loss.name=grpo"))
    spec = spec_from_args(BASE, ("learner.advantage.std=true,false",), 1, (), "", 5,
                          ("learner.loss.name=reinforce learner.advantage.name=rloo", "learner.loss.name=grpo"))
    assert [label(v) for v in spec.variants()] == [
        "learner.loss.name=reinforce learner.advantage.name=rloo learner.advantage.std=true",
        "learner.loss.name=reinforce learner.advantage.name=rloo learner.advantage.std=false",
        "learner.loss.name=grpo learner.advantage.std=true", "learner.loss.name=grpo learner.advantage.std=false"]
    assert spec.keys() == ["learner.loss.name", "learner.advantage.name", "learner.advantage.std"]
    sweep = Sweep(spec, tmp_path / "sw", echo=lambda s: None)
    for run in sweep.runs:
        _fake_run(run.root, run.seed, 0.5, [(0, 0.1)])
        data = json.loads(run.final_eval.read_text())
        run.final_eval.write_text(json.dumps({**data, "variant": run.variant}))
    sweep.summarise()
    md = (tmp_path / "sw" / "results.md").read_text()
    assert "| `grpo` | - | `false` | 1 | 50.0 % [" in md and "`-`: the config's value" in md
    assert "grpo,,false,1,0.5000" in (tmp_path / "sw" / "results.csv").read_text()
    saved = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    del saved["listed"]  # a sweep directory written before --variant existed continues
    (tmp_path / "sw" / "sweep.json").write_text(json.dumps(saved))
    Sweep(SweepSpec(**saved), tmp_path / "sw")


def _fake_run(root: Path, seed: int, final: float | None, curve: list[tuple[int, float]], total: int = 4,
              latest: int | None = None) -> None:
    (root / "metrics").mkdir(parents=True)
    (root / "config.yaml").write_text(f"learner:\n  total_steps: {total}\n")
    with open(root / "metrics" / "eval.jsonl", "w") as f:
        for step, rate in curve:
            f.write(json.dumps({"step": step, "success_rate": rate}) + "\n")
    if latest is not None:  # a checkpoint as the learner leaves it: the step's directory and the pointer to it
        whole_checkpoint(root / "checkpoints", latest)
    if final is not None:
        (root / "final_eval.json").write_text(json.dumps(
            {"variant": {}, "seed": seed, "success_rate": final, "per_family": {"f1": final, "f2": 1 - final}}))


def test_results_table_intervals_curves_and_what_a_rerun_would_do(tmp_path):
    spec = SweepSpec(BASE, {"learner.lr": ["1e-4", "3e-4"]}, 2, eval_suite="sim:heldout", eval_episodes=5)
    sweep = Sweep(spec, tmp_path / "sw", echo=lambda s: None)
    a0, b0, a1, b1 = sweep.runs  # seed by seed: every variant at seed 0 first
    assert [(r.variant["learner.lr"], r.seed) for r in sweep.runs] == [("1e-4", 0), ("3e-4", 0), ("1e-4", 1),
                                                                       ("3e-4", 1)]
    for run, final, latest in ((a0, 0.2, 4), (a1, 0.4, 4), (b0, None, 4), (b1, None, 2)):
        _fake_run(run.root, run.seed, final, [(0, 0.1), (2, 0.2 + run.seed / 10), (4, 0.3)], latest=latest)
        if final is not None:
            data = json.loads(run.final_eval.read_text())
            run.final_eval.write_text(json.dumps({**data, "variant": run.variant}))
    assert [sweep._state(r) for r in (a0, a1, b0, b1)] == ["done", "done", "evaluate", "resume"]
    # Its latest moved away by hand (or a seed's share copied without it): said, and never started over, which
    # deleted the directory, the whole checkpoints before it included.
    shutil.rmtree(b1.root / "checkpoints" / "step-00000002")
    said: list[str] = []
    sweep.echo = said.append
    assert sweep._state(b1).startswith("damaged: ") and sweep._one(b1) == "failed" and b1.root.is_dir()
    assert "seed 1: " in said[0] and "latest names step-00000002, which is not there" in said[0], said
    (b1.root / "checkpoints" / "latest").unlink()
    assert sweep._state(b1) == "start", "died before its first checkpoint: starts over"

    sweep.summarise()
    rows = sweep.table()
    assert len(rows) == 1 and rows[0]["seeds"] == 2 and rows[0]["success"] == pytest.approx(0.3)
    assert rows[0]["low"] == pytest.approx(0.3 - 12.706 * 0.1414214 / 2 ** 0.5, rel=1e-4)
    md = (tmp_path / "sw" / "results.md").read_text()
    assert "| `1e-4` | 2 | 30.0 % [" in md and "f1" in md and "3e-4" not in md.split("|---")[1]
    csv_lines = (tmp_path / "sw" / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("learner.lr,seeds,success_mean") and csv_lines[1].startswith("1e-4,2,0.3000")
    assert len((tmp_path / "sw" / "results.jsonl").read_text().splitlines()) == 2
    curves = sweep.curves()
    assert [s for s, *_ in curves["learner.lr=1e-4"]] == [0, 2, 4]
    assert curves["learner.lr=1e-4"][1][1] == pytest.approx(0.25)
    assert (tmp_path / "sw" / "curves.png").stat().st_size > 5000
    # the periodic evaluations as a table (every variant with curves, evaluated or not) and as numbers
    periodic = md.split("periodic evaluations")[1]
    assert "| variant | step 0 | step 2 | step 4 |" in periodic
    assert "| `learner.lr=1e-4` | 10.0 [10.0, 10.0] | 25.0 [" in periodic and "| `learner.lr=3e-4` |" in periodic
    rows_csv = list(csv.DictReader(open(tmp_path / "sw" / "curves.csv")))
    held = [r for r in rows_csv if r["variant"] == "learner.lr=1e-4" and r["series"] == "heldout_success"]
    assert [(int(r["step"]), float(r["mean"])) for r in held] == [(0, 0.1), (2, 0.25), (4, 0.3)]

    with pytest.raises(ValueError, match="holds another sweep"):
        Sweep(SweepSpec(BASE, {"learner.lr": ["1e-3"]}, 2, eval_suite="sim:heldout"), tmp_path / "sw")
    with pytest.raises(ValueError, match="may only widen its seeds"):
        Sweep(SweepSpec(BASE, {"learner.lr": ["1e-4", "3e-4"]}, 1, eval_suite="sim:heldout", eval_episodes=5),
              tmp_path / "sw")
    grown = Sweep(SweepSpec(BASE, {"learner.lr": ["1e-4", "3e-4"]}, 3, eval_suite="sim:heldout", eval_episodes=5),
                  tmp_path / "sw", echo=lambda s: None)
    assert [grown._state(r) for r in grown.runs] == ["done", "evaluate", "done", "start", "start", "start"]
    assert json.loads((tmp_path / "sw" / "sweep.json").read_text())["seeds"] == 3
    assert grown.table()[0]["seeds"] == 2, "the seeds already evaluated are kept"
    with pytest.raises(ValueError, match="holds another sweep"):
        Sweep(SweepSpec(BASE, {"learner.lr": ["1e-4", "3e-4"]}, 3, eval_suite="sim:heldout", eval_episodes=5,
                        first_seed=3), tmp_path / "sw")


def test_first_seed_runs_another_share_of_the_seeds(tmp_path):
    spec = SweepSpec(BASE, {"learner.lr": ["1e-4"]}, 2, eval_suite="sim:heldout", eval_episodes=5, first_seed=3)
    sweep = Sweep(spec, tmp_path / "sw", echo=lambda s: None)
    assert [(r.seed, r.root.name) for r in sweep.runs] == [(3, "seed-3"), (4, "seed-4")]
    for run, final in zip(sweep.runs, (0.2, 0.4)):
        _fake_run(run.root, run.seed, final, [(0, 0.1), (4, final)], latest=4)
        run.final_eval.write_text(json.dumps({**json.loads(run.final_eval.read_text()), "variant": run.variant}))
    sweep.summarise()
    assert sweep.table()[0]["seeds"] == 2
    assert "2 seed(s) from seed 3 per variant" in (tmp_path / "sw" / "results.md").read_text()
    resumed = Sweep(spec, tmp_path / "sw", echo=lambda s: None)
    assert [resumed._state(r) for r in resumed.runs] == ["done", "done"]
    # Another share (seeds 0-2, elsewhere) combined into this one: its run folders copied in, the range widened.
    other = Sweep(SweepSpec(BASE, {"learner.lr": ["1e-4"]}, 3, eval_suite="sim:heldout", eval_episodes=5),
                  tmp_path / "other", echo=lambda s: None)
    for run, final in zip(other.runs, (0.1, 0.3, 0.5)):
        _fake_run(run.root, run.seed, final, [(0, 0.1), (4, final)], latest=4)
        run.final_eval.write_text(json.dumps({**json.loads(run.final_eval.read_text()), "variant": run.variant}))
        shutil.copytree(run.root, tmp_path / "sw" / run.root.relative_to(other.out))
    whole = Sweep(SweepSpec(BASE, {"learner.lr": ["1e-4"]}, 5, eval_suite="sim:heldout", eval_episodes=5),
                  tmp_path / "sw", echo=lambda s: None)
    assert [(r.seed, whole._state(r)) for r in whole.runs] == [(s, "done") for s in range(5)]
    whole.summarise()
    assert whole.table()[0]["seeds"] == 5 and whole.table()[0]["success"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="may only widen its seeds"):
        Sweep(SweepSpec(BASE, {"learner.lr": ["1e-4"]}, 2, eval_suite="sim:heldout", eval_episodes=5, first_seed=3),
              tmp_path / "sw")
    with pytest.raises(ValueError, match="--first-seed"):
        Sweep(SweepSpec(BASE, {"learner.lr": ["1e-4"]}, 2, eval_suite="sim:heldout", first_seed=-1), tmp_path / "x")


def test_a_run_stopped_part_way_does_not_cut_its_variants_curves(tmp_path):
    spec = SweepSpec(BASE, {"learner.lr": ["1e-4", "3e-4"]}, 2, eval_suite="sim:heldout", eval_episodes=5)
    sweep = Sweep(spec, tmp_path / "sw", echo=lambda s: None)
    a0, b0, a1, b1 = sweep.runs
    _fake_run(a0.root, 0, 0.5, [(0, 0.1), (20, 0.4), (40, 0.5)])
    _fake_run(a1.root, 1, None, [(0, 0.1)])  # stopped after its first evaluation
    _fake_run(b0.root, 0, None, [(0, 0.1), (20, 0.2)])  # both still going: drawn as they are
    _fake_run(b1.root, 1, None, [(0, 0.3), (20, 0.4), (40, 0.6)])
    assert sweep.curve_runs(a0.variant) == [a0] and sweep.curve_runs(b0.variant) == [b0, b1]
    curves = sweep.curves()
    assert [st for st, *_ in curves["learner.lr=1e-4"]] == [0, 20, 40]
    assert [(st, m) for st, m, *_ in curves["learner.lr=3e-4"]] == [(0, pytest.approx(0.2)), (20, pytest.approx(0.3))]


def test_training_curves_smooth_rl_steps_across_seeds_and_keep_each_seeds_sft_phases(tmp_path):
    spec = SweepSpec(BASE, {"learner.entropulse.mode": ["off", "adaptive"]}, 2, eval_suite="sim:heldout")
    sweep = Sweep(spec, tmp_path / "sw", echo=lambda s: None)
    off0, on0, off1, on1 = sweep.runs
    for run in sweep.runs:
        _fake_run(run.root, run.seed, None, [(0, 0.1), (6, 0.3)])

    def learner_log(run, phases, entropy):
        with open(run.root / "metrics" / "learner.jsonl", "w") as f:
            for step, (phase, h) in enumerate(zip(phases, entropy), start=1):
                rec = {"step": step, "phase": phase, "entropy": h}
                if phase == "rl":
                    rec["success_rate"] = step / 10
                f.write(json.dumps(rec) + "\n")
    learner_log(off0, ["rl"] * 6, [0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    learner_log(off1, ["rl"] * 6, [0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    learner_log(on0, ["rl", "rl", "sft", "sft", "rl", "rl"], [0.6, 0.5, 9.0, 9.0, 0.4, 0.3])
    learner_log(on1, ["rl", "sft", "rl", "rl", "rl", "rl"], [0.6, 9.0, 0.5, 0.4, 0.3, 0.2])
    curves = sweep.training_curves(window=2)
    off = dict((st, mean) for st, mean, _, _ in curves["learner.entropulse.mode=off"]["entropy"])
    assert off[1] == pytest.approx(0.7) and off[6] == pytest.approx(0.25)  # (0.6 + 0.8) / 2; (0.15 + 0.35) / 2
    on = curves["learner.entropulse.mode=adaptive"]["entropy"]
    assert [st for st, *_ in on] == [1, 5, 6], "RL steps every seed logged; an SFT step's entropy is not drawn"
    assert on[1][1] == pytest.approx((0.45 + 0.35) / 2)  # trailing means over each seed's own RL steps
    success = dict((st, mean) for st, mean, _, _ in curves["learner.entropulse.mode=off"]["success_rate"])
    assert success[6] == pytest.approx(0.55)
    assert sweep.sft_spans() == {"learner.entropulse.mode=off": [],
                                 "learner.entropulse.mode=adaptive": [(2, 4), (1, 2)]}
    assert sweep.plot() and (tmp_path / "sw" / "curves.png").stat().st_size > 5000
    sweep.write_curves(sweep.curves(), sweep.training_curves())
    rows = list(csv.DictReader(open(tmp_path / "sw" / "curves.csv")))
    ent = [(int(r["step"]), float(r["mean"])) for r in rows
           if r["variant"] == "learner.entropulse.mode=adaptive" and r["series"] == "entropy"]
    smoothed = sweep.training_curves()["learner.entropulse.mode=adaptive"]["entropy"]  # the plot's 5-step means
    assert ent == [(st, pytest.approx(m, abs=1e-5)) for st, m, _, _ in smoothed] and [st for st, _ in ent] == [1, 5, 6]


def _sweep(out: Path, *extra: str) -> subprocess.Popen:
    # The sweep's machinery is the point, not the recipe: no anchor, no evaluation of the starting policy, steps of
    # two groups of 4 from one actor (each trained: the learning rates under comparison act).
    args = [sys.executable, "-m", "launch.cli", "sweep", "configs/local.yaml", "learner.checkpoint_every=1",
            "local.eval_episodes=1", "local.eval_suite=sim:heldout:files_delete", "weights.join_window_s=0.5",
            "learner.anchor.suite=", "local.eval_start=false", "broker.group_size=4", "broker.groups_per_batch=2",
            "learner.advantage.drop_zero_variance=false", "local.actors=1",
            "--eval-suite", "sim:heldout:files_delete", "--eval-episodes", "2", "--out", str(out), *extra]
    return subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.slow
def test_a_tiny_sweep_runs_evaluates_summarises_and_continues_after_an_interrupt(tmp_path):
    out = tmp_path / "sweep"
    # One periodic evaluation per run (at its last step) is enough for the curves: each is a process of its own.
    p = _sweep(out, "learner.total_steps=2", "learner.checkpoint_every=2", "--vary", "learner.lr=1e-4,3e-4",
               "--seeds", "1", "--parallel", "2")
    text, _ = p.communicate(timeout=900)
    assert p.returncode == 0, text[-3000:]
    finals = sorted(out.glob("runs/*/seed-0/final_eval.json"))
    assert len(finals) == 2 and all(json.loads(f.read_text())["episodes"] == 2 for f in finals)
    md = (out / "results.md").read_text()
    assert "| `1e-4` | 1 |" in md and "| `3e-4` | 1 |" in md and "files_delete" in md
    assert (out / "curves.png").exists()

    # A longer sweep, interrupted once its run has a checkpoint: the same command resumes it and finishes.
    out2 = tmp_path / "sweep2"
    # No periodic evaluation here (the first sweep had them): a checkpoint every step made one run all along.
    # 4 steps: interrupted at step 2 or 3 (a step takes 1.5–2 s here; the interrupt follows within half a second)
    args = ("learner.total_steps=4", "local.eval_episodes=0", "--vary", "learner.lr=1e-4", "--seeds", "1")
    p = _sweep(out2, *args)
    latest = out2 / "runs" / "learner.lr=1e-4" / "seed-0" / "checkpoints" / "latest"
    deadline = time.monotonic() + 600
    while not (latest.exists() and latest.read_text().strip() >= "step-00000002"):
        assert time.monotonic() < deadline and p.poll() is None, "no checkpoint to interrupt after"
        time.sleep(0.5)
    os.killpg(p.pid, signal.SIGINT)
    text, _ = p.communicate(timeout=600)
    assert p.returncode == EXIT_RESUMABLE and "run the same command again to continue" in text, text[-3000:]
    step_at_stop = int(latest.read_text().rsplit("-", 1)[1])
    assert 2 <= step_at_stop < 4
    p = _sweep(out2, *args)
    text, _ = p.communicate(timeout=900)
    assert p.returncode == 0 and "[sweep] resume learner.lr=1e-4 seed 0" in text, text[-3000:]
    learner = latest.parent.parent / "metrics" / "learner.jsonl"
    steps = [json.loads(x)["step"] for x in learner.read_text().splitlines()]
    assert steps[-1] == 4 and set(steps) == set(range(1, 5)), steps
    assert json.loads((latest.parent.parent / "final_eval.json").read_text())["episodes"] == 2
    p = _sweep(out2, *args)  # everything done: nothing runs again
    text, _ = p.communicate(timeout=300)
    assert p.returncode == 0 and "1 already done" in text and "[sweep] resume" not in text


def test_a_stop_signal_whose_handler_lands_while_the_lock_is_held_stops_every_run_and_does_not_hang(tmp_path):
    """The sweep's handler took the runs' lock: a second signal landing while the first's handler held it (two TERMs
    at once, as a preemption without grace time sends) waited for itself forever. Now it takes no lock, and a run
    registered after the handler copied the runs stops too."""
    import threading

    sweep = Sweep(SweepSpec(BASE, {"learner.lr": ["1e-4"]}, 1, eval_suite="sim:heldout"), tmp_path / "sw",
                  echo=lambda s: None)
    running = subprocess.Popen(["sleep", "60"], start_new_session=True)
    sweep.procs.add(running)
    done = threading.Event()

    def nested() -> None:  # as the handler interrupted by a second signal while holding the lock
        with sweep.lock:
            sweep._on_signal(signal.SIGTERM, None)
        done.set()
    threading.Thread(target=nested, daemon=True).start()
    assert done.wait(5), "the handler waited for the lock its own thread held"
    assert running.wait(5) == -signal.SIGTERM and sweep.interrupted
    late = tmp_path / "late.log"
    t0 = time.monotonic()
    assert sweep._call(["sleep", "60"], late).returncode == -signal.SIGTERM, "a run started after the signal stops"
    assert time.monotonic() - t0 < 5


def test_a_second_sweep_of_a_running_sweeps_directory_is_refused_before_it_touches_a_run(tmp_path):
    """A second `computerrl sweep` of one directory took a run still going before its first checkpoint for one that had
    died there (``_state`` "start") and deleted its directory to start it afresh."""
    out = tmp_path / "sw"
    going = out / "runs" / "x" / "seed-0"
    going.mkdir(parents=True)
    (going / "sweep-run.log").write_text("the first sweep's run, before its first checkpoint\n")
    code = ("import sys; from common import claims; claims.claim(sys.argv[1], 'sweep'); print('held', flush=True); "
            "sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        spec = SweepSpec(BASE, {"learner.lr": ["1e-4"]}, 1, eval_suite="sim:heldout", eval_episodes=5)
        with pytest.raises(ValueError, match=rf"{out}: sweep is held by another process: pid "
                                             rf"{holder.pid} .*this sweep is running"):
            Sweep(spec, out, echo=lambda s: None)
        assert (going / "sweep-run.log").exists() and not (out / "sweep.json").exists()
    finally:
        holder.kill()
        holder.wait()
    Sweep(spec, out, echo=lambda s: None)  # its holder gone, the directory is free

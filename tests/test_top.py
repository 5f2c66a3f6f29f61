"""`computerrl top RUN_DIR`: the live view from a run directory's records alone (as from another node)."""

from __future__ import annotations

import json
import time

from click.testing import CliRunner

from launch.cli import main


def test_top_shows_a_run_from_its_records_and_which_roles_went_quiet(tmp_path, monkeypatch):
    now = time.time()
    m = tmp_path / "metrics"
    m.mkdir()
    # a loss by import path this process cannot import (a plug-in on the run's nodes only): not needed to watch it
    (tmp_path / "config.yaml").write_text("learner:\n  total_steps: 10\n  loss:\n    name: not_here:a_loss\n")
    records = {
        "learner": [{"time": now - 120, "step": 1, "success_rate": 0.25, "entropy": 0.5, "loss": 0.1},
                    {"time": now - 30, "step": 4, "success_rate": 0.5, "entropy": 0.4, "loss": 0.05}],
        "broker": [{"time": now, "queue_depth": 3, "running": 2}],
        "env_server-0": [{"time": now - 2, "desktops": 8, "sessions": 8, "steps_per_s": 4.0,
                          "counters": {"resets": 30, "steps": 90, "backend_errors": 1}}],
        "actor-0": [{"time": now - 100, "gen_tokens_per_s": 50.0, "counters": {"episodes": 12}}],
    }
    for name, recs in records.items():
        (m / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = CliRunner().invoke(main, ["top", str(tmp_path), "--once"])
    assert out.exit_code == 0, out.output
    assert "step 4/10" in out.output and "elapsed 2.0 min" in out.output and "ETA 3.0 min" in out.output
    assert "success 0.50" in out.output and "broker queue 3" in out.output
    assert "desktops 8 (started 0)  resets 30 (0.25/s)  steps 90 (0.75/s)  failures 1" in out.output
    # the actor wrote nothing for 100 s (3 intervals of 5 s): down; the learner, 30 s after a step: still up
    assert "roles actor-0(down) broker-0 env_server-0 learner-0\n" in out.output
    assert "set aside" not in out.output, "nothing crashed: no line for it"
    with open(m / "learner.jsonl", "a") as f:
        f.write(json.dumps({"time": now, "step": 5, "counters": {"groups_dropped_step_crashed": 1}}) + "\n")
    out = CliRunner().invoke(main, ["top", str(tmp_path), "--once"])
    assert "set aside after crashes: 1 groups (in quarantine/: computerrl replay-step), 0 tasks" in out.output
    assert "CHECKPOINTS FAILED" not in out.output
    with open(m / "learner.jsonl", "a") as f:
        f.write(json.dumps({"time": now, "step": 6, "counters": {"checkpoints_failed": 2}}) + "\n")
    out = CliRunner().invoke(main, ["top", str(tmp_path), "--once"])
    assert "CHECKPOINTS FAILED: 2 (learner log: checkpoint_failed; a full disk?)" in out.output, out.output
    assert "SPILL LOG DAMAGED" not in out.output
    with open(m / "broker.jsonl", "a") as f:
        f.write(json.dumps({"time": now, "spill_records_damaged": 1, "groups_unreadable": 2}) + "\n")
    out = CliRunner().invoke(main, ["top", str(tmp_path), "--once"])
    assert "SPILL LOG DAMAGED: 3 records unreadable" in out.output, out.output
    assert "DISK NEARLY FULL" not in out.output
    (tmp_path / "checkpoints" / "step-00000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000004" / "model.safetensors").write_bytes(b"w" * (3 << 20))
    (tmp_path / "checkpoints" / "latest").write_text("step-00000004")
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, (1 << 30) - (5 << 20),
                                                                                 5 << 20))
    out = CliRunner().invoke(main, ["top", str(tmp_path), "--once"])
    assert "DISK NEARLY FULL: 5 MiB free where the run directory is (a checkpoint takes 3.0 MiB)" in out.output, \
        out.output
    (tmp_path / "checkpoints" / "latest").unlink()  # before the first checkpoint its size is not known, not 0
    out = CliRunner().invoke(main, ["top", str(tmp_path), "--once"])
    assert "DISK NEARLY FULL: 5 MiB free where the run directory is (no checkpoint written yet)" in out.output, \
        out.output

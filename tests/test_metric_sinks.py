"""Metric records forwarded to TensorBoard event files and W&B (offline), read back, each record once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from common.metrics.sinks import MetricsConfig, MetricsForwarder, scalars


def _append(path: Path, *records: dict, torn: str = "") -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(torn)


def _events(root: Path, source: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(root / "tensorboard" / source))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_numeric_fields_become_scalars_nested_ones_joined():
    rec = {"time": 1.0, "loss": 0.5, "ok": True, "phase": "rl", "nan": float("nan"), "counters": {"steps": 3},
           "hist": [1, 2]}
    assert dict(scalars(rec)) == {"loss": 0.5, "ok": 1.0, "counters/steps": 3.0}, "time is the record's clock"


def test_tensorboard_gets_every_record_once_at_its_policy_version(tmp_path):
    pytest.importorskip("tensorboard")
    m = tmp_path / "metrics"
    m.mkdir()
    _append(m / "learner.jsonl", {"time": 10.0, "step": 1, "loss": 0.5}, {"time": 20.0, "step": 2, "loss": 0.25})
    _append(m / "actor-0.jsonl", {"time": 11.0, "rank": 0, "version": 1, "counters": {"episodes": 8}},
            torn='{"time": 21.0, "version": 2, "coun')  # still being written: waits for the next poll
    _append(m / "env_server-0.jsonl", {"time": 15.0, "steps_per_s": 12.5}, {"time": 25.0, "steps_per_s": 13.0})
    cfg = MetricsConfig(sinks=["jsonl", "tensorboard"])
    fwd = MetricsForwarder(m, tmp_path, cfg, "run-a")
    assert fwd.poll() == 5
    fwd.close()

    assert _events(tmp_path, "learner")["loss"] == [(1, 0.5), (2, 0.25)]
    assert _events(tmp_path, "actor-0") == {"version": [(1, 1.0)], "counters/episodes": [(1, 8.0)]}
    # No version of its own: the learner's newest step before it (records go in time order across files).
    assert _events(tmp_path, "env_server-0")["steps_per_s"] == [(1, 12.5), (2, 13.0)]

    # A second forwarder (a resumed run, or `computerrl metrics`) sends only what is new: the finished line.
    with open(m / "actor-0.jsonl", "a") as f:
        f.write('ters": {"episodes": 16}}\n')
    _append(m / "eval.jsonl", {"time": 30.0, "step": 2, "success_rate": 0.4, "ci95": [0.2, 0.6]})
    fwd = MetricsForwarder(m, tmp_path, cfg, "run-a")
    assert fwd.poll() == 2 and fwd.poll() == 0
    fwd.close()
    assert _events(tmp_path, "actor-0")["counters/episodes"] == [(1, 8.0), (2, 16.0)]
    assert _events(tmp_path, "eval")["success_rate"] == [(2, pytest.approx(0.4))]
    assert _events(tmp_path, "learner")["loss"] == [(1, 0.5), (2, 0.25)], "nothing sent twice"


def test_wandb_offline_run_is_one_per_run_id_across_resumes_with_each_evaluations_table(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    m = tmp_path / "metrics"
    m.mkdir()
    cfg = MetricsConfig(sinks=["wandb"], wandb_mode="offline")
    (tmp_path / "episodes").mkdir()
    _append(tmp_path / "episodes" / "eval.jsonl",  # an evaluation's episodes: a table
            {"v": 1, "id": "ep0", "source": "eval", "eval_version": 1, "family": "files_move", "success": True,
             "reward": 1.0, "steps": 1, "finish": "done", "instruction": "Move it", "turns": [{"text": "done()"}]})
    for step in (1, 2):  # two supervisor lifetimes: the run started, then resumed
        if step == 2:  # W&B names an offline run's folder by the second it started: real resumes are seconds apart
            time.sleep(1.05 - time.time() % 1.0)
        _append(m / "learner.jsonl", {"time": float(step), "step": step, "loss": 1.0 / step})
        fwd = MetricsForwarder(m, tmp_path, cfg, "run-b", {"learner": {"lr": 1e-4}})
        assert fwd.poll() == 1
        assert fwd.sinks[0].run.id == "run-b"
        fwd.close()
    runs = sorted((tmp_path / "wandb" / "wandb").glob("offline-run-*-run-b"))
    assert len(runs) == 2 and all((r / "run-run-b.wandb").stat().st_size > 0 for r in runs)
    tables = list((tmp_path / "wandb" / "wandb").glob("offline-run-*-run-b/files/media/table/eval/episodes_*.table.json"))
    assert len(tables) == 1, "the evaluation's table, once across the resume"
    table = json.loads(tables[0].read_text())
    assert table["columns"][:3] == ["episode", "family", "success"] and table["data"][0][:3] == ["ep0", "files_move", True]
    del wandb


def test_bad_sink_settings_fail_at_config_load():
    with pytest.raises(ValueError, match=r"unknown sink\(s\) \['prometheus'\]"):
        MetricsConfig(sinks=["prometheus"]).validate()
    with pytest.raises(ValueError, match="wandb_mode must be offline or online"):
        MetricsConfig(wandb_mode="cloud").validate()


def test_each_evaluation_sends_a_table_of_its_episodes_once(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m, e = tmp_path / "metrics", tmp_path / "episodes"
    m.mkdir()
    e.mkdir()

    def episode(i: int, version: int) -> dict:
        return {"v": 1, "id": f"ep{i}", "source": "eval", "eval_version": version, "family": "files_move",
                "success": i % 2 == 0, "reward": float(i % 2 == 0), "steps": 2, "finish": "done",
                "instruction": "Move a|b", "turns": [{"text": "click(1)"}, {"text": "done()"}]}
    _append(e / "eval.jsonl", episode(0, 4), episode(1, 4), episode(2, 8), torn='{"v": 1, "id": "ep3"')
    cfg = MetricsConfig(sinks=["jsonl", "tensorboard"])
    fwd = MetricsForwarder(m, tmp_path, cfg, "run-a")
    fwd.poll()
    fwd.close()
    fwd = MetricsForwarder(m, tmp_path, cfg, "run-a")  # a resumed run sends none of them again
    fwd.poll()
    fwd.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "eval"))
    acc.Reload()
    texts = acc.Tensors("episodes/text_summary")
    assert [t.step for t in texts] == [4, 8]
    table = texts[0].tensor_proto.string_val[0].decode()
    assert "| ep0 | files_move | True | 1.0 | 2 | done | Move a\\|b | done() |" in table and "ep1" in table


def test_forwarding_into_a_run_directory_that_cannot_take_it_says_so(tmp_path):
    """Found on a read-only copy of a run (2026-12-03): `computerrl metrics RUN --sinks tensorboard` ended in a
    traceback from os.makedirs. Here the run directory's tensorboard/ is taken by a file."""
    pytest.importorskip("tensorboard")
    from click.testing import CliRunner

    from launch.cli import main

    (tmp_path / "metrics").mkdir()
    _append(tmp_path / "metrics" / "learner.jsonl", {"time": 10.0, "step": 1, "loss": 0.5})
    (tmp_path / "tensorboard").write_text("not a folder")
    out = CliRunner().invoke(main, ["metrics", str(tmp_path), "--sinks", "tensorboard"])
    assert out.exit_code == 1 and "cannot write" in out.output and str(tmp_path / "tensorboard") in out.output, \
        out.output
    assert out.exception is None or isinstance(out.exception, SystemExit), out.exception

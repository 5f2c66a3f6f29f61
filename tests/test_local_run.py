"""`computerrl run` end to end with a tiny budget: every role a real process on loopback."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.exitcodes import EXIT_RESUMABLE
from launch.local import free_port_overrides
from tests.conftest import REPO, children_of_run

pytestmark = pytest.mark.slow
pytest.importorskip("torch")


def _run(run_dir: Path, *overrides: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "launch.cli", "run", "configs/local.yaml", *free_port_overrides(),
            "weights.join_window_s=0.5", *overrides, "--run-dir", str(run_dir)]
    return subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def recipe_run(config: str, run_dir: Path, *overrides: str, env: dict | None = None, timeout: int = 1500,
               policy: str = "base-policy") -> dict:
    """``computerrl run CONFIG`` for two learner steps from a shipped policy (``configs/<policy>``; a recipe's own
    base, where it has none shipped, is made by ``computerrl pretrain``, too slow for a test), with its final
    evaluation (one episode per family); then ``computerrl eval`` of the last checkpoint on the recipe's held-out
    suite. Returns that eval's result."""
    import yaml

    from env_server.backend_registry import registry_for

    args = [sys.executable, "-m", "launch.cli", "run", config, *free_port_overrides(),
            f"model.path={REPO / 'configs' / policy}",
            "learner.total_steps=2", "learner.checkpoint_every=2", "broker.groups_per_batch=2", "broker.group_size=2",
            "local.actors=1",  # the recipe's tasks and evaluation are the point: one actor plays them
            # the sim-trained base policy fails the recipe's tasks alike: dropping such groups would leave no batch
            "broker.dynamic_sampling=false",
            "weights.join_window_s=0.5", "local.eval_episodes=1", "local.eval_start=false", *overrides,
            "--run-dir", str(run_dir)]
    env = env or {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0 and "outcome: finished" in p.stdout, (p.stdout + p.stderr)[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    log = [json.loads(x) for x in (run_dir / "logs" / "learner-0.jsonl").read_text().splitlines()]
    sent = [e["version"] for e in log if e["event"] == "weights_broadcast"]
    assert sent and max(sent) < 2, f"the last step's weights are checkpointed, not broadcast: {sent}"
    assert not [e for e in log if e["event"] == "weights_round_failed"]
    served = [json.loads(x) for x in (run_dir / "metrics" / "env_server-0.jsonl").read_text().splitlines()][-1]
    assert served["counters"]["resets"] > 0 and served["counters"].get("backend_errors", 0) == 0, served
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    suite = resolved["local"]["eval_suite"]
    families = set(registry_for(suite, resolved["env_server"]["backend"]).parse_suite(suite)[1])
    evals = [json.loads(x) for x in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["step"] == 2 and set(evals[-1]["per_family"]) == families
    ev = subprocess.run([sys.executable, "-m", "launch.cli", "eval", "--checkpoint", str(run_dir / "checkpoints"),
                         "--suite", suite, "--episodes", "1", "--json"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert ev.returncode == 0, ev.stderr[-2000:]
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert result["episodes"] == len(families) and set(result["per_family"]) == families
    return result


def _wait_until(p: subprocess.Popen, cond, deadline: float, what: str) -> None:
    """Poll ``cond`` while the run is alive; fail with ``what`` past ``deadline`` (monotonic)."""
    while not cond():
        assert time.monotonic() < deadline and p.poll() is None, what
        time.sleep(0.2)


def _eval(run_dir: Path, suite: str, episodes: int) -> dict:
    """`computerrl eval --json` of a run's newest checkpoint."""
    ev = subprocess.run([sys.executable, "-m", "launch.cli", "eval", "--checkpoint", str(run_dir / "checkpoints"),
                         "--suite", suite, "--episodes", str(episodes), "--json"],
                        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                        timeout=300)
    assert ev.returncode == 0, ev.stderr[-2000:]
    return json.loads(ev.stdout.strip().splitlines()[-1])


def test_run_trains_checkpoints_and_leaves_no_process(tmp_path):
    run_dir = tmp_path / "run"
    p = _run(run_dir, "learner.total_steps=2", "learner.checkpoint_every=1", "local.eval_episodes=1",
             "local.eval_suite=sim:heldout:files_delete", "metrics.sinks=[jsonl,tensorboard]")
    out, _ = p.communicate(timeout=1500)
    assert p.returncode == 0, out[-3000:]
    assert "outcome: finished" in out
    final = [line for line in out.splitlines() if "  resets " in line][-1]  # the final view
    m = re.search(r"desktops (\d+) \(started (\d+)\)  resets (\d+) \([\d.]+/s\)  steps (\d+) \([\d.]+/s\)  "
                  r"failures 0", final)
    assert m and int(m[3]) >= 16 and int(m[4]) >= int(m[3]), final
    recs = [json.loads(x) for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2], "versions advance one per step"
    assert all(r["anchor_tokens"] > 0 for r in recs), "the recipe's anchor replays demos in every RL step"
    # Step 1 starts at the reference policy (KL 0); once the policy has moved, the anchor term is positive.
    assert all(r["anchor_loss"] > 0 for r in recs[1:]), [r["anchor_loss"] for r in recs]
    broker = [json.loads(x) for x in (run_dir / "metrics" / "broker.jsonl").read_text().splitlines()]
    assert max(b.get("groups_accepted", 0) for b in broker) >= 4, "groups flowed from the actors"
    hist = broker[-1]["lag_hist"]
    import yaml

    eta = yaml.safe_load((run_dir / "config.yaml").read_text())["broker"]["eta"]
    assert sum(v for k, v in hist.items() if k not in ("16+",) and int(k) > eta) == 0 and hist["16+"] == 0
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000002"
    assert (run_dir / "checkpoints" / "step-00000001").is_dir(), "the periodic checkpoint, then the final one"
    assert not children_of_run(run_dir), "no role outlived the run"
    # An engine thread left inside torch at interpreter exit aborted the actors at every run's end (exit -6, a
    # restart, "terminate called without an active exception" in their stderr).
    assert "exited with code" not in out, out[-3000:]
    for err in (run_dir / "logs").glob("*.stderr"):
        assert "terminate called" not in err.read_text(errors="replace"), err
    evals = [json.loads(x) for x in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert evals and evals[-1]["step"] == 2 and evals[-1]["per_family"].keys() == {"files_delete"}
    assert evals[0]["step"] == 0 and evals[0]["checkpoint"].endswith("base-policy"), "the curve starts at the base"
    assert (run_dir / "learning_curve.png").stat().st_size > 1000
    from tests.test_prometheus import dashboard_metrics, exposed_metrics
    missing = dashboard_metrics() - exposed_metrics(run_dir / "metrics")
    assert not missing, f"the Grafana dashboard queries series no role exposes: {sorted(missing)}"
    from tests.test_metric_sinks import _events
    assert [step for step, _ in _events(run_dir, "learner")["loss"]] == [1, 2], "TensorBoard has the run"
    # Step 1's evaluation is skipped when step 0's is still running as step 2's checkpoint lands (the newest wins).
    assert [e["step"] for e in evals] in ([0, 1, 2], [0, 2]), evals
    assert [step for step, _ in _events(run_dir, "eval")["success_rate"]] == [e["step"] for e in evals]
    result = _eval(run_dir, "sim:heldout:files_rename,sheet_sum", 2)
    assert result["episodes"] == 4 and set(result["per_family"]) == {"files_rename", "sheet_sum"}
    assert 0.0 <= result["success_rate"] <= 1.0
    assert result["ci95"][0] <= result["success_rate"] <= result["ci95"][1]
    assert set(result["per_family_ci95"]) == set(result["per_family"])


def test_a_server_that_dies_before_it_is_ready_is_named_with_its_reason(tmp_path):
    """A server that cannot bind (two test suites on one machine once picked the same free port) killed the
    env_server at start; the run said only "the process exited before it became ready". It now says which role,
    and why. (A port already listened on is refused before the run starts, `tests/test_config.py`; an address
    this machine does not have fails the same way at the server's own bind.)"""
    p = _run(tmp_path / "run", "env_server.host=192.0.2.1", "learner.anchor.suite=")  # TEST-NET-1: nobody's
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 1, out[-2000:]
    assert "env_server-0: the process exited before it became ready" in out, out
    assert "Cannot assign requested address" in out, out
    assert not children_of_run(tmp_path / "run")


def test_two_learner_ranks_train_checkpoint_and_stop_on_sigint(tmp_path):
    """FSDP2 over two gloo ranks inside `computerrl run`: real updates (zero-variance groups kept, so every
    step trains and broadcasts gathered weights), a checkpoint on SIGINT, both ranks gone afterwards."""
    run_dir = tmp_path / "run"
    p = _run(run_dir, "local.learner_ranks=2", "local.actors=1",
             "learner.total_steps=1000", "learner.checkpoint_every=0", "learner.advantage.drop_zero_variance=false",
             "local.eval_episodes=0", "learner.anchor.suite=", "broker.group_size=4",
             "broker.groups_per_batch=2")  # FSDP is the point
    try:
        metrics = run_dir / "metrics" / "learner.jsonl"

        def trained() -> list[dict]:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            return [r for r in map(json.loads, lines) if not r.get("empty")]
        _wait_until(p, lambda: len(trained()) >= 3, time.monotonic() + 600, "no training steps")
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == EXIT_RESUMABLE, out[-3000:]
    steps = trained()
    assert len(steps) >= 3 and all(r["tokens"] > 0 for r in steps)
    rounds = [json.loads(x) for x in (run_dir / "logs" / "learner-0.jsonl").read_text().splitlines()
              if '"weights_broadcast"' in x]
    assert any(r["version"] >= 2 and r["receivers"] == 1 for r in rounds), "gathered weights reached the actor"
    latest = (run_dir / "checkpoints" / "latest").read_text()
    assert int(latest.split("-")[1]) >= 3, "rank 0 checkpointed with rank 1 on SIGINT"
    assert (run_dir / "logs" / "learner-1.jsonl").exists()
    assert not children_of_run(run_dir)


def test_a_pretrained_chat_checkpoint_trains_through_its_own_template(tmp_path):
    """`model.path` at a chat model (tiny, built here: BPE tokenizer, ChatML template, generation_config end ids):
    actors prompt it through its template, the learner trains on those ids and scores the sampled tokens as the
    engine did, weights go back, checkpoints carry the tokenizer, and eval reads them."""
    from common import demofile
    from launch.tiny_checkpoints import chat_checkpoint

    chat = chat_checkpoint(tmp_path / "chat", corpus_episodes=30)
    run_dir = tmp_path / "run"
    p = _run(run_dir, f"model.path={chat}", "model.tokenizer=auto", "learner.total_steps=2", "broker.groups_per_batch=2",
             "learner.checkpoint_every=0", "learner.advantage.drop_zero_variance=false", "local.eval_episodes=0",
             "broker.tasks.suite=sim:train:files_delete", "learner.anchor.demos=50")
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    same = [r for r in recs if r.get("mismatch_tokens")]
    assert same and max(r["mismatch_abs_max"] for r in same) < 1e-4, "learner and engine score tokens alike"
    actor = [json.loads(x) for x in (run_dir / "metrics" / "actor-0.jsonl").read_text().splitlines()]
    assert actor[-1]["counters"]["weight_updates"] >= 1, "trained weights reached the actor"
    ck = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
    assert (ck / "tokenizer.json").exists() and (ck / "chat_template.jinja").exists()
    start = (chat / "chat_template.jinja").read_text()
    assert (ck / "chat_template.jinja").read_text() == start
    from common.rundir import RunDir
    from policy.tokenizer import load_tokenizer
    from launch.config import load_run_config

    settings = demofile.run_demo_sets(load_run_config(run_dir / "config.yaml"))["anchor"]
    demos = demofile.load(RunDir(run_dir).demos("anchor"), settings)
    tok = load_tokenizer("auto", str(chat), str(chat))
    assert demos
    for d in demos[:3]:
        assert tok.tok.decode(d.turn(0).prompt_ids.tolist()).startswith("<|im_start|>"), "anchor demos use the template"
    assert _eval(run_dir, "sim:heldout:files_delete", 2)["episodes"] == 2


def test_a_vision_language_checkpoint_trains_on_screenshots(tmp_path):
    """`model.path` at a VLM (tiny Qwen2-VL built here): actors show it screenshots only, the images go to the
    run's store once, the learner rebuilds them into the same inputs (tokens scored as the engine did), weights go
    back, and the checkpoint (with its image processor) evaluates on screenshots."""
    from launch.tiny_checkpoints import vlm_checkpoint

    vlm = vlm_checkpoint(tmp_path / "vlm", corpus_episodes=20)
    run_dir = tmp_path / "run"
    p = _run(run_dir, f"model.path={vlm}", "model.tokenizer=auto", "actor.prompt.observation=screenshot",
             "env_server.sim.screenshot=png", "learner.total_steps=2", "learner.checkpoint_every=0",
             "broker.groups_per_batch=2",
             "learner.advantage.drop_zero_variance=false", "learner.anchor.demos=8", "local.eval_episodes=0",
             "broker.tasks.suite=sim:train:files_delete")
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    same = [r for r in recs if r.get("mismatch_tokens")]
    assert same and max(r["mismatch_abs_max"] for r in same) < 1e-4, "images rebuilt as the engine saw them"
    actors = [[json.loads(x) for x in (run_dir / "metrics" / f"actor-{i}.jsonl").read_text().splitlines()][-1]
              for i in (0, 1)]
    assert all(a["counters"]["weight_updates"] >= 1 for a in actors)
    stored = [f for f in (run_dir / "images").rglob("*") if f.is_file()]
    written = sum(a["counters"].get("images_written", 0) for a in actors)
    seen = written + sum(a["counters"].get("images_deduplicated", 0) for a in actors)
    assert stored and written <= len(stored) and seen > written, "each screenshot stored once, most seen again"
    env = [json.loads(x) for x in (run_dir / "metrics" / "env_server-0.jsonl").read_text().splitlines()]
    assert env[-1]["counters"].get("sessions_reclaimed", 0) == 0, "no live actor was taken for dead"
    ck = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
    assert (ck / "preprocessor_config.json").exists() and (ck / "tokenizer.json").exists()
    assert _eval(run_dir, "sim:heldout:files_delete", 2)["episodes"] == 2


def test_broad_recipe_trains_every_family_with_curation(tmp_path):
    """configs/broad.yaml from its shipped policy: RL on every sim family at once, the broker curating tickets by
    family; its metrics show each family's success estimate and the tickets it got."""
    from env_server.sim.families import FAMILY_NAMES

    run_dir = tmp_path / "run"
    result = recipe_run("configs/broad.yaml", run_dir, "env_server.pool_size=8", policy="broad-policy")
    assert set(result["per_family"]) == set(FAMILY_NAMES)
    record = [json.loads(x) for x in (run_dir / "metrics" / "broker.jsonl").read_text().splitlines()][-1]
    curation = record["curation"]
    assert set(curation) == set(FAMILY_NAMES)
    # Every ticket was drawn by curation, but for the tasks of reclaimed tickets, which went out again as they were.
    assert sum(c["issued"] for c in curation.values()) == record["tickets_issued"] - record.get("tickets_reissued", 0)
    assert sum(c["groups"] for c in curation.values()) > 0

"""Benchmarks run and print their contract (figures are not asserted: machines are noisy)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_bench_broker_prints_ratio_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "launch.cli", "bench", "broker", "--json", "--payload-bytes", "65536",
                          "--groups", "16", "--repeats", "1", "--persist", "on"],
                         cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("trajectories_per_s", "mb_per_s", "raw_zmq_mb_per_s", "ratio", "p50_ms", "p99_ms"):
        assert result[key] > 0, key
    # stragglers past the staleness bound are dropped (and counted), not delivered
    assert result["persist"] is True and 24 <= result["groups_per_run"] <= 32
    assert abs(result["ratio"] - result["mb_per_s"] / result["raw_zmq_mb_per_s"]) < 0.01
    # the broker's and the proxy's own CPU give the per-core figure (each in the middle of its topology)
    assert result["broker_cpu_pct"] > 0 and result["mb_per_broker_cpu_s"] > 0 and result["per_core_ratio"] > 0
    assert not list(tmp_path.glob("bench-broker-*")), "temporary run dirs must be cleaned up"


def test_bench_env_prints_ratio_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "launch.cli", "bench", "env", "--json", "--seconds", "0.5",
                          "--sessions", "3", "--clients", "1"],
                         cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("steps_per_s", "resets_per_s", "server_steps_per_s", "server_resets_per_s", "ratio"):
        assert result[key] > 0, key
    assert result["server_errors"] == 0 and result["sessions"] == 3
    assert abs(result["ratio"] - result["server_steps_per_s"] / result["steps_per_s"]) < 0.01


def test_bench_async_prints_speedup_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "launch.cli", "bench", "async", "--json", "--steps", "2",
                          "--config", str(REPO / "configs" / "local.yaml"), "--eval-episodes", "1",
                          "--latency", "0.05", "local.eval_suite=sim:heldout:files_delete",
                          # the contract, not the recipe: no anchor, two groups of 4 a step
                          "learner.anchor.suite=", "broker.group_size=4", "broker.groups_per_batch=2"],
                         cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-2000:] + out.stdout[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["sync_seconds"] > 0 and result["async_seconds"] > 0
    assert abs(result["speedup"] - result["sync_seconds"] / result["async_seconds"]) < 0.01
    assert result["sync_heldout_success"] is not None and result["async_heldout_success"] is not None
    # The learner-bound limit comes from the learner's own time split: it trained, and was idle the rest.
    assert result["async_learner_train_s"] > 0 and result["async_learner_busy_s"] >= result["async_learner_train_s"]
    assert 0 <= result["async_learner_idle_frac"] <= 1 and 0 <= result["sync_learner_idle_frac"] <= 1
    assert abs(result["async_over_learner_bound"] - result["async_seconds"] / result["async_learner_busy_s"]) < 0.01
    assert 0 <= result["async_actor_engine_idle_ratio"] <= 1


def _bench(tmp_path, *args: str) -> tuple[dict, str]:
    """A bench's JSON and what it wrote on stderr."""
    out = subprocess.run([sys.executable, "-m", "launch.cli", "bench", *args, "--json"], cwd=tmp_path,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=1500)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _bench_json(tmp_path, *args: str) -> dict:
    return _bench(tmp_path, *args)[0]


def test_bench_learner_and_weights_print_ratio_json(tmp_path):
    r = _bench_json(tmp_path, "learner", "--hidden", "32", "--groups", "2", "--group-size", "2", "--prompt-len", "32",
                    "--output-len", "8", "--steps", "2", "--peak-tflops", "0.5", "--same-prompt")
    assert r["train_tokens_per_s"] > 0 and r["bare_tokens_per_s"] > 0
    # a group's rollouts share their prompt: ours also ran without sharing it, in the same run
    assert r["same_prompt"] and r["unshared_tokens_per_s"] > 0
    assert r["share_speedup"] == pytest.approx(r["train_tokens_per_s"] / r["unshared_tokens_per_s"], rel=0.01)
    # Both figures are printed to three significant digits: their rounding is the slack.
    assert r["mfu"] == pytest.approx(r["model_tflops_per_s"] / 0.5, rel=0.01) and r["mfu"] > 0
    # (both rates are printed to 0.1 token/s: relative slack, as a loaded machine can make the ratio large)
    assert r["ratio"] == pytest.approx(r["train_tokens_per_s"] / r["bare_tokens_per_s"], rel=0.01)
    # a VLM on screenshot prompts: its depth as built, prompts of an instruction and a screenshot's image tokens
    v = _bench_json(tmp_path, "learner", "--vlm", "--hidden", "64", "--layers", "1", "--groups", "2", "--group-size",
                    "2", "--output-len", "8", "--steps", "2", "--same-prompt")
    assert v["shape"] == "tiny-qwen2-vl" and v["layers"] == 1 and v["hidden"] == 64 and v["prompt_len"] > 64
    assert v["train_tokens_per_s"] > 0 and v["bare_tokens_per_s"] > 0 and v["unshared_tokens_per_s"] > 0
    # ours also ran the other way round with the next step's screenshots (on a CPU: prefetched, not by default)
    assert v["step_seconds"] == v["unprefetched_step_seconds"] and v["prefetched_step_seconds"] > 0
    assert v["prefetch_speedup"] == pytest.approx(v["unprefetched_step_seconds"] / v["prefetched_step_seconds"],
                                                  rel=0.01)
    w = _bench_json(tmp_path, "weights", "--params", "100000", "--receivers", "1", "--repeats", "2")
    assert w["seconds"] > 0 and w["raw_seconds"] > 0 and w["first_round_seconds"] > 0
    assert abs(w["ratio"] - w["raw_seconds"] / w["seconds"]) < 0.01


def test_bench_scale_prints_its_figures_and_baseline(tmp_path):
    """A small ``bench scale``: every figure the issue names, ours and bare ZeroMQ's, and the desktop phase."""
    result = _bench_json(tmp_path, "scale", "--actors", "60", "--swarms", "2", "--seconds", "6", "--silence", "2",
                         "--env-servers", "2", "--desktops", "8")
    for key in ("connections_held", "tickets_per_s", "ticket_ms_p50", "ticket_ms_p99", "ack_ms_p99", "broker_rss_mb",
                "bytes_per_connection", "raw_rtt_ms_p99", "raw_bytes_per_connection", "desktop_steps_per_s",
                "desktop_resets_per_s", "in_process_steps_per_s"):
        assert result[key] > 0, key
    assert result["desktops_leased"] == 8 and result["desktop_errors"] == 0
    assert result["reconcile"]["ok"] and result["acked_not_in_audit"] == 0
    assert result["storm_unrecovered"] == 0
    assert not list(tmp_path.glob("bench-scale-*")), "temporary run dirs must be cleaned up"


def test_bench_engine_and_actor_print_their_ratios(tmp_path):
    rec = _bench_json(tmp_path, "engine", "--record", str(tmp_path / "wl.json"), "--record-config",
                      str(REPO / "configs/broad.yaml"), "--record-episodes", "3")
    assert rec["episodes"] == 3 and rec["turns"] >= 3 and rec["mean_output"] > 0
    e, err = _bench(tmp_path, "engine", "--batch", "4", "--prompt-len", "16", "--new-tokens", "8", "--mixed-batch",
                    "4", "--mixed-episodes", "6", "--workload", str(tmp_path / "wl.json"),
                    "--profile", str(tmp_path / "profile.txt"))
    # each workload's figures also went to stderr as it ended (what a run cut short by a time limit leaves)
    done = {line.split()[2]: json.loads(line.split(" ", 3)[3]) for line in err.splitlines()
            if line.startswith("bench engine: ")}
    assert done == {"fixed_4": e["fixed_4"], "mixed": e["mixed"]}, err[-2000:]
    assert e["mixed"]["turns"] == 2 * rec["turns"], "6 episodes replay the 3 recorded twice"
    turns = [t for ep in json.loads((tmp_path / "wl.json").read_text())["episodes"] for t in ep["turns"]]
    assert all(len(t) == 3 and 0 <= t[2] < t[0] for t in turns), "each turn records the prefix it shares"
    assert e["mixed"]["shared_prefixes"] and 0 <= e["mixed"]["prefix_reused_share"] < 1
    # 8 tokens a row, one a window on a CPU: the profile ends after its 6 windows, on the engine's own thread
    assert e["profile"]["windows"] == 6 and e["profile"]["cpu_self_s"] > 0 and e["profile"]["wall_s"] > 0
    assert "aten::mm" in (tmp_path / "profile.txt").read_text(), "the decode step's operators were recorded"
    # the mixed workload's profile (too short to pass its first windows: it profiles the last one)
    assert e["profile_mixed"]["windows"] >= 1 and "aten::" in (tmp_path / "profile-mixed.txt").read_text()
    for workload in ("fixed_4", "mixed"):
        w = e[workload]
        assert w["tokens_per_s"] > 0 and w["generate_tokens_per_s"] > 0 and w["ttft_s"] > 0
        assert 0 < w["prefill_share"] < 1
        assert abs(w["ratio"] - w["tokens_per_s"] / w["generate_tokens_per_s"]) < 0.01
        assert 1 <= w["mean_batch"] <= 4
    assert e["fixed_4"]["tokens"] == 4 * 8, "fixed lengths: every request generates exactly --new-tokens"
    assert e["fixed_4"]["mean_batch"] == 4, "the batch arrives at once: equal batch with generate's from the start"
    a = _bench_json(tmp_path, "actor", "--groups", "2", "--group-size", "2", "--max-new-tokens", "8")
    assert a["episodes"] == 4 and a["tokens_per_s"] > 0 and a["engine_requests"] > 0
    assert abs(a["ratio"] - a["tokens_per_s"] / a["engine_only_tokens_per_s"]) < 0.01

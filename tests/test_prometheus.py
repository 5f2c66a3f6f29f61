"""Prometheus /metrics: each role's newest metric record, scraped from live processes and parsed with the
client library's own parser."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from common.net import free_port
from common.metrics.prometheus import check_address, series
from tests.conftest import REPO, broker_process, make_net

pytest.importorskip("prometheus_client")


def test_a_record_maps_to_gauges_counters_and_labelled_histograms():
    """Counters (cumulative by contract) become Prometheus counters; the exposition parses back."""
    rec = {"time": 1.0, "role": "broker", "rank": 0, "queue_depth": 3, "paused": False, "phase": "rl",
           "counters": {"resets": 7}, "weights": {"round_s": 1.5}, "lag_hist": {"0": 4, "16+": 1},
           "nan": float("nan"), "ids": [1, 2]}
    got = {(kind, name, tuple(labels.items())): v for kind, name, labels, v in series(rec)}
    assert got == {("gauge", "queue_depth", ()): 3.0, ("gauge", "paused", ()): 0.0,
                   ("counter", "resets", ()): 7.0, ("gauge", "weights_round_s", ()): 1.5,
                   ("gauge", "lag_hist", (("key", "0"),)): 4.0, ("gauge", "lag_hist", (("key", "16+"),)): 1.0}
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from common.metrics.prometheus import RecordCollector

    collector = RecordCollector("env_server", 2)
    collector.update(rec)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    resets = fams["computerrl_env_server_resets"]
    assert resets.type == "counter" and resets.samples[0].name == "computerrl_env_server_resets_total"
    assert resets.samples[0].labels == {"rank": "2"} and resets.samples[0].value == 7
    assert {s.labels["key"] for s in fams["computerrl_env_server_lag_hist"].samples} == {"0", "16+"}
    check_address("", "broker.prometheus")
    check_address("0.0.0.0:9400", "broker.prometheus")
    with pytest.raises(ValueError, match="broker.prometheus must be HOST:PORT"):
        check_address("9400", "broker.prometheus")


def _scrape(port: int, want: str, proc: subprocess.Popen, seconds: float = 60.0) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else "exited"
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            if want in families:
                return families
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{want} never exposed on {port}"
        time.sleep(0.3)


@pytest.mark.slow
def test_a_live_broker_and_env_server_are_scraped(tmp_path):
    net = make_net()
    broker_port, env_port = free_port(), free_port()
    broker = broker_process(tmp_path / "run", net, "broker.metrics_interval_s=0.5",
                            f"broker.prometheus=127.0.0.1:{broker_port}")
    env = subprocess.Popen([sys.executable, "-m", "launch.cli", "env-server", "--run-dir", str(tmp_path / "run"),
                            "--rank", "1", f"env_server.port={free_port()}", "env_server.metrics_interval_s=0.5",
                            f"env_server.prometheus=127.0.0.1:{env_port - 1}"],
                           cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
    try:
        fams = _scrape(broker_port, "computerrl_broker_queue_depth", broker)
        depth = fams["computerrl_broker_queue_depth"]
        assert depth.type == "gauge" and depth.samples[0].labels == {"rank": "0"} and depth.samples[0].value == 0
        assert fams["computerrl_broker_lag_hist"].samples, "the staleness histogram, one series per bucket"
        # Each role's own memory: in its records, and as the standard process metrics operators already chart.
        assert fams["computerrl_broker_rss_mb"].samples[0].value > 0
        assert fams["process_resident_memory_bytes"].samples[0].value > 0
        fams = _scrape(env_port, "computerrl_env_server_desktops", env)  # rank 1 serves on the port + 1
        desktops = fams["computerrl_env_server_desktops"]
        assert desktops.type == "gauge" and desktops.samples[0].labels == {"rank": "1"}
        assert "computerrl_env_server_steps_per_s" in fams and "computerrl_env_server_peers" in fams
    finally:
        for p in (broker, env):
            p.terminate()
            p.wait(20)


def dashboard_metrics() -> set[str]:
    """Every computerrl_* series the shipped Grafana dashboard queries."""
    import json
    import re

    dash = json.loads((REPO / "configs" / "grafana" / "computerrl-run.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return {m for e in exprs for m in re.findall(r"computerrl_[a-z_]+", e)}


def exposed_metrics(metrics_dir) -> set[str]:
    """The series the roles of a run would expose, from their newest records (the same mapping as /metrics)."""
    from common.metrics.records import last_record

    names = set()
    for path in metrics_dir.glob("*.jsonl"):
        role = path.stem.split("-")[0]
        rec = last_record(path)
        if rec is None or role == "eval":
            continue
        names |= {f"computerrl_{role}_{n}{'_total' if kind == 'counter' else ''}" for kind, n, _, _ in series(rec)}
    return names


def test_the_dashboard_is_valid_grafana_json_with_one_datasource_variable():
    import json

    dash = json.loads((REPO / "configs" / "grafana" / "computerrl-run.json").read_text())
    assert dash["templating"]["list"][0]["type"] == "datasource"
    assert all(p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])
    assert len(dashboard_metrics()) >= 20

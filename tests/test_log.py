"""Logging: JSON lines per process with run_id/role/rank bound; console rendering on a terminal."""

from __future__ import annotations

import json


def test_logging_json_lines_bound(tmp_path, capsys):
    from common import log as L

    log = L.setup("broker", "run-x", 2, tmp_path, "info", console=False)
    log.info("hello", n=1)
    L.bind(policy_version=7)
    log.debug("hidden")
    log.warning("later")
    import threading

    t = threading.Thread(target=lambda: log.info("from a thread"))  # threads get the process keys too
    t.start()
    t.join()
    lines = [json.loads(x) for x in (tmp_path / "broker-2.jsonl").read_text().splitlines()]
    assert [x["event"] for x in lines] == ["hello", "later", "from a thread"]
    assert lines[2]["pid"] == lines[0]["pid"] and lines[2]["policy_version"] == 7
    assert all(x["run_id"] == "run-x" and x["role"] == "broker" and x["rank"] == 2 for x in lines)
    assert lines[1]["policy_version"] == 7 and "timestamp" in lines[0]
    err = capsys.readouterr().err
    assert json.loads(err.splitlines()[0])["event"] == "hello"  # not a TTY: JSON on stderr too
    L.setup("broker", "run-x", 2, tmp_path, "info", console=True)
    L.get().info("pretty")
    err = capsys.readouterr().err  # read once: a second read would always be empty
    assert "pretty" in err and '"event"' not in err

"""The episode log and its viewer (``computerrl episodes``): the writer's budget and queue, the reader's tolerance of
torn lines, other versions and missing screenshots, and the pages as a real browser (headless Chromium) renders
them: filters from the address, an episode's turns with the screenshot beside the action."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import threading
import time

import pytest
from PIL import Image as PILImage

from common.audit import AuditLog
from common.episode_log import RECORD_VERSION, EpisodeWriter, read_records
from common.images import Image, ImageStore
from common.rundir import RunDir
from launch.episodes.collect import NoEpisodes, load
from launch.episodes.pages import page_name, write_site
from launch.episodes.text import render_text
from tests.conftest import REPO


def _png(color=(200, 40, 40)) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", (64, 40), color).save(buf, format="PNG")
    return buf.getvalue()


def _episode(i: int, family: str, success: bool, version: int, images=(), source="train", group="g0") -> dict:
    turn = {"obs": f"[1] button \"OK {i}\"", "images": list(images), "text": f"click(\"OK {i}\")",
            "result": "clicked" if success else "ERROR: no element 'OK'", "format_error": False, "tokens": 7,
            "logprob": -0.25, "version": version, "seconds": 0.01}
    rec = {"v": RECORD_VERSION, "id": f"ep{i:03d}", "source": source, "task": f"sim:train:{family}/{i}",
           "family": family, "split": "train", "instruction": f"Press OK number {i}", "reward": float(success),
           "success": success, "finish": "done", "steps": 1, "format_errors": 0, "t": 1000.0 + i, "turns": [turn]}
    if source == "train":
        rec.update(group=group, index=0, group_rewards=[float(success), 0.0], version=[version, version])
    else:
        rec.update(eval_version=version)
    return rec


@pytest.fixture
def run(tmp_path):
    """A run directory with recorded episodes of two families, one screenshot in the store and one missing, a learner
    advantage record, the audit's verdicts, and a torn line and a record of another version."""
    rd = RunDir.create(tmp_path / "run")
    shot = Image.of(_png())
    ImageStore(rd.images).put(shot)
    eps = [_episode(0, "files_move", True, 1, images=[shot.digest], group="ga"),
           _episode(1, "files_move", False, 2, images=["ab" * 32], group="gb"),
           _episode(2, "sheet_sort", True, 2, group="gc"),
           _episode(3, "sheet_sort", False, 3, source="eval")]
    rd.episodes.mkdir()
    with open(rd.episodes / "actor-0.jsonl", "w") as f:
        for e in eps:
            f.write(json.dumps(e) + "\n")
        f.write(json.dumps({**eps[0], "v": 99, "id": "future"}) + "\n")
        f.write('{"v": 1, "id": "torn", "tur')  # a crash mid-line
    (rd.episodes / "learner.jsonl").write_text(json.dumps(
        {"v": RECORD_VERSION, "group": "ga", "trained_version": 2, "advantages": {"ep000": [[0, 0.71]]}}) + "\n")
    broker, learner = AuditLog(rd.audit / "broker.jsonl"), AuditLog(rd.audit / "learner.jsonl")
    broker.write("acked", gs=["ga", "gb", "gc"])
    broker.write("dropped", g="gb", r="zero_variance")
    learner.write("trained", gs=["ga"], v=2)
    broker.close()
    learner.close()
    return rd


def test_episodes_are_joined_with_what_the_learner_did_and_bad_lines_are_counted(run):
    eps = load(run.root)
    by = {e["id"]: e for e in eps.episodes}
    assert sorted(by) == ["ep000", "ep001", "ep002", "ep003"]
    assert eps.skipped == {"torn": 1, "other_version": 1}
    assert by["ep000"]["fate"] == "trained at version 2" and by["ep000"]["advantages"] == {0: 0.71}
    assert by["ep000"]["lag"] == 0, "sampled by version 1, trained in the step from 1 to 2"
    assert by["ep001"]["fate"] == "dropped by the broker (zero_variance)"
    assert by["ep002"]["fate"] == "queued" and by["ep003"]["fate"] == "evaluation"
    text = render_text(by["ep001"], eps.images)
    assert "missing from the image store" in text and "ERROR: no element 'OK'" in text
    assert "in the image store" in render_text(by["ep000"], eps.images)
    with pytest.raises(KeyError, match="no episode 'nope'"):
        eps.by_id("nope")


def test_a_directory_without_episodes_says_why(tmp_path):
    old = RunDir.create(tmp_path / "old-run")
    with pytest.raises(NoEpisodes, match="a run directory.*a run from before that has none"):
        load(old.root)
    with pytest.raises(NoEpisodes, match="not a run directory"):
        load(tmp_path)
    out = subprocess.run([sys.executable, "-m", "launch.cli", "episodes", str(old.root)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "no recorded episodes" in out.stderr and "Traceback" not in out.stderr


def test_the_groups_the_learner_set_aside_are_shown_whether_recorded_or_not(tmp_path):
    """A group whose steps killed the learner (``learner/quarantine.py``) is the one to read: its episodes are shown
    from the file the learner kept, beside the recorded ones, once each, with the learner's verdict."""
    from common.demofile import write_group
    from learner.quarantine import CRASHES
    from tests.conftest import make_group

    rd = RunDir.create(tmp_path / "run")
    group = make_group(rewards=(1.0, 0.0, 0.0), group_id="gpoison")
    rd.quarantine.mkdir()
    write_group(rd.quarantine / "gpoison.msgpack", group)
    (rd.quarantine / CRASHES).write_text("{}")
    (rd.quarantine / "torn.msgpack").write_bytes(b"\x93\xc4")
    rd.episodes.mkdir()
    recorded = {**_episode(0, "files_move", True, 0, group="gpoison"), "id": group.trajectories[0].traj_id}
    (rd.episodes / "actor-0.jsonl").write_text(json.dumps(recorded) + "\n")
    broker, learner = AuditLog(rd.audit / "broker.jsonl"), AuditLog(rd.audit / "learner.jsonl")
    broker.write("acked", gs=["gpoison"])
    learner.write("dropped", g="gpoison", r="step_crashed", v=3)
    broker.close()
    learner.close()
    eps = load(rd.root)
    assert sorted(e["id"] for e in eps.episodes) == sorted(t.traj_id for t in group.trajectories)
    by = {e["id"]: e for e in eps.episodes}
    assert by[group.trajectories[0].traj_id]["source"] == "train", "a recorded episode is shown as recorded"
    aside = by[group.trajectories[1].traj_id]
    assert aside["source"] == "set aside" and aside["fate"] == "dropped by the learner (step_crashed)"
    assert [t["text"] for t in aside["turns"]] == ["click(0)", "click(1)"] and aside["turns"][0]["obs"] == "obs 0"
    assert aside["group_rewards"] == [1.0, 0.0, 0.0] and aside["steps"] == 2
    assert eps.skipped == {"unreadable_set_aside": 1}
    text = render_text(aside, eps.images)
    assert "click(1)" in text and "step_crashed" in text
    index = write_site(eps, tmp_path / "site")
    assert "set aside" in index.read_text() and (index.parent / page_name(aside)).exists()

    only = RunDir.create(tmp_path / "crashed-early")  # nothing recorded yet, one group set aside
    only.quarantine.mkdir()
    write_group(only.quarantine / "gpoison.msgpack", group)
    assert len(load(only.root).episodes) == 3


def test_the_writer_keeps_a_group_whole_within_its_budget_and_never_blocks(tmp_path, monkeypatch):
    group = [_episode(i, "files_move", True, 1) for i in range(3)]
    size = sum(len(json.dumps(r, separators=(",", ":"))) + 1 for r in group)
    w = EpisodeWriter(tmp_path / "e.jsonl", max_bytes=int(size * 1.5))
    assert w.offer(group) and w.offer(group)  # the second does not fit: none of it is written
    w.close()
    assert w.counts == {"episodes_recorded": 3, "episodes_over_budget": 3}
    assert [r["id"] for r in read_records(tmp_path / "e.jsonl")] == ["ep000", "ep001", "ep002"]
    # A writer whose disk stalls: its thread holds one group, its queue the next; the third is not waited for.
    import common.episode_log as log_module
    started, release = threading.Event(), threading.Event()
    real_dumps = log_module.json.dumps

    def stalled_dumps(*a, **kw):
        started.set()
        release.wait(30)
        return real_dumps(*a, **kw)
    monkeypatch.setattr(log_module.json, "dumps", stalled_dumps)
    stalled = EpisodeWriter(tmp_path / "f.jsonl", max_bytes=10 ** 9, queue_size=1)
    assert stalled.offer([_episode(0, "x", True, 0)]) and started.wait(10)
    assert stalled.offer([_episode(1, "x", True, 0)])
    t0 = time.monotonic()
    assert not stalled.offer([_episode(2, "x", True, 0)]) and time.monotonic() - t0 < 1.0
    assert stalled.counts["episodes_dropped_busy"] == 1
    release.set()
    monkeypatch.undo()

    def settled(n: int) -> None:  # the thread has dealt with n groups
        deadline = time.monotonic() + 10
        while sum(stalled.counts[k] for k in ("episodes_recorded", "episodes_not_written")) < n:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    settled(2)
    assert stalled.offer([{"id": "unwritable", "turns": {1, 2}}])  # a set: no JSON for it
    settled(3)
    assert stalled.offer([_episode(3, "x", True, 0)]), "the thread goes on"
    stalled.close()
    assert stalled.counts == {"episodes_recorded": 3, "episodes_dropped_busy": 1, "episodes_not_written": 1}
    assert [r["id"] for r in read_records(tmp_path / "f.jsonl")] == ["ep000", "ep001", "ep003"]


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed (launch/miniwob-packages.sh installs it)")
    return path


def _dom(chromium: str, url: str) -> str:
    out = subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000",
                          "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow  # a browser per page: the whole suite's (docs/tests.md)
def test_the_pages_in_a_real_browser(run, tmp_path):
    chromium = _chromium()
    eps = load(run.root)
    index = write_site(eps, tmp_path / "site")
    assert (tmp_path / "site" / "success.png").stat().st_size > 1000, "per-family success drawn"
    dom = _dom(chromium, index.as_uri() + "#family=files_move&outcome=fail")
    assert "1 of 4 episodes shown" in dom
    shown = [line for line in dom.splitlines() if "<tr class=" in line and "hidden" not in line]
    assert len(shown) == 1 and "ep001" in shown[0]
    dom = _dom(chromium, index.as_uri() + "#vmin=2&vmax=2")
    assert "2 of 4 episodes shown" in dom
    page = _dom(chromium, (index.parent / page_name(eps.by_id("ep000"))).as_uri())
    assert "Turn 1: the screen" in page and 'click("OK 0")' in page and "advantage +0.710" in page
    assert 'data-shown="64"' in page, "the screenshot loaded (64 px wide)"
    assert "trained at version 2" in page and "lag 0 when trained" in page
    missing = _dom(chromium, (index.parent / page_name(eps.by_id("ep001"))).as_uri())
    assert "is missing from the image store" in missing and "dropped by the broker (zero_variance)" in missing


def test_serve_shows_new_episodes_and_nothing_else_of_the_run(run):
    import threading
    import urllib.error
    import urllib.request

    from launch.episodes.serve import serve

    run.keys.mkdir(exist_ok=True)
    (run.keys / "server.key_secret").write_text("secret")
    started: list = []
    ready = threading.Event()
    t = threading.Thread(target=serve, args=(run.root, "127.0.0.1", 0, lambda *a: (started.extend(a), ready.set())),
                         daemon=True)
    t.start()
    assert ready.wait(30)
    url, server = started
    try:
        index = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "ep000" in index and "ep009" not in index
        with open(run.episodes / "actor-1.jsonl", "w") as f:  # the run goes on: a new group is recorded
            f.write(json.dumps(_episode(9, "files_move", True, 4)) + "\n")
        index = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "ep009" in index
        base = url.split("/episodes/")[0]
        for secret in ("/keys/server.key_secret", "/episodes/html/../../keys/server.key_secret", "/config.yaml"):
            with pytest.raises(urllib.error.HTTPError, match="404"):
                urllib.request.urlopen(base + secret, timeout=10)
    finally:
        server.shutdown()
        t.join(10)


def test_a_run_directory_that_takes_no_pages_gets_them_elsewhere(run, tmp_path, monkeypatch):
    """Found on a read-only copy of a run (2026-12-03): a colleague's run directory, a snapshot. The pages went into
    the run directory only, and `episodes` ended in a traceback (`OSError: Read-only file system`)."""
    import errno
    import os
    import re

    from click.testing import CliRunner

    import launch.episodes.pages as pages
    from launch.cli import main

    real = pages.write_site

    def read_only_run(eps, out):
        if str(out).startswith(str(run.root)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(out))
        return real(eps, out)

    monkeypatch.setattr(pages, "write_site", read_only_run)
    monkeypatch.setattr("launch.episodes.serve.write_site", read_only_run)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    out = CliRunner().invoke(main, ["episodes", str(run.root)])
    assert out.exit_code == 0, out.output
    assert "the run directory takes no pages (Read-only file system): writing them to" in out.output
    site = next((tmp_path / "tmp").glob(f"computerrl-episodes-{os.getuid()}/{run.root.name}-*"))
    page = (site / page_name(load(run.root).by_id("ep000"))).read_text()
    (shot,) = re.findall(r"<img src='([^']+)'", page)
    assert (site / shot).resolve().is_file(), "the screenshot reached from the pages where they are"
    out = CliRunner().invoke(main, ["episodes", str(run.root), "--out", str(run.root / "elsewhere")])
    assert out.exit_code == 1 and "cannot write the pages to" in out.output and "Traceback" not in out.output
    out = CliRunner().invoke(main, ["episodes", str(run.root), "--serve", "0"])
    assert out.exit_code == 1 and "where --serve serves them from" in out.output, out.output

"""``computerrl check-families``: every family's solver played through its backend on training and held-out
instances, and held-out instances compared with training ones (``launch/check_families.py``)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from env_server.config import EnvServerConfig
from launch.check_families import check_families
from tests.conftest import REPO
from tests.test_plugins import NAME, outside  # noqa: F401,F811  (the example plug-in's fixture)


def test_the_sims_solvers_solve_and_a_small_instance_space_shows_as_overlap():
    checks = {c.family: c for c in check_families(EnvServerConfig(), ["sheet_sort", "settings_display"], seeds=2,
                                                  overlap_seeds=60)}
    for c in checks.values():
        assert c.played == {"train": 2, "heldout": 2} and c.solved == c.played and not c.failed, c
    # sheet_sort's instances are many; settings_display has a few dozen in all, so held-out repeats training
    assert checks["sheet_sort"].heldout_in_train == 0 and checks["settings_display"].heldout_in_train >= 50
    assert checks["settings_display"].ok() and not checks["settings_display"].ok(strict_overlap=True)


def test_a_broken_solver_fails_its_family_by_name_and_the_command_exits_1(outside, monkeypatch):  # noqa: F811
    import lamps_env

    fam = lamps_env.TASKS.families["all_off"]
    monkeypatch.setitem(lamps_env.TASKS.families, "all_off", dataclasses.replace(fam, solve=lambda p, on: iter(())))
    checks = {c.family: c for c in check_families(EnvServerConfig(backend=NAME), seeds=2, overlap_seeds=40)}
    # all_off is unsolved wherever a lamp starts lit; lamp_on still solves everything
    assert checks["lamp_on"].ok() and not checks["all_off"].ok()
    assert all(t.startswith("lamps:") and "steps)" in t for t in checks["all_off"].failed)
    # through the command, on the unbroken plug-in: its small panels repeat instances across splits
    out = _command(outside, "--json", "--seeds", "1", "--overlap-seeds", "300")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and {f["family"] for f in report["families"]} == {"lamp_on", "all_off"}
    assert all(f["heldout_in_train"] > 0 for f in report["families"]), report
    strict = _command(outside, "--strict-overlap", "--seeds", "1")
    assert strict.returncode == 1 and "FAIL" in strict.stdout, strict.stdout + strict.stderr


def _command(outside, *args: str) -> subprocess.CompletedProcess:
    """``computerrl check-families`` on the example plug-in, importable from its folder outside the repository."""
    return subprocess.run([sys.executable, "-m", "launch.cli", "check-families", *args, f"env_server.backend={NAME}",
                           "learner.anchor.suite=", "broker.tasks.suite=lamps:train", "local.eval_suite=lamps:heldout"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{outside}:{REPO}"})

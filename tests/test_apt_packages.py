"""launch/apt-packages.sh waits out another apt holding its lock (a fresh VM's unattended upgrades): the README's
test command once failed at once with exit 100 there. A stand-in apt-get on PATH fails while "locked"."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "launch" / "apt-packages.sh"


def _fake_apt(tmp_path: Path, failures: int) -> dict:
    """An apt-get that exits 100 (lock held) on its first ``failures`` calls, then succeeds; logs every call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(f"""#!/usr/bin/env bash
echo "$@" >> {tmp_path}/calls
n=$(wc -l < {tmp_path}/calls)
[ "$n" -le {failures} ] && {{ echo "E: Could not get lock /var/lib/dpkg/lock-frontend" >&2; exit 100; }}
exit 0
""")
    (bin_dir / "apt-get").chmod(0o755)
    (bin_dir / "sudo").write_text('#!/usr/bin/env bash\nexec "$@"\n')
    (bin_dir / "sudo").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "APT_RETRY_S": "0"}


def test_a_held_lock_is_waited_for(tmp_path):
    env = _fake_apt(tmp_path, failures=3)
    r = subprocess.run(["bash", str(SCRIPT), "test", "xvfb"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c.split()[2] for c in calls] == ["update"] * 4 + ["install"], calls
    assert all("DPkg::Lock::Timeout=60" in c for c in calls)
    assert "trying again" in r.stderr


def test_a_lock_held_past_the_wait_fails_with_apts_code(tmp_path):
    env = {**_fake_apt(tmp_path, failures=10_000), "APT_LOCK_WAIT_S": "0"}
    r = subprocess.run(["bash", str(SCRIPT), "test", "xvfb"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 100 and "giving up" in r.stderr

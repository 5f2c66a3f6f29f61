#!/usr/bin/env bash
# Sets up a virtual environment on first use (or when setup.cfg changed), then runs a command in it.
#   bash launch/bootstrap.sh test [--quick] [pytest args]  run the test suite (--quick skips the slow suites;
#                                                          COMPUTERRL_TEST_WORKERS parallel workers, default: cores)
#   bash launch/bootstrap.sh <computerrl subcommand ...>   e.g. run configs/local.yaml, broker, bench broker
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${COMPUTERRL_VENV:-.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.installed"
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[bootstrap] creating $VENV and installing computerrl (first run only)" >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e '.[test,miniwob,tracking]'
  touch "$stamp"
fi
case "${1:-}" in
  test)
    shift
    marker=()
    if [ "${1:-}" = "--quick" ]; then shift; marker=(-m "not slow"); fi
    # Real-desktop tests need Debian packages (Xvfb, bubblewrap, LibreOffice, ...): install them where we can.
    if ! "$VENV/bin/python" -c "from env_server.desktop.sandbox import missing_packages as m; raise SystemExit(bool(m()))"; then
      if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        bash launch/desktop-packages.sh
      else
        echo "[bootstrap] real-desktop packages missing and not root: those tests will skip (sudo bash launch/desktop-packages.sh)" >&2
      fi
    fi
    # The Slurm tests run a cluster of their own (three slurmds on this machine): Slurm and munge, where we can install them.
    if ! command -v slurmctld >/dev/null && [ ! -x /usr/sbin/slurmctld ]; then
      if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        bash launch/slurm-packages.sh
      else
        echo "[bootstrap] Slurm missing and not root: the Slurm cluster tests will skip (sudo bash launch/slurm-packages.sh)" >&2
      fi
    fi
    # The MiniWoB tests drive headless Chromium: the browser and its driver, where we can install them.
    if ! command -v chromedriver >/dev/null; then
      if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        bash launch/miniwob-packages.sh
      else
        echo "[bootstrap] chromium/chromedriver missing and not root: the MiniWoB tests will skip (sudo bash launch/miniwob-packages.sh)" >&2
      fi
    fi
    # Parallel test workers (pytest-xdist), one per core by default: the slow suites' processes leave cores idle
    # while they wait on each other. The tests on the one Slurm test cluster share a worker, and each worker picks
    # ports from a range of its own (tests/conftest.py). COMPUTERRL_TEST_WORKERS=0: one process.
    cores=$(nproc 2>/dev/null || echo 2)
    workers=(-n "${COMPUTERRL_TEST_WORKERS:-$(( cores < 2 ? 2 : cores ))}")
    set +e
    "$VENV/bin/python" -m pytest "${workers[@]}" "${marker[@]}" "$@"
    rc=$?
    [ "$rc" -eq 5 ] && rc=0   # pytest's "no tests collected" is not a failure of the suite
    exit "$rc"
    ;;
  "")
    exec "$VENV/bin/computerrl" --help
    ;;
  *)
    exec "$VENV/bin/computerrl" "$@"
    ;;
esac

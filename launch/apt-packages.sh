#!/usr/bin/env bash
# Installs Debian packages with apt-get (as root, or through sudo): bash launch/apt-packages.sh WHAT PACKAGE...
# WHAT names the purpose in the message. Safe to run again: apt skips what is present.
# Another apt holding its lock (a fresh cloud VM's unattended upgrades in its first minutes) is waited for, up to
# APT_LOCK_WAIT_S seconds (default 900), instead of failing at once with exit 100.
set -euo pipefail
what="$1"; shift
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "[$what] installing: $*" >&2
export DEBIAN_FRONTEND=noninteractive
apt_get() {
  local deadline=$((SECONDS + ${APT_LOCK_WAIT_S:-900})) rc
  while true; do
    rc=0
    $SUDO apt-get -o DPkg::Lock::Timeout=60 "$@" || rc=$?
    if [ "$rc" -eq 0 ]; then return 0; fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "[$what] apt-get $1 failed (exit $rc) for ${APT_LOCK_WAIT_S:-900} s; giving up" >&2
      return "$rc"
    fi
    echo "[$what] apt-get $1 failed (exit $rc: is another apt running?); trying again" >&2
    sleep "${APT_RETRY_S:-10}"
  done
}
apt_get update -qq
apt_get install -y -qq --no-install-recommends "$@" >/dev/null

#!/usr/bin/env bash
# Installs the Debian packages the real-desktop backend (xvfb) needs, from env_server/desktop/packages.txt.
# Needs root (or sudo) and apt-get; prints what it installs. Safe to run again: apt skips what is present.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t pkgs < <(grep -v '^\s*#' env_server/desktop/packages.txt | awk 'NF {print $1}')
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "[desktop-packages] installing: ${pkgs[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null

#!/usr/bin/env bash
# Installs the Debian packages the real-desktop backend (xvfb) needs, from env_server/desktop/packages.txt.
# Needs root (or sudo) and apt-get; prints what it installs. Safe to run again: apt skips what is present.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t pkgs < <(grep -v '^\s*#' env_server/desktop/packages.txt | awk 'NF {print $1}')
exec bash launch/apt-packages.sh desktop-packages "${pkgs[@]}"

#!/usr/bin/env bash
# Installs headless Chromium and its chromedriver, which the miniwob backend drives (env_server/miniwob/).
# The Python side comes with `pip install 'computerrl[miniwob]'` (the test command installs both).
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "[miniwob-packages] installing: chromium chromium-driver" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null

#!/usr/bin/env bash
# Installs headless Chromium and its chromedriver, which the miniwob backend drives (env_server/miniwob/).
# The Python side comes with `pip install 'computerrl[miniwob]'` (the test command installs both).
exec bash "$(dirname "$0")/apt-packages.sh" miniwob-packages chromium chromium-driver

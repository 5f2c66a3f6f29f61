#!/usr/bin/env bash
# Installs Debian packages with apt-get (as root, or through sudo): bash launch/apt-packages.sh WHAT PACKAGE...
# WHAT names the purpose in the message. Safe to run again: apt skips what is present.
set -euo pipefail
what="$1"; shift
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "[$what] installing: $*" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null

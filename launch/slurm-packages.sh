#!/usr/bin/env bash
# Installs Slurm (slurmctld, slurmd, the client commands) and munge, for the tests' own cluster
# (tests/slurm_cluster.py). Not needed to submit runs: a Slurm login node has its own.
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "[slurm-packages] installing: slurm-wlm munge" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null

#!/usr/bin/env bash
# Installs Slurm (slurmctld, slurmd, the client commands) and munge, for the tests' own cluster
# (tests/slurm_cluster.py). Not needed to submit runs: a Slurm login node has its own.
exec bash "$(dirname "$0")/apt-packages.sh" slurm-packages slurm-wlm munge

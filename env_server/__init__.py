"""The env_server role: a pool of desktops (simulated, or real in bubblewrap/Apptainer sandboxes) leased to
actors as sessions; the action space, task suites and verifiers (docs/architecture.md)."""

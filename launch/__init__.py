"""The computerrl CLI, launchers, benchmarks."""

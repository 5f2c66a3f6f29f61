"""The built-in simulated office desktop: apps with real state, tasks, verifiers and oracle solvers."""

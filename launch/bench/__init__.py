"""The benchmarks of ``computerrl bench``: one module per component, each printing its figure as a ratio against
a raw baseline measured in the same run (``docs/benchmarks.md``). ``procs.py`` starts and reaps the processes of
the multi-process ones; ``workloads/`` holds recorded workloads."""

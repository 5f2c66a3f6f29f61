"""Exit codes a role process ends with, as its supervisor (``computerrl run``, Slurm) reads them.

0: done (the learner finished ``total_steps``, or was told to stop on Control). ``EXIT_RESUMABLE``: stopped
by a signal before the run was over, state saved (a checkpoint, the spill log): start it again, with
``--resume`` for the learner. ``EXIT_CONFIG``: it cannot run with its configuration; starting it again would fail
the same way, so its supervisor stops the run instead. Anything else: it failed.
"""

EXIT_RESUMABLE = 75
"""EX_TEMPFAIL from sysexits.h: try again later"""

EXIT_CONFIG = 78
"""EX_CONFIG from sysexits.h: a configuration error (a key no role can use, a checkpoint that is not there)"""

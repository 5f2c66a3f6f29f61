"""Exit codes a role process ends with, as its supervisor (``computerrl run``, Slurm) reads them.

0: done (the learner finished ``total_steps``, or was told to stop on Control). ``EXIT_RESUMABLE``: stopped
by a signal before the run was over, state saved (a checkpoint, the spill log): start it again, with
``--resume`` for the learner. Anything else: it failed.
"""

EXIT_RESUMABLE = 75
"""EX_TEMPFAIL from sysexits.h: try again later"""

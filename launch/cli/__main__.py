"""``python -m launch.cli``: the ``computerrl`` command (what the Slurm script and the tests run)."""

import sys

from launch.cli import main

sys.exit(main())

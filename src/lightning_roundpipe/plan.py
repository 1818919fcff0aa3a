"""``python -m lightning_roundpipe.plan``: will fine-tuning this model fit this machine, and how to run it.

The planner's command (``planning/cli.py``): the plan report, or ``--host-bytes``'s table. Each flag:
docs/planning.md.
"""

import sys

from .planning.cli import main

if __name__ == "__main__":
    sys.exit(main())

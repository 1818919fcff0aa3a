"""``python -m roundpipe_lab.sim {plan,host-bytes,compare,paper,small-steps,scaling}``: the lab's simulator commands.

``analysis/cli.py`` holds them; ``plan`` and ``host-bytes`` run the library's planner
(``python -m lightning_roundpipe.plan``).
"""

import sys

from .analysis.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m lightning_roundpipe.sim {plan,compare,paper,scaling}``: runs the command line of the analysis layer.

A command, not a layer: nothing imports this module, so it may reach the layer above the
simulator (``lightning_roundpipe.analysis.cli`` holds the commands).
"""

import sys

from ..analysis.cli import main

if __name__ == "__main__":
    sys.exit(main())

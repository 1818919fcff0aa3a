"""``python -m lightning_roundpipe.sim``: the old name of the planner's command, kept for the commands users have.

``plan`` and ``host-bytes`` run ``python -m lightning_roundpipe.plan`` (``host-bytes`` as its
``--host-bytes``). The simulator's studies (``compare``, ``paper``, ``small-steps``, ``scaling``) left the
library for the lab: they print the lab's command and exit 2 (the library imports nothing of the lab).
"""

from __future__ import annotations

import sys
from typing import Sequence

from ..planning.cli import main as plan_main

LAB_COMMANDS = ("compare", "paper", "small-steps", "scaling")
PROG = "python -m lightning_roundpipe.sim"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the old command line: ``plan ...`` and ``host-bytes ...`` run the planner; the rest name the lab's command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "plan":
        return plan_main(rest, prog=f"{PROG} plan")
    if command == "host-bytes":
        return plan_main(["--host-bytes", *rest], prog=f"{PROG} host-bytes")
    if command in LAB_COMMANDS:
        print(f"error: `{PROG} {command}` moved to the lab, this repository's second package: run "
              f"`python -m roundpipe_lab.sim {' '.join([command, *rest])}`", file=sys.stderr)
        return 2
    print(f"usage: {PROG} {{plan,host-bytes}} ...\n"
          f"  plan: the planner, now `python -m lightning_roundpipe.plan` (same options)\n"
          f"  host-bytes: `python -m lightning_roundpipe.plan --host-bytes`\n"
          f"  {', '.join(LAB_COMMANDS)}: the lab's studies, `python -m roundpipe_lab.sim ...`",
          file=sys.stderr if command not in ("-h", "--help") else sys.stdout)
    return 0 if command in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())

"""Module docstrings say what the module is for and why, briefly: the reasoning behind a module
lives in docs/design.md's design notes, not in an essay at the top of the file."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO / "src" / "lightning_roundpipe"
MAX_LINES = 12  # about ten lines of prose, plus a usage line or a two-line summary


def docstring_lines(path: Path) -> int:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
    return len(docstring.strip("\n").splitlines()) if docstring else 0


def test_every_module_docstring_is_at_most_12_lines():
    long = {str(path.relative_to(PACKAGE_DIR)): docstring_lines(path) for path in sorted(PACKAGE_DIR.rglob("*.py"))}
    assert len(long) > 100  # the package was found
    assert {name: lines for name, lines in long.items() if lines > MAX_LINES} == {}


def test_design_notes_hold_the_moved_essays():
    design = (REPO / "docs" / "design.md").read_text()
    notes = design.split("\n## Design notes\n", 1)[1]
    for module in ("engine/rng.py", "schedule/lowering.py", "optim/overlap.py", "cost/moe_loop.py"):
        assert f"\n### `{module}`\n" in notes

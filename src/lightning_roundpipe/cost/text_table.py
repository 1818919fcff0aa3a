"""Tables as plain text through ``rich.table``: fixed-width for the terminal and logs, or Markdown.

Rendered into a string by a recording console with no colour and no terminal, so the text is
the same on a terminal, in a pipe and in a log file, and wide rows are never wrapped (the width
is as large as the table needs). The fixed-width form rules the header with ASCII dashes and
leaves no trailing blanks; the Markdown form is a GitHub table.
"""

from __future__ import annotations

import io
from typing import Iterable, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

# Header ruled with '-' (ASCII: logs and pipes stay plain), no borders, columns split by two spaces.
HEADER_RULE = box.Box(
    "    \n"
    "    \n"
    " -- \n"
    "    \n"
    "    \n"
    "    \n"
    "    \n"
    "    \n",
    ascii=True,
)
WIDE = 10_000  # characters: never wrap a row


def render_table(header: Sequence[str], rows: Iterable[Sequence[str]], *, right: Iterable[int] = (),
                 markdown: bool = False) -> str:
    """``rows`` under ``header`` as text; columns in ``right`` are right-aligned (numbers).

    ``markdown``: a GitHub table (``|`` in cells escaped as ``\\|`` so columns hold); otherwise
    a fixed-width table, header, a dashed rule and one line per row.
    """
    aligned = set(right)
    if markdown:
        table = Table(box=box.MARKDOWN, show_edge=True, pad_edge=True, padding=(0, 1), highlight=False)
    else:
        table = Table(box=HEADER_RULE, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), highlight=False)
    for i, title in enumerate(header):
        table.add_column(title, justify="right" if i in aligned else "left", no_wrap=True)
    for row in rows:
        table.add_row(*(cell.replace("|", "\\|") if markdown else cell for cell in row))
    console = Console(file=io.StringIO(), width=WIDE, color_system=None, force_terminal=False, highlight=False,
                      markup=False, emoji=False, soft_wrap=False)
    console.print(table)
    lines = [line.rstrip() for line in console.file.getvalue().splitlines() if line.strip()]
    if markdown:  # rich rules the header with plain dashes: mark the right-aligned columns as GitHub does
        cells = lines[1].split("|")
        lines[1] = "|".join(c[:-1] + ":" if i - 1 in aligned and c else c for i, c in enumerate(cells))
    return "\n".join(lines)

"""Regenerate the figures printed in the docs, so that they cannot go stale silently.

A figure is a block of a Markdown page between ``<!-- figures:NAME -->`` and ``<!-- /figures -->``
(each marker on a line of its own). This script runs the documented command or API call that
makes figure NAME and writes what it printed into every such block:

    python scripts/doc_figures.py            # rewrite the blocks in README.md and docs/*.md
    python scripts/doc_figures.py --check    # rewrite nothing; exit 1 naming each stale block
    python scripts/doc_figures.py --timeline # also rerun the default job's trace and redraw docs/img/timeline.png
    python scripts/doc_figures.py --measured # also rerun the default job for its summary (measured)

The blocks hold simulator output only (seconds, no training, no GPU), so
``tests/docs_and_setup/test_doc_figures.py`` runs ``--check`` on every change. ``--timeline``
trains (the default job with ``trace=true``, about a minute on 2 cores), keeps the trace beside
the picture (``docs/img/timeline_trace.json``) and draws the picture from it, recording in the PNG a
digest of what it drew: a test redraws the committed trace and compares digests, not pixels. The measured blocks
(``MEASURED``: the default job's printed summary, its time included): ``--measured`` rewrites
them, ``--check`` leaves their numbers alone, and a test checks that they have the lines the job
prints.

Commands run in a subprocess with a fixed terminal width, as a reader would run them, and the
block holds their output verbatim: this reads no numbers out of printed tables, so a change of
the printed format shows up as a stale block here, not as a parse error.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
TIMELINE_PNG = REPO / "docs" / "img" / "timeline.png"
TIMELINE_TRACE = REPO / "docs" / "img" / "timeline_trace.json"  # the records the picture draws
TIMELINE_TITLE = "RoundPipe timeline"  # the title the strategy gives its own picture
COLUMNS = "200"  # a fixed width, so that rich output wraps the same on every machine
COMMAND_TIMEOUT_S = 600
BLOCK = re.compile(r"^<!-- figures:(?P<name>[\w.-]+) -->\n(?P<body>.*?)^<!-- /figures -->$", re.M | re.S)


def command_output(argv: list[str]) -> str:
    """What ``python ARGV...`` prints from the repository root, with this checkout's sources."""
    env = {**os.environ, "COLUMNS": COLUMNS, "TERM": "dumb", "NO_COLOR": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"python {' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return "\n".join(line.rstrip() for line in done.stdout.strip("\n").splitlines())


def shown_output(argv: list[str]) -> Callable[[], str]:
    """A figure that is a command's output, shown as a plain code block."""
    return lambda: "```\n" + command_output(argv) + "\n```\n"


# The documented command of each figure; docs/planning.md shows this one just above its block.
FIGURES: dict[str, Callable[[], str]] = {
    "sim-plan-qwen3-8b-rtx4090": shown_output(
        ["-m", "lightning_roundpipe.plan", "--model", "qwen3-8b", "--hardware", "rtx4090"]),
    # The memory model's host bytes per parameter, a Markdown table (docs/limitations.md, docs/finetune.md).
    "host-bytes-per-param": lambda: command_output(["-m", "lightning_roundpipe.plan", "--host-bytes"]) + "\n",
}

RUN_DIR_SHOWN = "outputs/<date>/<time>"  # the run directory as a measured block shows it


def default_job_summary() -> str:
    """The summary the default job (``make run``) prints at its end, measured now on this machine,
    and under it the date, the cores and how loaded they were (other processes slow it down)."""
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as run_dir:
        printed = command_output(["examples/finetune.py", f"hydra.run.dir={run_dir}"])
        summary = printed[printed.rindex("\nsteps:") + 1:].replace(run_dir, RUN_DIR_SHOWN)
    when = time.strftime("%Y-%m-%d", time.gmtime())
    return ("```\n" + summary + "\n```\n\n" + f"(measured {when} on {os.cpu_count()} cores; load average "
            f"{load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after)\n")


# Figures measured by running something (seconds of wall time vary): rewritten only with --measured.
MEASURED: dict[str, Callable[[], str]] = {"default-job-summary": default_job_summary}


def blocks(text: str) -> list[tuple[str, str]]:
    """(name, current body) of each figure block of a page."""
    return [(m["name"], m["body"]) for m in BLOCK.finditer(text)]


def rewrite(text: str, made: dict[str, str], keep=frozenset(MEASURED)) -> str:
    """The page with each block's body replaced by its figure (unknown names are an error; blocks
    named in ``keep`` and not in ``made`` stay as they are)."""
    def replace(m: re.Match) -> str:
        if m["name"] in keep and m["name"] not in made:
            return m[0]
        if m["name"] not in made:
            raise KeyError(f"no figure named {m['name']!r} in scripts/doc_figures.py (known: {sorted(FIGURES)})")
        return f"<!-- figures:{m['name']} -->\n{made[m['name']]}<!-- /figures -->"
    return BLOCK.sub(replace, text)


def stale_blocks(pages=PAGES, figures=FIGURES, measured=MEASURED) -> tuple[list[str], dict[Path, str]]:
    """Which blocks differ from what their figure makes now, and every page as it should be
    (blocks named in ``measured`` are left as they are)."""
    texts = {page: page.read_text() for page in pages}
    names = {name for text in texts.values() for name, _ in blocks(text)} - set(measured)
    unknown = sorted(names - set(figures))
    if unknown:
        raise KeyError(f"figure blocks without a figure in scripts/doc_figures.py: {unknown}")
    made = {name: figures[name]() for name in sorted(names)}
    stale = [f"{page.relative_to(REPO) if page.is_relative_to(REPO) else page}: {name}"
             for page, text in texts.items() for name, body in blocks(text) if name in made and body != made[name]]
    return stale, {page: rewrite(text, made) for page, text in texts.items()}


def redraw_timeline(png: Path = TIMELINE_PNG, trace: Path = TIMELINE_TRACE) -> None:
    """Run the default job with the timeline on, keep its trace at ``trace`` and draw ``png`` from it."""
    with tempfile.TemporaryDirectory() as run_dir:
        command_output(["examples/finetune.py", "trace=true", f"hydra.run.dir={run_dir}"])
        written = next(Path(run_dir).rglob("roundpipe_trace.json"), None)
        if written is None:
            raise RuntimeError(f"the default job with trace=true wrote no roundpipe_trace.json under {run_dir}")
        shutil.copyfile(written, trace)
    draw_timeline(trace, png)
    print(f"wrote {trace.relative_to(REPO)} and {png.relative_to(REPO)}")


def drawing_digest(figure) -> str:
    """A digest of what a timeline figure draws: every bar (place, size, colour, hatch) and every text,
    so two drawings compare equal whatever matplotlib's pixels (versions antialias differently)."""
    import hashlib

    from matplotlib.colors import to_hex

    ax = figure.axes[0]
    bars = [(round(p.get_x(), 6), round(p.get_y(), 6), round(p.get_width(), 6), round(p.get_height(), 6),
             to_hex(p.get_facecolor()), p.get_hatch()) for p in ax.patches]
    texts = [t.get_text() for t in (*ax.texts, *ax.get_yticklabels(), *ax.get_legend().get_texts())]
    return hashlib.sha256(repr((bars, texts, ax.get_xlim(), ax.get_title())).encode()).hexdigest()


def timeline_figure(trace: Path = TIMELINE_TRACE):
    """The strategy's own picture of ``trace`` (a matplotlib figure, not yet drawn) and its digest."""
    from lightning_roundpipe.tracing.gantt import gantt_figure
    from lightning_roundpipe.tracing.timeline import load_chrome_trace

    figure = gantt_figure(load_chrome_trace(str(trace)), TIMELINE_TITLE)
    return figure, drawing_digest(figure)


def draw_timeline(trace: Path = TIMELINE_TRACE, png: Path = TIMELINE_PNG) -> None:
    """Draw ``trace`` as ``png``, with the drawing's digest in the PNG's ``Drawing`` text."""
    from lightning_roundpipe.tracing.gantt import DPI

    figure, digest = timeline_figure(trace)
    figure.savefig(str(png), format="png", dpi=DPI, metadata={"Drawing": digest, "Software": None})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if a block is stale")
    parser.add_argument("--timeline", action="store_true", help="also redraw docs/img/timeline.png (trains)")
    parser.add_argument("--measured", action="store_true", help="also rerun the measured figures (trains)")
    args = parser.parse_args(argv)
    read = {page: page.read_text() for page in PAGES}
    stale, pages = stale_blocks()
    if args.measured and not args.check:
        made = {name: figure() for name, figure in MEASURED.items()}
        pages = {page: rewrite(text, made, keep=set(FIGURES)) for page, text in pages.items()}
    if args.check:
        for where in stale:
            print(f"stale figure block {where}: run python scripts/doc_figures.py", file=sys.stderr)
        return 1 if stale else 0
    for page, text in pages.items():
        now = page.read_text()
        if now != text and now != read[page]:  # edited while the figures ran: keep the edit, say so
            print(f"{page.relative_to(REPO)} changed while the figures ran: not rewritten, run again", file=sys.stderr)
        elif now != text:
            page.write_text(text)
            print(f"rewrote {page.relative_to(REPO)}")
    if args.timeline:
        redraw_timeline()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Figures printed in the docs come from scripts/doc_figures.py: a committed block that differs
from what its command prints now fails here, naming the block and the command that fixes it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _scripts import load_script as load_named

REPO = Path(__file__).resolve().parents[2]


def load_script():
    return load_named("doc_figures")


@pytest.mark.timeout(30)
def test_a_stale_block_is_named_and_rewritten(tmp_path):
    script = load_script()
    page = tmp_path / "page.md"
    fresh = "```\nfigure 2\n```\n"
    page.write_text("intro\n<!-- figures:demo -->\n```\nfigure 1\n```\n<!-- /figures -->\nrest\n")
    stale, pages = script.stale_blocks(pages=(page,), figures={"demo": lambda: fresh})
    assert stale == [f"{page}: demo"]
    assert pages[page] == "intro\n<!-- figures:demo -->\n" + fresh + "<!-- /figures -->\nrest\n"
    page.write_text(pages[page])
    assert script.stale_blocks(pages=(page,), figures={"demo": lambda: fresh}) == ([], {page: pages[page]})


@pytest.mark.timeout(30)
def test_a_block_without_a_figure_is_an_error(tmp_path):
    script = load_script()
    page = tmp_path / "page.md"
    page.write_text("<!-- figures:nobody -->\nold\n<!-- /figures -->\n")
    with pytest.raises(KeyError, match=r"figure blocks without a figure in scripts/doc_figures.py: \['nobody'\]"):
        script.stale_blocks(pages=(page,), figures={})
    assert page.read_text() == "<!-- figures:nobody -->\nold\n<!-- /figures -->\n"


def test_every_figure_is_used_and_planning_shows_the_plan_command():
    script = load_script()
    used = {name for page in script.PAGES for name, _ in script.blocks(page.read_text())}
    assert used == set(script.FIGURES) | set(script.MEASURED)
    planning = (REPO / "docs" / "planning.md").read_text()
    command = "python -m lightning_roundpipe.plan --model qwen3-8b --hardware rtx4090\n"
    assert planning.index(command) < planning.index("<!-- figures:sim-plan-qwen3-8b-rtx4090 -->")


@pytest.mark.timeout(600)  # one simulator run (about 25 s of CPU; longer on a shared machine)
def test_committed_figures_match_what_the_commands_print():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "doc_figures.py"), "--check"],
                          cwd=REPO, capture_output=True, text=True, timeout=590)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ""

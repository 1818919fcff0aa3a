"""The user guide apart from the lab notebook: every page of the navigation exists, the guide (the
navigation less its "Lab notebook" section) stays under its word limit, and the default job's time
is one measured figure, in one place, printed by the job itself (scripts/doc_figures.py --measured)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _scripts import load_script

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


load = load_script


words = load("doc_words")
figures = load("doc_figures")


def test_every_page_in_the_navigation_exists_and_every_page_is_in_it():
    split = words.sections()
    assert split["api"] == ["api/index.md"]  # generated at build time by scripts/docs_api_pages.py
    listed = split["guide"] + split["lab"]
    assert len(listed) == len(set(listed))
    assert [page for page in listed if not (DOCS / page).is_file()] == []
    on_disk = sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    assert sorted(listed) == on_disk


def test_the_lab_notebook_is_its_own_section_and_holds_the_lab_pages():
    split = words.sections()
    for lab_page in ("measurements.md", "simulator.md", "emulated_gpus.md", "reference_workload.md"):
        assert lab_page in split["lab"] and lab_page not in split["guide"]
    for guide_page in ("quickstart.md", "tutorial.md", "finetune.md", "custom_models.md", "tuning.md",
                       "planning.md", "troubleshooting.md", "limitations.md", "gpu_server.md"):
        assert guide_page in split["guide"]


def test_the_sections_are_split_by_title():
    nav = [{"Home": "index.md"}, {"Guides": [{"A": "a.md"}, "b.md"]}, {"API reference": "api/index.md"},
           {"Lab notebook": [{"M": "m.md"}, {"Deeper": [{"S": "s.md"}]}]}]
    assert words.sections(nav) == {"guide": ["index.md", "a.md", "b.md"], "lab": ["m.md", "s.md"],
                                   "api": ["api/index.md"]}


def test_the_user_guide_is_at_most_25000_words():
    guide = {page: words.words(page) for page in words.sections()["guide"]}
    assert words.GUIDE_WORD_LIMIT == 25_000
    assert sum(guide.values()) <= words.GUIDE_WORD_LIMIT, sorted(guide.items(), key=lambda kv: -kv[1])


def summary_labels(text: str) -> list[str]:
    """The labels ('steps:', 'wall time:', ...) of the lines of a printed default-job summary."""
    return [line.split(":", 1)[0] + ":" for line in text.strip("`\n").splitlines() if ":" in line]


def quickstart_block() -> str:
    blocks = dict(figures.blocks((DOCS / "quickstart.md").read_text()))
    return blocks["default-job-summary"].split("```\n")[1]


def test_the_quickstart_shows_the_summary_lines_the_default_job_prints():
    source = (REPO / "examples" / "finetune.py").read_text()
    report = source[source.index("report(\n"):source.index("return results")]
    printed = [label.strip() for label in re.findall(r'f"(?:\\n)?([a-z ()]+:) ', report)]
    assert printed[:6] == ["steps:", "training loss (last):", "validation perplexity:", "throughput:",
                           "wall time:", "checkpoint:"]
    assert summary_labels(quickstart_block()) == printed[:6]  # the default job saves no LoRA adapter


GUIDE_AND_README = [REPO / "README.md", *(DOCS / page for page in words.sections()["guide"])]


@pytest.mark.parametrize("page", GUIDE_AND_README, ids=lambda p: p.name)
def test_the_default_jobs_time_is_given_only_by_the_quickstarts_measured_block(page):
    text = page.read_text()
    if page.name == "quickstart.md":
        text = text.replace(dict(figures.blocks(text))["default-job-summary"], "")
    assert "wall time:" not in text
    for sentence in re.split(r"(?<=[.:;])\s", " ".join(text.split())):
        if "default job" in sentence or "make run" in sentence:
            assert not re.search(r"\b\d+(\.\d+)? ?(s|seconds?|minutes?)\b", sentence), sentence


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_measured_summary_has_the_lines_the_committed_block_has():
    measured = figures.default_job_summary()
    assert summary_labels(measured.split("```\n")[1]) == summary_labels(quickstart_block())
    assert re.search(r"\(measured \d{4}-\d\d-\d\d on \d+ cores; load average [0-9.]+ before", measured)


def test_planning_lists_every_model_preset_and_every_plan_flag(capsys):
    from lightning_roundpipe.planning.cli import build_parser
    from lightning_roundpipe.cost.transformer import MODEL_PRESETS

    page = (DOCS / "planning.md").read_text()
    plan = build_parser()
    flags = {option for action in plan._actions for option in action.option_strings
             if option.startswith("--") and option not in ("--help", "--num-gpus")}
    assert "--detect" in flags and "--quantize" in flags
    assert sorted(flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", page)) == []
    assert sorted(name for name in MODEL_PRESETS if f"`{name}`" not in page) == []

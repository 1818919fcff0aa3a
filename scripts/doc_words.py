"""Count the words of the user guide and of the lab notebook, as mkdocs.yml's navigation splits them.

    python scripts/doc_words.py          # words per page, then the two totals

The user guide is every page of the navigation except the "Lab notebook" section and the API
reference (generated at build time from the docstrings, ``scripts/docs_api_pages.py``). A word is
a whitespace-separated token of the Markdown source, as ``wc -w`` counts it.
``tests/docs_and_setup/test_user_guide.py`` holds the guide to ``GUIDE_WORD_LIMIT``.
"""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
LAB_SECTION = "Lab notebook"
API_SECTION = "API reference"  # filled by scripts/docs_api_pages.py at build time
GUIDE_WORD_LIMIT = 25_000


def nav(config: Path = REPO / "mkdocs.yml") -> list:
    """mkdocs.yml's ``nav`` (the file has no tags that need mkdocs' own loader)."""
    return yaml.safe_load(config.read_text(encoding="utf-8"))["nav"]


def pages(entries: list) -> list[str]:
    """Every page path under ``entries``, in navigation order."""
    found = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        found.extend(pages(value) if isinstance(value, list) else [value])
    return found


def sections(entries: list | None = None) -> dict[str, list[str]]:
    """The pages of the user guide, of the lab notebook and of the API reference."""
    split: dict[str, list[str]] = {"guide": [], "lab": [], "api": []}
    for entry in nav() if entries is None else entries:
        title = next(iter(entry)) if isinstance(entry, dict) else None
        part = {LAB_SECTION: "lab", API_SECTION: "api"}.get(title, "guide")
        split[part].extend(pages([entry]))
    return split


def words(page: str) -> int:
    return len((DOCS / page).read_text(encoding="utf-8").split())


def main() -> int:
    split = sections()
    for part in ("guide", "lab"):
        for page in split[part]:
            print(f"{part:5} {words(page):6} {page}")
    guide, lab = (sum(words(p) for p in split[part]) for part in ("guide", "lab"))
    print(f"user guide: {guide} words in {len(split['guide'])} pages (limit {GUIDE_WORD_LIMIT})")
    print(f"lab notebook: {lab} words in {len(split['lab'])} pages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

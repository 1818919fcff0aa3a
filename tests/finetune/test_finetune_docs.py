"""The fine-tuning docs as code: the Python recipe of docs/finetune.md runs as written (steps shrunk),
and no page, config or message names the `huggingface-cli` command that huggingface_hub no longer has."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def python_block_under(page: Path, heading: str) -> str:
    """The first ```python block after the Markdown heading ``heading`` of ``page``."""
    text = page.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    block = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert block, f"no python block under {heading!r} in {page.name}"
    return block.group(1)


@pytest.mark.timeout(120)
def test_finetune_pieces_from_python_recipe_runs(tmp_path, monkeypatch):
    code = python_block_under(REPO / "docs" / "finetune.md", "## The pieces, from Python")
    assert "max_steps=40" in code  # the step count the page shows, shrunk here
    monkeypatch.chdir(tmp_path)  # the recipe writes outputs/adapter and the Trainer's logs relative to the cwd
    namespace: dict = {}
    exec(compile(code.replace("max_steps=40", "max_steps=2"), "docs/finetune.md", "exec"), namespace)
    assert namespace["trainer"].global_step == 2
    assert (tmp_path / "outputs" / "adapter" / "adapter_config.json").is_file()
    # The module and the DataModule saved model_path alike (Lightning merges them into one hparams set).
    assert namespace["model"].hparams["model_path"] == namespace["data"].hparams["model_path"]


def test_no_file_names_the_removed_huggingface_cli():
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    this_file = Path(__file__).relative_to(REPO).as_posix()
    hits = [name for name in listed if name != this_file and (REPO / name).is_file()
            and "huggingface-cli" in (REPO / name).read_text(encoding="utf-8", errors="ignore")]
    assert hits == [], f"`huggingface-cli` is gone from huggingface_hub; write `hf download REPO --local-dir DIR` in {hits}"

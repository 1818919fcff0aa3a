"""Files shipped with the package: a tiny pretrained Qwen3, a tiny Llama, a Shakespeare text,
tiny text and chat data sets made from it, and a chat template for the tiny tokenizer.

They let the default fine-tuning job and the tests run with no download. See ``README.md`` in
this directory for where each file comes from and how to regenerate the models.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

ASSETS_DIR = Path(str(resources.files(__name__)))  # a real folder: Hugging Face loaders need paths

# Public names -> location relative to this directory.
_NAMES = {
    "tiny-qwen3": "tiny-qwen3",
    "tiny-llama": "tiny-llama",
    "shakespeare.txt": "data/shakespeare.txt",
    # Tiny examples of each data format (scripts/make_tiny_data.py) and a chat template for the tiny tokenizer.
    "text_tiny.jsonl": "data/text_tiny.jsonl",
    "text_tiny.parquet": "data/text_tiny.parquet",
    "chat_tiny.jsonl": "data/chat_tiny.jsonl",
    "tiny_chat_template.jinja": "data/tiny_chat_template.jinja",
}


def names() -> list[str]:
    """The names that ``path`` resolves."""
    return sorted(_NAMES)


def path(name: str) -> Path:
    """Absolute path of the shipped asset ``name`` (one of ``names``: "tiny-qwen3", "shakespeare.txt", ...).

    Raises ``KeyError`` for an unknown name and ``FileNotFoundError`` when the asset is missing
    (the models are made by ``scripts/make_tiny_models.py``).
    """
    if name not in _NAMES:
        raise KeyError(f"unknown asset {name!r}; known assets: {', '.join(names())}")
    resolved = ASSETS_DIR / _NAMES[name]
    if not resolved.exists():
        raise FileNotFoundError(
            f"asset {name!r} is missing at {resolved}; regenerate it with "
            "`python scripts/make_tiny_models.py`"
        )
    return resolved

"""Hydra/OmegaConf support for the fine-tuning configs in ``conf/``.

``conf/model/tiny_*.yaml`` locate the shipped models with ``${asset:tiny-qwen3}``; call
:func:`register_resolvers` before resolving such a config (the example job does).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from .. import assets
from .checks import FineTuneInputError


def register_resolvers() -> None:
    """Register ``${asset:NAME}`` (the path of a shipped asset); safe to call more than once."""
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", lambda name: str(assets.path(name)))


def check_no_missing(cfg: DictConfig) -> None:
    """Raise if a required value (``???``, such as a real model's ``model.path``) was not given."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        examples = " ".join(f"{key}=..." for key in missing)
        raise FineTuneInputError(
            f"required config values not set: {', '.join(missing)}. Give them on the command line, "
            f"e.g. `python examples/finetune.py ... {examples}` (model.path: a local model directory)."
        )

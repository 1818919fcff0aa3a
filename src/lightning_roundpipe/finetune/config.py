"""Hydra/OmegaConf support for the fine-tuning configs in ``conf/``.

``conf/model/tiny_*.yaml`` locate the shipped models with ``${asset:tiny-qwen3}`` and
``conf/config.yaml`` puts outputs in ``${run_dir:outputs/finetune}``; call
:func:`register_resolvers` before resolving such a config (the example job does).
"""

from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .. import assets
from .checks import FineTuneInputError


RUN_DIR_NOT_YET = "<Hydra's run directory>"
"""What ``${run_dir:...}`` shows when Hydra has not made the directory yet (``--cfg job --resolve``)."""


def run_dir(fallback: str) -> str:
    """Hydra's output directory of the running job; ``fallback`` outside a Hydra run (compose API)."""
    if not HydraConfig.initialized():
        return fallback
    directory = OmegaConf.select(HydraConfig.get(), "runtime.output_dir", default=None)
    return RUN_DIR_NOT_YET if directory is None else directory


def register_resolvers() -> None:
    """Register ``${asset:NAME}`` (the path of a shipped asset) and ``${run_dir:FALLBACK}``
    (:func:`run_dir`); safe to call more than once."""
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", lambda name: str(assets.path(name)))
    if not OmegaConf.has_resolver("run_dir"):
        OmegaConf.register_new_resolver("run_dir", run_dir)


def check_no_missing(cfg: DictConfig) -> None:
    """Raise if a required value (``???``, such as a real model's ``model.path``) was not given."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        examples = " ".join(f"{key}=..." for key in missing)
        raise FineTuneInputError(
            f"required config values not set: {', '.join(missing)}. Give them on the command line, "
            f"e.g. `python examples/finetune.py ... {examples}` (model.path: a local model directory)."
        )

"""Hydra/OmegaConf support for the fine-tuning configs in ``conf/``.

``conf/model/tiny_*.yaml`` locate the shipped models with ``${asset:tiny-qwen3}`` and
``conf/config.yaml`` puts outputs in ``${run_dir:outputs/finetune}``; call
``register_resolvers`` before resolving such a config (the example job does).
``check_job_values`` checks the values the job hands to Lightning and the optimizer before
the job loads or runs anything, naming the key to change.
"""

from __future__ import annotations

import math
import numbers

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .. import assets
from .checks import FineTuneInputError
from .module import OptimOptions


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
    (``run_dir``); safe to call more than once."""
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


def _whole(value, minimum: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def _number(value, minimum: float) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value >= minimum)


def _fraction_or_count(value) -> bool:  # Lightning's float-or-int options: a share of the epoch or a count
    return _whole(value, 0) or (_number(value, 0.0) and value <= 1.0)


# key of cfg.trainer -> (test, what it must be)
TRAINER_VALUES = {
    "max_steps": (lambda v: _whole(v, -1), "a whole number >= 0 (-1: no limit)"),
    "devices": (lambda v: _whole(v, 1) or v == "auto", "a whole number >= 1 or 'auto'"),
    "log_every_n_steps": (lambda v: _whole(v, 1), "a whole number >= 1"),
    "accumulate_grad_batches": (lambda v: _whole(v, 1), "a whole number >= 1"),
    "val_check_interval": (lambda v: _whole(v, 1) or (_number(v, 0.0) and 0 < v <= 1),
                           "a whole number of batches >= 1 or a fraction of the epoch in (0, 1]"),
    "limit_val_batches": (lambda v: v is None or _fraction_or_count(v),
                          "null, a whole number of batches or a fraction in [0, 1]"),
    "gradient_clip_val": (lambda v: v is None or _number(v, 0.0), "null or a number >= 0"),
}
DATA_VALUES = {
    "batch_size": (lambda v: _whole(v, 1), "a whole number >= 1"),
    "seq_len": (lambda v: _whole(v, 1), "a whole number >= 1"),
}


def check_job_values(cfg: DictConfig) -> None:
    """Raise ``FineTuneInputError`` naming the first key of ``trainer``, ``data`` or ``optim``
    whose value the run cannot use (``trainer.max_steps=abc``, ``optim.lr=-1``), before anything runs."""
    for group, rules in (("trainer", TRAINER_VALUES), ("data", DATA_VALUES)):
        values = cfg.get(group) or {}
        for key, (ok, rule) in rules.items():
            if key in values and not ok(values[key]):
                raise FineTuneInputError(f"{group}.{key}={values[key]!r}: must be {rule}; change it on the command "
                                         f"line (`python examples/finetune.py {group}.{key}=...`) or in conf/{group}/.")
    OptimOptions.parse(OmegaConf.to_container(cfg.optim, resolve=True) if cfg.get("optim") is not None else None)

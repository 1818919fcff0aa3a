"""The fine-tuning job's Hydra keys turned into Trainer arguments, loggers and callbacks, refusing
every key the job would otherwise ignore.

``trainer.*`` keys go to ``lightning.pytorch.Trainer`` as they are (``+trainer.max_epochs=7``
takes effect), except the few the job sets itself from other groups (``strategy``, ``logger``,
``callbacks``); ``logger`` and ``callbacks.*`` are ``_target_`` configs instantiated with
``hydra.utils.instantiate`` (``conf/logger/``, ``conf/callbacks/``). A key that is neither read by
the job nor an argument of what it builds raises ``FineTuneInputError`` naming the key, so a
typo or a ``+key`` the job does not read never passes silently.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Iterable

import hydra
import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf

from .checks import FineTuneInputError

TOP_LEVEL_KEYS = {"model", "data", "strategy", "partition", "transfer", "trainer", "lora", "optim", "logger",
                  "callbacks", "seed", "out_dir", "trace", "trace_steps", "ckpt_path"}
"""The keys of ``conf/config.yaml`` the job reads; any other top-level key is refused."""

MODEL_KEYS = {"path", "tokenizer", "dtype"}
"""The ``model.*`` keys the job reads (``conf/model/``)."""

TRAINER_KEYS_FROM_GROUPS = {
    "strategy": "pick it with strategy=roundpipe|default and its keys (strategy.microbatches=...)",
    "logger": "pick it with logger=csv|tensorboard|none",
    "callbacks": "add them with callbacks=[model_checkpoint,lr_monitor] (conf/callbacks/)",
}
"""Trainer arguments the job sets from other config groups, with where to set them instead."""

STRATEGY_KEYS_FROM_JOB = {"trace_steps": 0, "trace_dir": None}
"""RoundPipe options the job sets from its top-level ``trace``/``trace_steps`` (their defaults)."""


def refuse_unknown(keys: Iterable[str], known: Iterable[str], where: str, what_to_do: str) -> None:
    """Raise naming the first of ``keys`` not in ``known`` (``where``: the key prefix, e.g. ``trainer.``)."""
    unknown = sorted(set(keys) - set(known))
    if unknown:
        raise FineTuneInputError(f"{where}{unknown[0]} is not read by the fine-tuning job: {what_to_do}. "
                                 f"Remove it from the command line (or from conf/).")


def check_keys_are_read(cfg: DictConfig, data_module_class: type) -> None:
    """Refuse a top-level, ``model.*``, ``data.*``, ``trainer.*``, ``callbacks.*`` or RoundPipe trace key
    that the job would ignore; called before anything loads."""
    refuse_unknown(cfg.keys(), TOP_LEVEL_KEYS, "", f"the job reads only {sorted(TOP_LEVEL_KEYS)}")
    refuse_unknown((cfg.get("model") or {}).keys(), MODEL_KEYS, "model.", f"the model keys are {sorted(MODEL_KEYS)}")
    parameters = inspect.signature(data_module_class).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):  # **kwargs reads any key
        data_keys = set(parameters) - {"model_path", "tokenizer", "seed"}  # those come from model.* and seed
        refuse_unknown((cfg.get("data") or {}).keys(), data_keys, "data.",
                       f"the keys of {data_module_class.__name__} are {sorted(data_keys)}")
    strategy = cfg.get("strategy") or {}
    for key, default in STRATEGY_KEYS_FROM_JOB.items():
        if strategy.get(key, default) != default:
            raise FineTuneInputError(
                f"strategy.{key}={strategy.get(key)!r}: the job sets the strategy's trace from the top-level keys, "
                f"so this would be overridden. Use trace=true trace_steps=N instead (the trace goes to out_dir).")
    check_trainer_keys((cfg.get("trainer") or {}).keys())
    check_callback_entries(cfg.get("callbacks"))


def check_trainer_keys(keys: Iterable[str]) -> None:
    """Refuse a ``trainer.*`` key that is no Trainer argument, or that another config group sets."""
    for key in keys:
        if key in TRAINER_KEYS_FROM_GROUPS:
            raise FineTuneInputError(f"trainer.{key} is set by the job from its own config group: "
                                     f"{TRAINER_KEYS_FROM_GROUPS[key]}. Remove trainer.{key}.")
    refuse_unknown(keys, inspect.signature(pl.Trainer).parameters, "trainer.",
                   "it is not an argument of lightning.pytorch.Trainer (check the spelling)")


def check_callback_entries(callbacks_cfg: DictConfig | None) -> None:
    """Every ``callbacks.<name>`` must be a ``_target_`` config."""
    for name, entry in (callbacks_cfg or {}).items():
        if not (OmegaConf.is_dict(entry) and entry.get("_target_")):
            raise FineTuneInputError(f"callbacks.{name} has no _target_: each entry of callbacks is a callback "
                                     "config, e.g. callbacks=[model_checkpoint,lr_monitor] (conf/callbacks/).")


def trainer_arguments(trainer_cfg: DictConfig, job_set: dict[str, Any]) -> dict[str, Any]:
    """``Trainer(**...)`` keyword arguments: ``trainer_cfg`` as given, over ``job_set`` (the job's own
    defaults such as ``max_epochs``); refuses keys that are no Trainer argument or that another group sets."""
    given = OmegaConf.to_container(trainer_cfg, resolve=True)
    check_trainer_keys(given)
    return {**job_set, **given}


def build_logger(logger_cfg: DictConfig | None) -> Any:
    """The Trainer's ``logger``: ``False`` for ``logger=none`` (or null), else the instantiated ``_target_``."""
    if logger_cfg is None or not logger_cfg.get("_target_"):
        if logger_cfg:
            raise FineTuneInputError(f"logger {OmegaConf.to_container(logger_cfg)} has no _target_; pick "
                                     "logger=csv|tensorboard|none or give logger._target_=<a Lightning logger class>.")
        return False
    return hydra.utils.instantiate(logger_cfg)


def build_callbacks(callbacks_cfg: DictConfig | None) -> list[pl.Callback]:
    """The callbacks of ``callbacks.<name>`` (each a ``_target_`` config), in the order given."""
    check_callback_entries(callbacks_cfg)
    return [hydra.utils.instantiate(entry) for entry in (callbacks_cfg or {}).values()]


def checked_ckpt_path(ckpt_path: str | None) -> str | None:
    """``ckpt_path`` to resume from (``None``: start fresh); refuses a path that is not a file."""
    if ckpt_path is None:
        return None
    if not Path(ckpt_path).expanduser().is_file():
        raise FineTuneInputError(f"ckpt_path={ckpt_path!r} is not a file: give the checkpoint of an earlier run to "
                                 "resume from, e.g. ckpt_path=outputs/<date>/<time>/last.ckpt, or leave ckpt_path out.")
    return str(Path(ckpt_path).expanduser())

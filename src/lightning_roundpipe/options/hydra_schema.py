"""The Hydra schemas of the options, derived from their dataclasses' fields.

The option dataclasses are frozen, and OmegaConf makes a frozen dataclass a read-only config that
YAML cannot be merged onto; so each schema is a mutable twin with the same fields, types and
defaults (``hydra_schema``). ``register_configs`` stores them where the YAML files under ``conf/``
extend them (the library itself imports neither Hydra nor OmegaConf).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field, fields

from .groups import PartitionConfig, TransferConfig
from .strategy import StrategyOptions


def hydra_schema(cls, name: str | None = None, skip=(), extra=()):
    """A mutable dataclass with ``cls``'s fields (but ``skip``; nested option groups as their own
    twins) after ``extra`` ``(name, type, field)`` entries: what Hydra checks a config group against."""
    hints = typing.get_type_hints(cls)
    own = []
    for f in fields(cls):
        if f.name in skip:
            continue
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            kind = hydra_schema(kind)
            own.append((f.name, kind, field(default_factory=kind)))
        elif f.default is not dataclasses.MISSING:
            own.append((f.name, kind, field(default=f.default)))
        else:
            own.append((f.name, kind, field(default_factory=f.default_factory)))
    return dataclasses.make_dataclass(name or cls.__name__ + "Schema", [*extra, *own],
                                      namespace={"__module__": __name__, "__doc__": cls.__doc__})


def strategy_config_class():
    """The Hydra node of ``conf/strategy/roundpipe.yaml``: the strategy's options minus the groups
    ``partition`` and ``transfer`` (top-level Hydra groups of their own) and ``compute_dtype``
    (set from the Trainer's precision), plus ``_target_``."""
    target = ("_target_", str, field(default="lightning_roundpipe.RoundPipeStrategy"))
    return hydra_schema(StrategyOptions, "RoundPipeStrategyConfig", skip={"partition", "transfer", "compute_dtype"},
                        extra=[target])


def register_configs() -> bool:
    """Store the structured configs the YAML files under ``conf/`` extend (``defaults: [<name>, _self_]``);
    False, storing nothing, where Hydra or OmegaConf cannot be imported (a training run needs neither).

    ``strategy/roundpipe_schema``, ``partition/partition_schema`` (``manual_partition_schema`` for
    ``policy: manual``, whose ranges are required) and ``transfer/transfer_schema``:
    Hydra then checks types and rejects unknown keys when it composes the job's config.
    """
    try:
        from hydra.core.config_store import ConfigStore
        from omegaconf import OmegaConf
    except ImportError:  # the fine-tuning job's dependencies, not the library's
        return False

    store = ConfigStore.instance()
    partition = hydra_schema(PartitionConfig)
    store.store(group="strategy", name="roundpipe_schema", node=strategy_config_class())
    store.store(group="partition", name="partition_schema", node=partition)
    # policy=manual: the layer ranges are required (Hydra's "???"), which a merge onto None would drop
    store.store(group="partition", name="manual_partition_schema",
                node=OmegaConf.structured(partition(policy="manual", manual_forward="???")))
    store.store(group="transfer", name="transfer_schema", node=hydra_schema(TransferConfig))
    return True

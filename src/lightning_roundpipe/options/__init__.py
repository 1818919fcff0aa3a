"""Every option of RoundPipe, defined once and checked once.

The user sets ``RuntimeOptions`` (the Lightning-free runtime) or ``StrategyOptions`` (the
strategy's keywords: the same plus Lightning's), with the groups ``partition``, ``transfer`` and
``testing``; each is a frozen dataclass validated when constructed, its errors naming the option as
the caller spelled it (``RoundPipeStrategy(timeout=nan)``, ``RuntimeOptions(timeout=nan)``). The
runtime's parts get frozen sub-configs built from it: ``EngineOptions`` (the engine and the
lowering), ``KeeperConfig`` (the plan keeper), ``OverlapConfig`` (the overlapped optimizer). The
strategy's signature (``keywords``) and the Hydra schemas (``hydra_schema``) derive from the fields.
"""

from ..errors import OptionError
from ..option_checks import plain
from ..optim.overlap_config import OverlapConfig
from ..planning.keeper_config import KeeperConfig
from ..schedule.step_options import EARLY_STOP_NEEDS_COMPILE, TRANSFER_KINDS, EngineOptions, check_priorities
from .groups import MOVED_TO_TESTING, PARTITION_POLICIES, PartitionConfig, TestingOptions, TransferConfig
from .hydra_schema import hydra_schema, register_configs, strategy_config_class
from .overlap_rule import overlap_optimizer_default, usable_cores
from .runtime import BATCH_STATISTICS, MOE_EXPERT_PATHS, PINNED_POLICIES, RECOMPUTE_CHOICES, RuntimeOptions
from .strategy import StrategyOptions, option_names, refuse_unknown_options, strategy_options

__all__ = [
    "BATCH_STATISTICS", "EARLY_STOP_NEEDS_COMPILE", "MOE_EXPERT_PATHS", "MOVED_TO_TESTING", "PARTITION_POLICIES",
    "PINNED_POLICIES", "RECOMPUTE_CHOICES", "TRANSFER_KINDS", "EngineOptions", "KeeperConfig", "OptionError",
    "OverlapConfig", "PartitionConfig", "RuntimeOptions", "StrategyOptions", "TestingOptions", "TransferConfig",
    "check_priorities", "hydra_schema", "option_names", "overlap_optimizer_default", "plain", "refuse_unknown_options",
    "register_configs", "strategy_config_class", "strategy_options", "usable_cores",
]

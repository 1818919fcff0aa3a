"""``StrategyOptions``: the keyword arguments of ``RoundPipeStrategy``, the runtime's plus Lightning's.

``strategy_options`` builds them from keywords; ``refuse_unknown_options`` says what to write instead
of an option that does not exist (a misspelling, or a testing knob that moved into ``testing``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Mapping, Optional

from ..option_checks import choice, fail, flag, plain, whole_number
from .groups import MOVED_TO_TESTING
from .runtime import RuntimeOptions


@dataclass(frozen=True)
class StrategyOptions(RuntimeOptions):
    """The keyword arguments of ``RoundPipeStrategy``: the runtime's options plus those about Lightning.

    module: dotted attribute path of the module to pipeline (None: found automatically).
    workers: expected number of workers; must equal the Trainer's ``devices`` when given.
    trace_dir: where the timeline of ``trace_steps`` goes (None: the trainer's ``default_root_dir``);
        checked writable before training starts.
    checkpoint_weights: "full" (the whole ``state_dict``, as Lightning's default strategy saves:
        resumable under any strategy) or "trainable" (only trainable weights and buffers: the
        small LoRA checkpoint, whose frozen base comes from the model path).
    progress_bar_metrics: also show the ``roundpipe/*`` step and memory metrics (``step_metrics``)
        in the progress bar; False (default): they reach the loggers only, and the progress bar
        keeps Lightning's figures and the job's one ``tokens_per_s``.
    log_step_metrics: log the ``roundpipe/*`` step and memory metrics to the Trainer's loggers
        (True, default). False keeps them out of your logger; ``step_metrics`` still measures them
        (``strategy.runtime.last_metrics`` during fit).
    verify_checkpoints: check every entry of a checkpoint against the CRC-32 stored in it before
        loading it, and refuse a changed file (``CheckpointIntegrityError`` naming the file). Off by
        default: it added 24% and 36% to a 1 GiB load in two runs here (0.82 s of CRC-32 on a 1.73 s load,
        0.45 s on 1.03 s; ``python -m benchmarks.calibration.checkpoint_integrity``), over the 5% a default may cost.
    """

    module: Optional[str] = None
    workers: Optional[int] = None
    trace_dir: Optional[str] = None
    checkpoint_weights: str = "full"
    progress_bar_metrics: bool = False
    log_step_metrics: bool = True
    verify_checkpoints: bool = False

    OWNER: ClassVar[str] = "RoundPipeStrategy"

    def validate(self, owner: str | None = None) -> "StrategyOptions":
        """Check every field (done at construction); errors name ``owner`` (default: ``RoundPipeStrategy``)."""
        owner = owner or self.OWNER
        super().validate(owner)
        whole_number(owner, "workers", self.workers, 1, allow_none=True)
        choice(owner, "checkpoint_weights", self.checkpoint_weights, ("full", "trainable"))
        flag(owner, "progress_bar_metrics", self.progress_bar_metrics)
        flag(owner, "log_step_metrics", self.log_step_metrics)
        flag(owner, "verify_checkpoints", self.verify_checkpoints)
        if self.module is not None and not isinstance(self.module, str):
            fail(owner, "module", self.module, "give the dotted attribute path of the module to pipeline, e.g. 'model.net'")
        return self

    def runtime_options(self) -> RuntimeOptions:
        """The runtime's share of these options (all but those about Lightning)."""
        return RuntimeOptions(**{f.name: getattr(self, f.name) for f in fields(RuntimeOptions)})


def option_names() -> set[str]:
    """The strategy's keyword options: ``StrategyOptions``' fields but ``compute_dtype`` (set from the
    Trainer's precision)."""
    return {f.name for f in fields(StrategyOptions)} - {"compute_dtype"}


def refuse_unknown_options(owner: str, given: Mapping[str, Any], known: set[str]) -> None:
    """A ``TypeError`` saying what to write instead, for the keywords of ``given`` not in ``known``."""
    moved = sorted(set(given) & set(MOVED_TO_TESTING))
    if moved:
        spelled = ", ".join(f"{MOVED_TO_TESTING[name]!r}: {given[name]!r}" for name in moved)
        raise TypeError(f"{owner}({moved[0]}=...): the testing knobs {moved} moved into the testing options: "
                        f"pass testing={{{spelled}}}")
    unknown = sorted(set(given) - known)
    if unknown:
        raise TypeError(f"{owner}() got unknown option(s) {unknown}; the options are {sorted(known)}")


def strategy_options(owner: str = "RoundPipeStrategy", **values: Any) -> StrategyOptions:
    """Validated ``StrategyOptions`` from keyword arguments; an unknown keyword names the known ones."""
    refuse_unknown_options(owner, values, option_names())
    return StrategyOptions(**{k: plain(v) for k, v in values.items()})

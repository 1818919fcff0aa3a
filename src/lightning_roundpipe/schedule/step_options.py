"""What decides how a step runs and what its graph is: ``EngineOptions`` and ``LoweringOptions``.

``EngineOptions`` is the engine's share of the user's options (``RuntimeOptions.engine_options``),
or what a user of the Lightning-free engine constructs; frozen and checked when constructed. The
lowering reads it as it is: ``LoweringOptions`` adds only the kind of the call being lowered.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..option_checks import choice, fail, flag, whole_number
from .dispatch_order import SCHEDULES, Schedule, schedule_named
from .graph_task import DEFAULT_PRIORITIES

TRANSFER_KINDS = tuple(DEFAULT_PRIORITIES)  # the kinds a transfer priority is given for
EARLY_STOP_NEEDS_COMPILE = ("the early-stopping recompute is a compiled graph: it needs compiled layers "
                            "(compile_layers=True; on the CPU backend layers run eagerly unless it is set)")


def check_priorities(owner: str, name: str, priorities: Any) -> None:
    """Check that ``priorities`` gives a finite number for every transfer kind and nothing else."""
    if not isinstance(priorities, Mapping):
        fail(owner, name, priorities, f"must map each of {list(TRANSFER_KINDS)} to a number")
    missing = sorted(set(TRANSFER_KINDS) - set(priorities))
    if missing:
        fail(owner, name, priorities, f"priorities must give a number for {missing}")
    unknown = sorted(set(priorities) - set(TRANSFER_KINDS))
    if unknown:
        fail(owner, name, priorities, f"unknown transfer kind(s) {unknown}; the kinds are {list(TRANSFER_KINDS)}")
    for kind, rank in priorities.items():
        if isinstance(rank, bool) or not isinstance(rank, numbers.Real) or not math.isfinite(rank):
            fail(owner, name, priorities, f"the priority of {kind!r} must be a number (lower is served first), got {rank!r}")


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs a plan (what ``RuntimeOptions`` hands to ``PipelineEngine``); the lowering
    reads the same object (``LoweringOptions`` below).

    microbatches: number of microbatches a batch is split into (dim 0).
    recompute: True keeps only stage inputs in forward and recomputes in backward (bounded
        memory); False keeps each forward graph until backward (CPU backend only: its workers
        share memory) and needs backward stages cut like forward ones.
    layer_recompute: with ``recompute``, a backward (or fused) stage recomputes and
        back-propagates one layer at a time: it first runs its layers without grad keeping only
        each layer's input, then recomputes each layer with grad from the last to the first, so
        one layer's graph is alive instead of the whole stage's (one more forward of the stage).
    compute_dtype: dtype floating parameters are cast to on upload (None: as stored on host).
    compile_layers: run each layer through ``torch.compile`` on the workers (``engine/compiled_layers.py``).
    recompute_early_stop: with ``recompute`` and ``compile_layers``, the last layer of each backward
        stage (every layer, at layer grain) recomputes and back-propagates as one compiled vjp graph,
        which leaves out the forward work only its output needs (``engine/early_stop.py``).
    early_stop_required: with ``recompute_early_stop``, a layer the vjp cannot check (its forward does not
        run on meta tensors) fails the step (True, the option asked for explicitly); False (the option's
        default resolved on): that layer recomputes whole instead, as without the option.
    priorities, chunk_bytes, prefetch_depth: as in ``TransferConfig``.
    measure_tasks: keep every compute task's trace record until the step's measurements are
        read (``StepRun.measurements``, what the cost profile and the re-planner learn from),
        even when no timeline is recorded.
    schedule: the dispatch order's name (``schedule/dispatch_order.SCHEDULES``): which worker runs
        each stage, and where the next call starts.
    """

    microbatches: int = 2
    recompute: bool = True
    layer_recompute: bool = False
    compute_dtype: Any = None
    compile_layers: bool = False
    recompute_early_stop: bool = False
    early_stop_required: bool = True
    priorities: dict = field(default_factory=lambda: dict(DEFAULT_PRIORITIES))
    chunk_bytes: int = 32 << 20
    prefetch_depth: int = 1
    measure_tasks: bool = True
    schedule: str = "round_robin"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, owner: str = "EngineOptions") -> "EngineOptions":
        """Check every field; errors name ``owner``."""
        whole_number(owner, "microbatches", self.microbatches, 1)
        flag(owner, "recompute", self.recompute)
        flag(owner, "layer_recompute", self.layer_recompute)
        if self.layer_recompute and not self.recompute:
            fail(owner, "layer_recompute", self.layer_recompute,
                 "layer-grain recompute is a way of recomputing: it needs recompute=True")
        flag(owner, "measure_tasks", self.measure_tasks)
        flag(owner, "compile_layers", self.compile_layers)
        flag(owner, "recompute_early_stop", self.recompute_early_stop)
        flag(owner, "early_stop_required", self.early_stop_required)
        if self.recompute_early_stop and not self.compile_layers:
            fail(owner, "recompute_early_stop", self.recompute_early_stop, EARLY_STOP_NEEDS_COMPILE)
        check_priorities(owner, "priorities", self.priorities)
        whole_number(owner, "chunk_bytes", self.chunk_bytes, 1)
        whole_number(owner, "prefetch_depth", self.prefetch_depth, 0)
        choice(owner, "schedule", self.schedule, tuple(SCHEDULES))
        return self


@dataclass(frozen=True)
class LoweringOptions:
    """What, besides the plan, decides a step's graph: the engine's options and the call's kind.

    engine: the engine's options (``EngineOptions``), read as they are: ``microbatches``,
        ``recompute`` (False keeps every forward graph until its backward), ``layer_recompute``
        (backward and fused computes recompute one layer at a time, ``grain="layer"``),
        ``prefetch_depth``, ``priorities`` and ``schedule`` (which worker runs each stage, and where
        the next call starts: ``dispatch_order``).
    training: backward stages are lowered too (False: an evaluation forward).
    fused: the plan's fused last stage runs fused (the loss is computed inside the pipeline).
    kept_backward: with ``recompute`` False, the backward stages run on the kept graphs; False:
        they recompute from the stage inputs on the host, as with recompute (a call's second
        backward: its first one freed the kept graphs).
    input_gradient: the input gradient of layer 0 comes home (the caller's input needs grad).
    first_serial: serial of the first stage, continuing the previous steps' (transfer priorities).
    """

    engine: EngineOptions = field(default_factory=EngineOptions)
    training: bool = True
    fused: bool = False
    kept_backward: bool = True
    input_gradient: bool = False
    first_serial: int = 0

    # The engine's fields the passes read, under their own names.
    microbatches = property(lambda self: self.engine.microbatches)
    recompute = property(lambda self: self.engine.recompute)
    layer_recompute = property(lambda self: self.engine.layer_recompute)
    prefetch_depth = property(lambda self: self.engine.prefetch_depth)
    priorities = property(lambda self: self.engine.priorities)

    @property
    def schedule(self) -> Schedule:
        """The dispatch order the engine's options name."""
        return schedule_named(self.engine.schedule)

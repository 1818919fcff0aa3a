"""The plan: which layers form each stage, and which worker runs each stage, as plain data.

A plan has forward stages and backward stages, each a contiguous layer range ``[start, end)``.
They may be cut differently (backward with recompute costs about three times the forward, so
backward stages usually hold fewer layers). Backward stages are listed in layer order and
dispatched in reverse. When ``fused_last`` is set, the last forward stage also runs the backward
of its layers at once (the loss is computed inside the pipeline), so the last backward stage
must equal it and is not dispatched again.

The plan has a one-line text form, ``F 0:3 3:6 | B 0:2 2:4 4:6``, with ``| fused`` appended when
the last stage is fused; ``Plan.from_text`` parses it back. Nothing here touches tensors:
the executor runs a plan, the simulator times it and the trace draws it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import PlanError

Direction = Literal["F", "B"]
LayerRange = tuple[int, int]


@dataclass(frozen=True)
class Stage:
    """One run of consecutive layers in one direction."""

    direction: Direction
    index: int  # position among the stages of its direction, in layer order
    start: int  # first layer
    end: int  # one past the last layer

    @property
    def layers(self) -> range:
        """The stage's layer indices."""
        return range(self.start, self.end)

    @property
    def name(self) -> str:
        """``F<index>`` or ``B<index>``."""
        return f"{self.direction}{self.index}"

    def __str__(self) -> str:
        return f"{self.name}[{self.start}:{self.end}]"


@dataclass(frozen=True)
class DispatchedStage:
    """A stage dispatched to a worker; ``order`` is its place in the step's dispatch sequence."""

    order: int
    stage: Stage
    worker: int


@dataclass(frozen=True)
class PlanFacts:
    """What the policy that made a plan knew and predicted; not part of the plan's identity.

    The assumptions (``link_bytes_per_second``, ``stage_overhead_s``, ``recompute``,
    ``memory_budget_bytes``) are kept so that a re-plan works under the same ones.
    """

    policy: str = ""
    num_workers: int | None = None
    microbatches: int | None = None
    predicted_step_s: float | None = None
    predicted_bubble: float | None = None
    stage_seconds: dict[str, float] = field(default_factory=dict)  # per dispatched stage, e.g. "F0", "B3"
    stage_memory_bytes: dict[str, int] = field(default_factory=dict)
    max_stage_s: float | None = None  # the costliest stage, for policies that balance stages only
    link_bytes_per_second: float | None = None
    stage_overhead_s: float | None = None
    recompute: bool | None = None
    memory_budget_bytes: int | None = None


@dataclass(frozen=True)
class Plan:
    """Forward and backward layer ranges for a model of ``num_layers`` layers."""

    num_layers: int
    forward: tuple[LayerRange, ...]
    backward: tuple[LayerRange, ...]
    fused_last: bool = False
    facts: PlanFacts = field(default_factory=PlanFacts, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward", tuple((int(a), int(b)) for a, b in self.forward))
        object.__setattr__(self, "backward", tuple((int(a), int(b)) for a, b in self.backward))

    # ----------------------------------------------------------------- checks
    def validate(self) -> "Plan":
        """Raise ``PlanError`` naming the first problem; return ``self`` when the plan is sound."""
        if self.num_layers < 1:
            raise PlanError(f"a plan needs at least one layer, got num_layers={self.num_layers}")
        for direction, ranges in (("forward", self.forward), ("backward", self.backward)):
            if not ranges:
                raise PlanError(f"the plan has no {direction} stages")
            expected = 0
            for i, (start, end) in enumerate(ranges):
                if start != expected:
                    what = "overlaps the previous stage" if start < expected else "leaves a gap"
                    missing = f" (layers {expected}..{start - 1} are in no stage)" if start > expected else ""
                    raise PlanError(
                        f"{direction} stage {i} [{start}:{end}] {what}: it must start at layer {expected}{missing}"
                    )
                if end <= start:
                    raise PlanError(f"{direction} stage {i} [{start}:{end}] is empty: every stage needs at least one layer")
                expected = end
            if expected != self.num_layers:
                raise PlanError(
                    f"{direction} stages end at layer {expected} but the model has {self.num_layers} layers: "
                    f"layers {expected}..{self.num_layers - 1} are in no stage"
                    if expected < self.num_layers
                    else f"{direction} stages reach layer {expected - 1} but the model has only {self.num_layers} layers"
                )
        if self.fused_last and self.forward[-1] != self.backward[-1]:
            raise PlanError(
                f"a fused last stage runs forward and backward of the same layers, but the last forward stage is "
                f"{list(self.forward[-1])} and the last backward stage is {list(self.backward[-1])}"
            )
        return self

    # ----------------------------------------------------------------- views
    def forward_stages(self) -> list[Stage]:
        """The forward stages, in order."""
        return [Stage("F", i, a, b) for i, (a, b) in enumerate(self.forward)]

    def backward_stages(self) -> list[Stage]:
        """The backward stages, in order of their ranges."""
        return [Stage("B", i, a, b) for i, (a, b) in enumerate(self.backward)]

    def dispatched_backward_stages(self) -> list[Stage]:
        """Backward stages in execution order (last layers first), without the fused one."""
        stages = self.backward_stages()
        if self.fused_last:
            stages = stages[:-1]
        return list(reversed(stages))

    def saved_boundaries(self) -> list[int]:
        """Layers whose input the forward keeps on the host for recompute: every backward stage start."""
        return sorted({a for a, _ in self.backward})

    def same_cuts(self) -> bool:
        """Whether forward and backward are cut the same way."""
        return self.forward == self.backward

    def with_facts(self, facts: PlanFacts) -> "Plan":
        """The same plan with ``facts`` attached."""
        return Plan(self.num_layers, self.forward, self.backward, self.fused_last, facts)

    @property
    def fused_stage(self) -> str | None:
        """Name of the fused last stage (the last forward one), or None."""
        return f"F{len(self.forward) - 1}" if self.fused_last else None

    # ----------------------------------------------------------------- text form
    def to_text(self) -> str:
        """The plan's text form, ``F 0:2 2:4 | B 0:1 1:4`` (``from_text`` reads it back)."""
        fwd = " ".join(f"{a}:{b}" for a, b in self.forward)
        bwd = " ".join(f"{a}:{b}" for a, b in self.backward)
        return f"F {fwd} | B {bwd}" + (" | fused" if self.fused_last else "")

    @classmethod
    def from_text(cls, text: str, num_layers: int | None = None) -> "Plan":
        """Read a plan's text form; malformed text is refused with ``PlanError``."""
        parts = [p.strip() for p in text.split("|")]
        if len(parts) not in (2, 3) or not parts[0].startswith("F") or not parts[1].startswith("B"):
            raise PlanError(f"cannot parse plan text {text!r}: expected 'F a:b c:d | B a:b ... [| fused]'")
        fused = len(parts) == 3
        if fused and parts[2] != "fused":
            raise PlanError(f"cannot parse plan text {text!r}: the third part may only be 'fused'")

        def ranges(part: str) -> tuple[LayerRange, ...]:
            out = []
            for item in part[1:].split():
                try:
                    a, b = item.split(":")
                    out.append((int(a), int(b)))
                except ValueError:
                    raise PlanError(f"cannot parse layer range {item!r} in plan text {text!r}") from None
            return tuple(out)

        fwd, bwd = ranges(parts[0]), ranges(parts[1])
        n = num_layers if num_layers is not None else max((b for _, b in fwd + bwd), default=0)
        return cls(n, fwd, bwd, fused_last=fused).validate()

    def __str__(self) -> str:
        return self.to_text()

    def describe(self, num_workers: int) -> str:
        """A few readable lines: the stages and the worker each one goes to in the first step."""
        lines = [f"RoundPipe plan over {self.num_layers} layers, {num_workers} worker(s): {self.to_text()}"]
        for task in dispatch(self, num_workers):
            fused = " (forward+loss+backward fused)" if self.fused_last and task.stage == self.forward_stages()[-1] else ""
            lines.append(f"  task {task.order:>3}: {task.stage} -> worker {task.worker}{fused}")
        return "\n".join(lines)


def dispatch(plan: Plan, num_workers: int, first_worker: int = 0, fused: bool | None = None) -> list[DispatchedStage]:
    """Round-robin dispatch: forward stages in order, then backward stages in reverse, each to the next worker.

    ``fused`` (default: the plan's ``fused_last``) says whether the last stage runs fused; a plan
    with a fused last stage run with the loss outside the pipeline dispatches that stage's
    backward like any other.
    """
    if num_workers < 1:
        raise PlanError(f"dispatch needs at least one worker, got {num_workers}")
    fused = plan.fused_last if fused is None else fused and plan.fused_last
    backward = plan.dispatched_backward_stages() if fused else list(reversed(plan.backward_stages()))
    stages = plan.forward_stages() + backward
    return [DispatchedStage(k, s, (first_worker + k) % num_workers) for k, s in enumerate(stages)]

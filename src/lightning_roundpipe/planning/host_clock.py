"""The host's own work around pipelined training calls, timed for the plan keeper's ``observe_host``."""

from __future__ import annotations

from typing import Callable

import torch
import torch.utils._pytree as pytree


class HostClock:
    """Measures the host's own work around pipelined training calls for the plan keeper
    (``observe_host``), on the trace recorder's clock:

    * between forward and backward: from the last forward output on the host (the last forward
      download in the trace; the call's return when no task was recorded) to the moment the
      output's gradient reaches the pipeline (a gradient hook on the outputs): merging the
      microbatch outputs, the caller's loss on them and its backward;
    * between steps: from the end of one training call's backward to the next training call
      (the training loop, the optimizer's submission, the next batch); an evaluation call in
      between voids that interval.
    """

    def __init__(self, planner, clock: Callable[[], float]) -> None:
        self.planner = planner
        self.clock = clock
        self.last_end: float | None = None
        self.pending: dict[int, dict] = {}  # engine step -> times of that call

    def interrupted(self) -> None:
        """An evaluation call ran: the time since the last backward is not the training loop's."""
        self.last_end = None

    def forward_returned(self, run, called: float, out) -> None:
        """Note when a pipelined call returned and how long the host spent outside the pipeline before it."""
        now = self.clock()
        entry = {"called": called, "returned": now, "outside": None if self.last_end is None else called - self.last_end}
        self.pending = {run.step: entry}  # an older call never reached backward: forget it
        if run.fused:
            return
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(lambda grad, entry=entry: self.gradient_arrived(entry))

    def gradient_arrived(self, entry: dict) -> None:
        """An output's gradient reached the pipeline (the last output's time is kept); the gradient is
        unchanged."""
        entry["gradient"] = self.clock()

    def backward_done(self, run, records) -> None:
        """Close the step's host timing when its backward is done and hand it to the planner."""
        entry = self.pending.pop(run.step, None)
        self.last_end = self.clock()
        if entry is None:
            return
        between = None
        if "gradient" in entry:
            home = [r.end for r in records if r.queue == "download" and r.stage.startswith("F")]
            between = max(0.0, entry["gradient"] - (max(home) if home else entry["returned"]))
        self.planner.observe_host(between, entry["outside"])

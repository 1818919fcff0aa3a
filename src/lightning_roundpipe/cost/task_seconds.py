"""Device seconds of the engine's tasks on a hardware profile, priced as the simulator prices them.

The emulated-GPU backend (``roundpipe_lab/fake_cuda/emulated.py``) asks how long each task it runs lasts on the
device; ``ProfileDeviceTimes`` answers from the calibrated cost model of a real model shape on a
hardware profile, with the formulas of ``sim/simulate.py``: compute seconds from the cost view,
transfers as the profile's latency plus the real shape's bytes over its host link. A task is named
by its label (``kind``, ``stage``: ``workers.completions.TaskLabel``) and the bytes it moves.
"""

from __future__ import annotations

from typing import Sequence

from ..schedule.graph_task import TaskKind
from .view import CostView

LOSS_BYTES = 4  # one fp32 scalar per microbatch (as schedule/lowering.py moves it)


class ProfileDeviceTimes:
    """Device seconds of the engine's tasks for one plan of a real model shape on a hardware profile.

    ``costs``: the per-microbatch layer costs of the real shape (``shape_layer_costs``), one entry
    per layer of ``plan``; ``hardware``: the profile (link rate, latency); ``scaled_weight_bytes``:
    per layer, the weight bytes of the scaled-down model the engine really runs, so a weight upload
    of some of a stage's tensors is charged that share of the stage's real bytes. Stage names are
    the plan's ("F0" is ``plan.forward[0]``, "B2" is ``plan.backward[2]``).
    """

    def __init__(self, plan, costs, hardware, scaled_weight_bytes: Sequence[int]):
        if len(scaled_weight_bytes) != plan.num_layers or len(costs.layers) != plan.num_layers:
            raise ValueError(f"the plan has {plan.num_layers} layers, the costs {len(costs.layers)} and the scaled "
                             f"model {len(scaled_weight_bytes)}: they must describe the same layers")
        self.plan, self.hw, self.view = plan, hardware, CostView(costs)
        self.scaled = list(scaled_weight_bytes)
        self.stages = {f"F{i}": r for i, r in enumerate(plan.forward)}
        self.stages.update({f"B{i}": r for i, r in enumerate(plan.backward)})

    def link_s(self, nbytes: float) -> float:
        """One copy of ``nbytes`` over the profile's host link."""
        return self.hw.latency_s + nbytes / self.hw.host_device_bytes_per_s

    def __call__(self, label, nbytes: int) -> float:
        """Device seconds of the task ``label`` names, moving ``nbytes`` of the scaled model."""
        kind = label.kind
        layer_grain = kind.startswith("layer_")
        kind = kind.removeprefix("layer_")
        a, b = self.stages[label.stage]
        v = self.view
        if kind == TaskKind.FORWARD:
            return v.forward_s(a, b)
        if kind in (TaskKind.FUSED, TaskKind.BACKWARD):
            seconds = v.fused_s(a, b) if kind == TaskKind.FUSED else v.backward_with_recompute_s(a, b)
            return seconds + (v.forward_s(a, b - 1) if layer_grain else 0.0)
        if kind == TaskKind.WEIGHTS:
            scaled = sum(self.scaled[a:b])
            share = nbytes / scaled if scaled > 0 and nbytes > 0 else 1.0
            return self.link_s(share * v.uploaded_weights(a, b))  # as they cross the link, not as held
        if kind == TaskKind.WGRAD:
            return self.link_s(v.downloads(a, b))
        if kind == TaskKind.LOSS:
            return self.link_s(LOSS_BYTES)
        # Activations: what enters a stage (act_in at a; grad_in is the gradient at its end, b), what
        # leaves it (act_out at b; grad_out, the input's gradient, at a); a saved stage-internal input
        # is a decoder boundary's activation, which every decoder boundary has the size of.
        boundary = {"act_in": a, "grad_in": b, "act_out": b, "grad_out": a, "act_save": min(a + 1, b)}[kind]
        return self.link_s(v.in_bytes(boundary))

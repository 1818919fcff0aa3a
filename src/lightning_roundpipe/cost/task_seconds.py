"""Device seconds of the engine's tasks on a hardware profile, by the one timing model's rules.

The emulated-GPU backend (``roundpipe_lab/fake_cuda/emulated.py``) asks how long each task it runs lasts on the
device; ``ProfileDeviceTimes`` answers from the calibrated cost model of a real model shape on a
hardware profile with ``cost/graph_timing.py``'s prices: ``compute_seconds`` for a compute,
``link_seconds`` of the real shape's bytes for a transfer. A task is named by its label
(``kind``, ``stage``: ``workers.completions.TaskLabel``) and the bytes it moves.
"""

from __future__ import annotations

from typing import Sequence

from ..schedule.graph_task import LOSS_BYTES, TaskKind
from .graph_timing import compute_seconds, link_seconds
from .view import CostView

LAYER_GRAIN = "layer_"  # a label's kind prefix for a compute that recomputes one layer at a time


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
        return link_seconds(nbytes, self.hw.host_device_bytes_per_s, self.hw.latency_s)

    def __call__(self, label, nbytes: int) -> float:
        """Device seconds of the task ``label`` names, moving ``nbytes`` of the scaled model."""
        grain = "layer" if label.kind.startswith(LAYER_GRAIN) else ""
        kind = TaskKind(label.kind.removeprefix(LAYER_GRAIN))
        a, b = self.stages[label.stage]
        v = self.view
        if kind in (TaskKind.FORWARD, TaskKind.FUSED, TaskKind.BACKWARD):
            return compute_seconds(v, kind, a, b, grain)
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
        boundary = {TaskKind.ACT_IN: a, TaskKind.GRAD_IN: b, TaskKind.ACT_OUT: b, TaskKind.GRAD_OUT: a,
                    TaskKind.ACT_SAVE: min(a + 1, b)}[kind]
        return self.link_s(v.in_bytes(boundary))

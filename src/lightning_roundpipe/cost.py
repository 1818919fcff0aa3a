"""Per-layer costs: what the partitioner, the plan report and the simulator reason about.

Times are seconds per microbatch on one worker; bytes are as they travel over the link
(weights in the compute dtype). ``estimate_costs`` fills these from sizes and FLOPs before any
measurement; the engine later replaces times by moving averages of what the workers measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LayerCost:
    forward_s: float  # forward of one microbatch
    recompute_s: float  # the forward again inside backward (same as forward_s unless measured otherwise)
    backward_s: float  # the backward proper of one microbatch (about 2x forward), recompute excluded
    weight_bytes: int  # uploaded bytes of the layer's weights and buffers, in compute dtype
    grad_bytes: int  # downloaded bytes of its trainable weights' gradients (0 when frozen)
    act_bytes_per_token: int  # bytes of the layer's output activation per token

    def scaled(self, factor: float) -> "LayerCost":
        return LayerCost(
            self.forward_s * factor,
            self.recompute_s * factor,
            self.backward_s * factor,
            self.weight_bytes,
            self.grad_bytes,
            self.act_bytes_per_token,
        )


@dataclass
class CostProfile:
    """Costs of every layer of the pipelined module, for a given microbatch shape."""

    layers: list[LayerCost]
    tokens_per_microbatch: int = 1
    measured: bool = False  # False while the numbers are estimates
    notes: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.layers)

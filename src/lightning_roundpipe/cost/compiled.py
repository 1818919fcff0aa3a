"""What compiling each decoder layer (``torch.compile`` on the worker) changes in its cost.

A compiled layer keeps its matmuls and flash attention and fuses each element-wise chain between
them into one kernel, so two terms of ``cost.transformer`` change: element-wise traffic (about
4.7x less for a Qwen3-1.7B layer) and kernel launches per layer and microbatch
(``FUSED_FORWARD_LAUNCHES``, ``FUSED_BACKWARD_LAUNCHES``). Both are counts from first principles,
not GPU measurements (none here). The counts: docs/design.md, design notes, ``cost/compiled.py``.
"""

from __future__ import annotations

from .hardware import HardwareProfile

FUSED_NORM_BYTES = 4  # read x, write normalised x
FUSED_QK_BYTES = 4  # q/k norm + rotary in one kernel: read, write
FUSED_RESIDUAL_NORM_BYTES = 8  # read two summands, write the sum and the normalised sum
FUSED_GATED_MLP_BYTES = 6  # read gate and up, write act(gate) * up
FUSED_RESIDUAL_BYTES = 6  # read two summands, write the sum
FUSED_FORWARD_LAUNCHES = 7 + 1 + 6
FUSED_BACKWARD_LAUNCHES = FUSED_FORWARD_LAUNCHES + 14 + 3 + 6 + 9


def fused_elementwise_bytes_per_token(hidden: int, qk_width: int, mlp_width: int, dtype_bytes: int = 2) -> float:
    """Forward element-wise traffic of one compiled decoder layer per token (see the module doc).

    ``qk_width``: ``q_dim + kv_dim`` (rotary and, where the family has them, q/k norms, fused);
    ``mlp_width``: the intermediate width a token runs (MoE: routed experts x expert width).
    """
    per_token = ((FUSED_NORM_BYTES + FUSED_RESIDUAL_NORM_BYTES + FUSED_RESIDUAL_BYTES) * hidden
                 + FUSED_QK_BYTES * qk_width + FUSED_GATED_MLP_BYTES * mlp_width)
    return per_token * dtype_bytes / 2  # the counts are for 2-byte activations


def compiled_launches(hardware: HardwareProfile) -> HardwareProfile:
    """``hardware`` with the launch counts of compiled decoder layers (same ``launch_s``)."""
    return hardware.replace(forward_launches_per_layer=FUSED_FORWARD_LAUNCHES,
                            backward_launches_per_layer=FUSED_BACKWARD_LAUNCHES)

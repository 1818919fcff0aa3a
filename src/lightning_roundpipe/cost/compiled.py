"""What compiling each decoder layer (``torch.compile`` on the worker) changes in its cost.

A compiled layer keeps its matmuls and flash attention as they are (inductor calls cuBLAS and the
attention kernel; their FLOPs and rates do not change) and fuses every element-wise chain
between them into one kernel that reads its inputs once and writes its outputs once. Two terms
of ``cost.transformer`` change, counted from first principles (bytes per element of 2-byte
activations, forward; backward moves about twice as much, as for the eager layer):

- element-wise traffic (eager: ``transformer.elementwise_bytes_per_token``, 405,504 bytes per
  token forward for a Qwen3-1.7B layer):
  - input RMSNorm: read x, write the normalised x: 4 bytes per ``hidden`` element (eager: 36, the
    fp32 round trip);
  - Qwen3's q/k norms and rotary fused into one kernel per tensor: read q (k), write it: 4 per
    ``q_dim + kv_dim`` element (eager: 20 for rotary plus 36 for the norms);
  - the attention residual add fused with the post-attention RMSNorm: read both summands, write
    the sum and the normalised sum: 8 per ``hidden`` element (eager: 6 + 36);
  - the gated MLP's activation and product: read gate and up, write one: 6 per intermediate
    element (eager: 10);
  - the MLP residual add: read both, write the sum: 6 per ``hidden`` element (as eager; a
    per-layer compile cannot fuse it into the next layer's norm).
  That is ``18 * hidden + 4 * (q_dim + kv_dim) + 6 * intermediate`` bytes per token: 86,016 for
  Qwen3-1.7B, 4.7x less.
- kernel launches per decoder layer and microbatch (eager: the profile's
  ``forward_launches_per_layer`` / ``backward_launches_per_layer``, 53 / 149 measured by
  ``benchmarks.calibration.launch_budget``): forward 7 projections + 1 attention + 6 fused
  element-wise kernels (the five above, q's and k's counted apart) = 14 (``FUSED_FORWARD_LAUNCHES``);
  a backward task recomputes the forward (14) and runs 14 matmuls (input and weight gradient of
  each projection), 3 flash-attention backward kernels (preprocess, main, dq conversion), 6 fused
  element-wise backward kernels and 9 gradient accumulations (7 weights, 2 norm weights) = 46
  (``FUSED_BACKWARD_LAUNCHES``). The launch cost itself (``launch_s``) is the profile's.

Neither is measured on a GPU (none here): both are counts, and what a GPU run of the compiled
layer (``RuntimeOptions.compile_layers``) measures should replace them.
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

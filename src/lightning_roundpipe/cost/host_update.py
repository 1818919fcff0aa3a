"""Host seconds of one layer's optimizer update, with the failed-step safety the engine keeps.

The rate is ``HardwareProfile.optimizer_params_per_s`` on the optimizer thread's cores; the
failed-step undo adds ``UNDO_BYTES_PER_PARAM`` of host memory traffic per parameter (priced by
the simulator as its own idle-time copy, or inside the update for the worst case), and fp16's
loss scaler ``UNSCALE_BYTES_PER_PARAM`` more (``unscale_seconds``). Measured rates and the
pricing rule: docs/design.md, design notes, ``cost/host_update.py``.
"""

from __future__ import annotations

from .hardware import HardwareProfile

UNDO_BYTES_PER_PARAM = 24.0  # read + write of the fp32 parameter, exp_avg and exp_avg_sq
UNSCALE_BYTES_PER_PARAM = 8.0  # read + write of the fp32 gradient (multiplied by 1/scale, checked)


def update_seconds(params: float, hardware: HardwareProfile, undo_bytes_per_param: float = 0.0) -> float:
    """Host seconds to update ``params`` parameters, copying ``undo_bytes_per_param`` bytes of
    before-image per parameter first (0: no undo kept)."""
    seconds = params / hardware.optimizer_params_per_s
    if undo_bytes_per_param:
        bandwidth = hardware.host_memory_bytes_per_s or hardware.optimizer_params_per_s * hardware.optimizer_bytes_per_param
        seconds += params * undo_bytes_per_param / bandwidth
    return seconds


def unscale_seconds(params: float, hardware: HardwareProfile) -> float:
    """Host seconds to unscale and check the fp32 gradients of ``params`` parameters (fp16's loss
    scaler), at the host memory bandwidth or the one the optimizer rate implies."""
    bandwidth = hardware.host_memory_bytes_per_s or hardware.optimizer_params_per_s * hardware.optimizer_bytes_per_param
    return params * UNSCALE_BYTES_PER_PARAM / bandwidth

"""Host seconds of one layer's optimizer update, with the failed-step safety the engine keeps.

The host optimizer's own rate is ``HardwareProfile.optimizer_params_per_s`` (Adam bound by host
memory bandwidth over the 40 bytes one update moves), on the threads ``workers/threads.py`` gives
the optimizer's thread (the usable cores the pipeline leaves). Measured per thread on a Qwen3-1.7B
layer (``python -m benchmarks.calibration.host_update_rate``): fused AdamW 3.8e8 parameters/s, the
for-loop default 6.1e7 (the cpu2 profile's rate: 1 thread there). The exact overlapped optimizer keeps a
failed step undoable (``RuntimeOptions.optimizer_undo``, on by default, ``optim/step_undo.py``):
before a layer steps, the optimizer lane copies its fp32 parameters and Adam's two moments into
reused buffers (ahead, while the lane is idle, where it can), reading and writing 12 bytes per
parameter: ``UNDO_BYTES_PER_PARAM`` more host memory traffic on the same lane. The simulator
prices that copy as its own idle-time operation (``SimConfig.optimizer_undo``); ``update_seconds``
with ``undo_bytes_per_param`` is the copy paid inside the update, for the worst case. Priced at the host memory bandwidth when the profile gives
it, else at the bytes' share of the update's 40 (a copy moves bytes as Adam does).

Under fp16's loss scaler each layer's update first unscales its fp32 gradient in place and
checks it for inf/NaN (``optim/loss_scale.py``): ``UNSCALE_BYTES_PER_PARAM`` more, read and
written on the same lane, just before the step (``unscale_seconds``).
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

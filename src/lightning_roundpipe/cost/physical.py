"""Layer time from physical rates: tensor FLOPs, attention FLOPs and memory traffic.

A hardware profile may give, besides its single ``tflops``, the rates a datasheet states
(``HardwareProfile`` fields ``tensor_tflops_fp32_acc``,
``tensor_tflops_fp16_acc``, ``memory_bytes_per_s``). Then the time of a layer's work is

    matmul FLOPs / tensor rate (fp16 accumulate when the run enables it, else fp32 accumulate)
  + attention FLOPs / fp32-accumulate tensor rate (flash attention accumulates in fp32)
  + element-wise bytes / memory bandwidth

i.e. the three kinds of kernels run one after another on one stream, each at its own limit.
A profile may also give achievable rates measured on whole layers (``matmul_tflops_fp16_acc``,
``matmul_tflops_fp32_acc``, ``attention_tflops``): they replace the datasheet peaks, since a
GPU under its power limit sustains less than its boost-clock peak and flash attention does not
reach the tensor peak (softmax and rescaling between its matmuls).
Without those fields everything compute-bound runs at ``tflops`` and element-wise traffic is
free, as the estimate always did.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import HardwareProfile


@dataclass(frozen=True)
class LayerWork:
    """Work of one layer pass per token: projection/LM-head FLOPs, attention FLOPs, element-wise bytes."""

    matmul_flops: float
    attention_flops: float = 0.0
    memory_bytes: float = 0.0


def has_physical_rates(hardware: HardwareProfile) -> bool:
    """Whether the profile gives the datasheet rates this module needs."""
    return (hardware.tensor_tflops_fp32_acc is not None and hardware.tensor_tflops_fp16_acc is not None
            and hardware.memory_bytes_per_s is not None)


def layer_seconds(work: LayerWork, tokens: float, hardware: HardwareProfile, fp16_accumulation: bool = False) -> float:
    """Seconds of ``work`` over ``tokens`` tokens on one worker of ``hardware`` (see the module doc)."""
    if not has_physical_rates(hardware):
        return tokens * (work.matmul_flops + work.attention_flops) / hardware.flops_per_s
    matmul_rate = matmul_tflops(hardware, fp16_accumulation) * 1e12
    attention_rate = (hardware.attention_tflops or hardware.tensor_tflops_fp32_acc) * 1e12
    return tokens * (work.matmul_flops / matmul_rate + work.attention_flops / attention_rate
                     + work.memory_bytes / hardware.memory_bytes_per_s)


def matmul_tflops(hardware: HardwareProfile, fp16_accumulation: bool = False) -> float:
    """The projection rate used: the achievable one when the profile gives it, else the peak."""
    if fp16_accumulation:
        return hardware.matmul_tflops_fp16_acc or hardware.tensor_tflops_fp16_acc
    return hardware.matmul_tflops_fp32_acc or hardware.tensor_tflops_fp32_acc

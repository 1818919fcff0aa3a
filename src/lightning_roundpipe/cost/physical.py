"""Layer time from physical rates: tensor FLOPs, attention FLOPs and memory traffic.

When a hardware profile gives datasheet rates (``tensor_tflops_fp32_acc``, ``tensor_tflops_fp16_acc``,
``memory_bytes_per_s``), a layer's time is its matmul FLOPs at the tensor rate of the accumulation
used, plus its attention FLOPs at the fp32-accumulate rate, plus its element-wise bytes at memory
bandwidth: three kinds of kernels one after another on one stream. Achievable rates measured on
whole layers (``matmul_tflops_*``, ``attention_tflops``) replace the peaks; without any of these
fields everything runs at ``tflops``. Details: docs/design.md, design notes, ``cost/physical.py``.
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

"""Flash attention's speed as a function of sequence length: a fixed cost per query block plus the key loop.

A profile's ``attention_tflops`` was fitted at one sequence length (``CALIBRATION_SEQ_LEN``), but
flash attention is a key loop at the GEMM rate plus fixed work per query block, so short
sequences run below the calibrated rate and long ones approach the GEMM rate.
``cost/transformer.py`` applies this as a factor on the attention FLOPs,
``(L + L0) / L * L_cal / (L_cal + L0)``, 1 at the calibration length. The derivation of ``L0``:
docs/design.md, design notes, ``cost/attention.py``.
"""

from __future__ import annotations

from .hardware import HardwareProfile

CALIBRATION_SEQ_LEN = 2048  # the sequence length of the per-layer times the attention rate was fitted to


def fixed_keys(hardware: HardwareProfile) -> float:
    """``L0``: keys' worth of fixed work per query (0 where the profile gives no lower attention rate)."""
    attention, matmul = hardware.attention_tflops, hardware.matmul_tflops_fp32_acc
    if attention is None or matmul is None or attention >= matmul:
        return 0.0
    return CALIBRATION_SEQ_LEN * (matmul / attention - 1)


def attention_flops_factor(seq_len: int, hardware: HardwareProfile) -> float:
    """What to multiply attention FLOPs by so that they take, at ``attention_tflops``, the time above."""
    l0 = fixed_keys(hardware)
    return (seq_len + l0) / seq_len * CALIBRATION_SEQ_LEN / (CALIBRATION_SEQ_LEN + l0)


def attention_tflops_at(seq_len: int, hardware: HardwareProfile) -> float | None:
    """The effective causal-attention rate at ``seq_len`` (None without an attention rate)."""
    if hardware.attention_tflops is None:
        return None
    return hardware.attention_tflops / attention_flops_factor(seq_len, hardware)

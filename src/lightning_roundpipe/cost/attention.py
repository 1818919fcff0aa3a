"""Flash attention's speed as a function of sequence length: a fixed cost per query block plus the key loop.

A profile's achievable ``attention_tflops`` was fitted to layer times at one sequence length
(``CALIBRATION_SEQ_LEN``: the reference artifact's 4 x 2048-token microbatches, see
``benchmarks/calibration/kernel_rates.py``). Flash attention is not one rate, though. Each
thread block owns a block of queries: it loads them, loops over the key blocks it may see
(causal: on average half of the sequence, the diagonal block computed in full and masked),
then normalises and writes its output and log-sum-exp. The key loop is two tensor-core GEMMs
per block and runs at the rate of any large GEMM on the chip (the profile's fp32-accumulate
``matmul_tflops_fp32_acc``: flash attention accumulates in fp32); the rest is the same per
query block whatever the length. So the time of causal attention per token is

    2 * q_dim * (L + L0) / R_matmul      (forward; backward the same shape, 2.5x the FLOPs)

with ``L0`` keys' worth of fixed work per query. ``L0`` is not fitted to long sequences: it is
what makes the calibrated rate hold at the calibration length,
``L0 = L_cal * (R_matmul / R_attention - 1)`` (RTX 4090: 2048 x (132 / 82 - 1) = 1,249 keys).
Short sequences then run attention below the calibrated rate, long ones approach the GEMM rate
(RTX 4090: 82 TFLOP/s at 2K, 114 at 8K, 132 in the limit).

``cost/transformer.py`` applies this as a factor on the attention FLOPs it charges at the
profile's ``attention_tflops``: ``(L + L0) / L * L_cal / (L_cal + L0)``, 1 at the calibration
length. Profiles without an achievable attention rate, or whose attention rate is not below
their matmul rate, are left as they are.
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

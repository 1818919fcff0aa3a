"""Compute precisions the cost model prices, and the matmul accumulation each one runs.

``bf16-mixed`` and ``16-mixed`` accumulate in fp32 (the profile's ``matmul_tflops_fp32_acc``);
``fp16-acc``, the reference's choice, runs projections and the LM head at the fp16-accumulate
rate (``matmul_tflops_fp16_acc``, twice as fast on a GeForce RTX 4090); flash attention keeps its
fp32-accumulate rate. fp16 needs the loss scaler; layers still step early unless
``optimizer_undo=False`` (``waits_for_every_gradient``). Details: docs/design.md, design notes,
``analysis/precision.py``.
"""

from __future__ import annotations

PRECISIONS = {"bf16-mixed": False, "16-mixed": False, "fp16-acc": True}  # name -> matmuls accumulate in fp16


def check_precision(precision: str) -> str:
    """``precision`` when the cost model knows it, else ValueError naming the known ones."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    return precision


def fp16_accumulation(precision: str) -> bool:
    """Whether ``precision``'s matmuls run at the fp16-accumulate tensor rate."""
    return PRECISIONS[check_precision(precision)]


def loss_scaled(precision: str) -> bool:
    """Whether ``precision`` computes in fp16, so the host loss scaler checks every gradient of a step."""
    return check_precision(precision) != "bf16-mixed"


def waits_for_every_gradient(precision: str, undo: bool) -> bool:
    """Whether the engine's optimizer waits for every gradient of the step before any layer steps:
    under the loss scaler without the failed-step undo, which early steps need to be put back
    on overflow (see the module doc)."""
    return loss_scaled(precision) and not undo

"""Compute precisions the cost model prices, and the matmul accumulation each one runs.

- ``bf16-mixed`` (this engine's default, Lightning's name): bf16 matmuls accumulate in fp32,
  at the profile's fp32-accumulate tensor rate (``matmul_tflops_fp32_acc``);
- ``16-mixed``: fp16 compute with fp32 accumulation (torch's default for fp16 matmuls), the
  same rate, with the host loss scaler;
- ``fp16-acc``: the reference's choice, fp16 compute with fp16 accumulation in the matmuls
  (``torch.backends.cuda.matmul.allow_fp16_accumulation``, opt-in, per run): projections and
  the LM head at the fp16-accumulate rate (``matmul_tflops_fp16_acc``: twice the fp32-accumulate
  rate on a GeForce RTX 4090, the same on data-centre GPUs), with the host loss scaler. Flash
  attention accumulates in fp32 whatever the flag says, so attention keeps its rate.

fp16 (``16-mixed``, ``fp16-acc``) needs the loss scaler (``loss_scaled``), whose overflow check
covers every gradient of the step. The engine's overlapped optimizer still steps each layer
early, during backward: the layer unscales and checks its own gradients first, and an overflow
found later puts back the layers that stepped, from the failed-step undo's before-images
(``optim/overlap.py``). Without the undo (``optimizer_undo=False``) there is nothing to put
them back with, so every gradient is checked before any layer steps
(``waits_for_every_gradient``).
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

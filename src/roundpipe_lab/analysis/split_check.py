"""The price of the split-invariance check (``engine/split_invariance.py``) in the cost model.

The check runs every pipelined layer's forward on the host CPU, in the host dtype (fp32 masters), on the
rows of the first two microbatches, twice (whole and per microbatch), once per training mode: a one-off
cost at the first step. ``HOST_FP32_FLOPS`` is an assumption, not a measurement: a two-socket server
CPU of the kind that hosts 8 GPUs reaching about 1 TFLOP/s in fp32 GEMMs (datasheet peaks 3-5).
"""

from __future__ import annotations

from lightning_roundpipe.cost.transformer import ModelShape, decoder_layer_work, get_model_shape, head_work

HOST_FP32_FLOPS = 1.0e12
"""Assumed fp32 GEMM rate of a GPU server's host CPUs (FLOP/s)."""


def forward_flops_per_token(shape: ModelShape | str, seq_len: int) -> float:
    """Forward FLOPs of the whole model per token: decoder layers (projections and attention) and the LM head."""
    shape = get_model_shape(shape)
    layer, _ = decoder_layer_work(shape, seq_len)
    head, _ = head_work(shape)
    return shape.num_layers * (layer.matmul_flops + layer.attention_flops) + head.matmul_flops


def split_check_seconds(shape: ModelShape | str, seq_len: int, batch: int, microbatches: int,
                        host_flops_per_s: float = HOST_FP32_FLOPS) -> float:
    """Seconds the check takes on the host for a batch of ``batch`` sequences of ``seq_len`` tokens cut
    into ``microbatches``: two forwards of the first two microbatches' rows (one forward of two rows with one)."""
    rows = min(batch, 2 * -(-batch // microbatches)) if microbatches > 1 else min(batch, 2)
    passes = 2 if microbatches > 1 else 1
    return passes * rows * seq_len * forward_flops_per_token(shape, seq_len) / host_flops_per_s

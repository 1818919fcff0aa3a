"""Frozen base weights kept 4-bit (NF4, QLoRA): their host bytes, upload bytes and dequantization time.

NF4 as bitsandbytes and torchao store it: 0.5625 B per parameter, 0.5159 double-quantized. The
decoder layers' projections are packed (what ``BitsAndBytesConfig(load_in_4bit=True)``
quantizes); they stay packed on the host and across the link, and each compute dequantizes them
on the worker at the profile's memory bandwidth, one projection's copy alive at a time. The
byte counts: docs/design.md, design notes, ``cost/quantization.py``.
"""

from __future__ import annotations

import dataclasses

from .hardware import HardwareProfile
from .profile import CostProfile
from .transformer import ModelShape, ParamSplit, projection_split

NF4_BLOCK = 64  # parameters per absmax scale (bitsandbytes' and torchao's default)
NF4_SCALE_BLOCK = 256  # scales per second-level fp32 scale under double quantization
QUANTIZE_CHOICES = ("nf4",)


def nf4_bytes_per_param(double_quant: bool = True) -> float:
    """Bytes per NF4 parameter, block scales included (0.5159 double-quantized, 0.5625 plain)."""
    scales = (1 + 4 / NF4_SCALE_BLOCK) / NF4_BLOCK if double_quant else 4 / NF4_BLOCK
    return 0.5 + scales


def packed_params_per_layer(shape: ModelShape) -> int:
    """Parameters of one decoder layer that a 4-bit base packs: every projection, no norm or router."""
    split = projection_split(shape)
    return split.linear + split.other


def dequantized_params_per_call(shape: ModelShape, tokens: int) -> float:
    """Packed parameters one compute of a decoder layer dequantizes for ``tokens`` tokens: every
    projection of a dense layer; in an MoE layer the attention and the experts some token is routed
    to (each expert runs, and dequantizes, only when hit: ``E (1 - (1 - k/E)^tokens)`` expected)."""
    if not shape.is_moe:
        return float(packed_params_per_layer(shape))
    hit = shape.num_experts * (1 - (1 - shape.experts_per_token / shape.num_experts) ** tokens)
    return sum(a * b for a, b in shape.attention_shapes()) + hit * sum(a * b for a, b in shape.mlp_shapes())


def packed_costs(costs: CostProfile, shape: ModelShape, hardware: HardwareProfile, scheme: str = "nf4",
                 double_quant: bool = True) -> CostProfile:
    """``costs`` (of ``shape``, with LoRA: the base frozen) with the decoder layers' projections packed:
    uploads and worker copies of the packed bytes instead of the projections as a mixed precision
    moves them (``projection_split``: bf16 Linear weights, fp32 fused experts), a smaller host copy,
    and each compute of a decoder layer longer by its dequantization (module doc)."""
    if scheme not in QUANTIZE_CHOICES:
        raise ValueError(f"quantization must be one of {QUANTIZE_CHOICES}, got {scheme!r}")
    if costs.decoder_layers is None:
        raise ValueError("packed weights need the decoder layers' range in the cost profile")
    start, end = costs.decoder_layers
    packed = packed_params_per_layer(shape)
    trainable = costs.layer_trainable_params()
    if any(trainable[i] >= packed for i in range(start, end)):
        raise ValueError("a 4-bit base is frozen: quantization needs LoRA (the base weights do not train)")
    per_param = nf4_bytes_per_param(double_quant)
    packed_bytes = int(round(packed * per_param))
    unpacked_upload, unpacked_held, _, _ = projection_split(shape).device_bytes(ParamSplit(0, 0), costs.dtype_bytes)
    dequantized = dequantized_params_per_call(shape, costs.tokens_per_microbatch)
    dequant_s = (dequantized * (per_param + costs.dtype_bytes) / hardware.memory_bytes_per_s
                 if hardware.memory_bytes_per_s else 0.0)
    largest = max(a * b for a, b in shape.attention_shapes() + shape.mlp_shapes()) * costs.dtype_bytes
    dequantized_per_token = -(-largest // max(1, costs.tokens_per_microbatch))
    layers = list(costs.layers)
    for i in range(start, end):
        c = layers[i]
        forward_transient = (None if c.forward_transient_bytes_per_token is None
                             else c.forward_transient_bytes_per_token + dequantized_per_token)
        layers[i] = dataclasses.replace(
            c, weight_bytes=c.weight_bytes - unpacked_upload + packed_bytes, forward_s=c.forward_s + dequant_s,
            # the frozen base is held as uploaded: packed on the worker as on the link
            device_weight_bytes=(None if c.device_weight_bytes is None
                                 else c.device_weight_bytes - unpacked_held + packed_bytes),
            recompute_s=c.recompute_s + dequant_s, backward_s=c.backward_s + dequant_s,
            params=costs.layer_params()[i], forward_transient_bytes_per_token=forward_transient,
            backward_transient_bytes_per_token=(c.backward_transient_bytes_per_token or 0) + dequantized_per_token)
    copy = (costs.host_copy_bytes if costs.host_copy_bytes is not None
            else (costs.unique_params if costs.unique_params is not None else sum(costs.layer_params())) * costs.dtype_bytes)
    return dataclasses.replace(costs, layers=layers,
                               host_copy_bytes=copy - (end - start) * (packed * costs.dtype_bytes - packed_bytes),
                               source=f"{costs.source}, {scheme} base")

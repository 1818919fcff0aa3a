"""What an MoE layer's expert dispatch costs beyond its routed FLOPs: the per-expert loop or one grouped call.

``cost/transformer.py`` prices routed rows as if each met its expert in one large GEMM; real eager
code does not. This module prices three dispatches so that the planner and the simulator can
compare them: Hugging Face's (and the reference's) per-expert loop (launches, host syncs, small
GEMMs, the backward scatter), ``moe_experts="grouped"`` (one ``grouped_mm`` per projection) and
``moe_experts="padded_bmm"`` (one fp16 ``bmm`` over slots padded to the busiest expert). Each
term, its derivation and what is left out: docs/design.md, design notes, ``cost/moe_loop.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import HardwareProfile
from .physical import has_physical_rates, matmul_tflops

# Streaming multiprocessors per GPU (the vendors' whitepapers: Ada AD102 as in the RTX 4090 128
# SMs, GA100 as in the A100 108, GH100 SXM5 as in the H100 132). Unknown profiles: 128.
STREAMING_MULTIPROCESSORS = {"rtx4090": 128, "a100": 108, "a100-80gb": 108, "h100": 132}
TILE = 128  # output tile edge of a tensor-core GEMM kernel (cuBLAS/CUTLASS fp16 kernels use 128 or 256)
DEFAULT_SMS = 128


@dataclass(frozen=True)
class ExpertDispatch:
    """How one implementation runs an MoE layer's experts (kernel counts read off its source).

    ``loop``: one iteration per expert (else one grouped call). Kernels and syncs per expert
    and per layer, forward; backward kernels are those autograd launches for them.
    ``gate_bytes_per_intermediate``: forward element-wise bytes of the expert gate per
    intermediate element (10: ``act(gate) * up``, as ``cost/transformer.py`` counts).
    ``biased``: the experts add biases (one more add on the output).
    ``bf16_only``: the kernel takes bf16 only (no fp16 accumulation for the expert GEMMs).
    ``padded``: the GEMMs run over ``E x capacity`` slots (the padded dispatch), with the busiest
    expert's load ``load_imbalance`` times the mean.
    """

    name: str
    loop: bool
    forward_kernels_per_expert: int = 0
    backward_kernels_per_expert: int = 0
    forward_kernels_per_layer: int = 0
    backward_kernels_per_layer: int = 0
    syncs_per_expert: int = 0
    syncs_per_layer: int = 0
    gate_bytes_per_intermediate: int = 10
    biased: bool = False
    bf16_only: bool = False
    padded: bool = False
    load_imbalance: float = 1.0


# Kernel counts from the code each runs (forward; backward = the gradients autograd launches):
# - the reference's GptOssOptExperts loop body: gather rows, matmul, bias add, two clamps,
#   alpha multiply, sigmoid, multiply, +1, multiply, matmul, bias add, weight multiply,
#   index_add_ = 14; its backward 36 (index_select, 3 for the weight multiply, per projection
#   2 GEMMs + bias sum + 2 select_backward kernels per indexed tensor + the accumulating add,
#   7 for the gate chain, 4 for the two strided-slice backwards, 3 for the gather's index_put);
#   per layer: gather of the routing weights, sort, index, divide, counts, ``.cpu()``, two zeros.
REFERENCE_GPT_OSS_LOOP = ExpertDispatch("reference loop (GPT-OSS)", True, 14, 36, 8, 6, 0, 1,
                                        gate_bytes_per_intermediate=44, biased=True)
# - the reference's Qwen3MoeOptSparseMoeBlock over an nn.ModuleList of expert MLPs (transformers
#   4.57): gather, gate and up projections, activation, multiply, down projection, weight
#   multiply, index_add_ = 8 (backward 2.5x: input and weight gradients, the gather's index_put).
REFERENCE_SWIGLU_LOOP = ExpertDispatch("reference loop (SwiGLU experts)", True, 8, 20, 8, 6, 0, 1)
# - transformers 5 ``experts_implementation="eager"`` (every family's fused 3-D experts):
#   ``expert_idx == num_experts`` (a sync), ``torch.where`` (nonzero: 2 kernels, a sync),
#   gather, gate_up linear (``gate_up_proj[expert_idx]`` with a 0-d tensor: ``.item()``, a sync),
#   activation, multiply, down linear (another ``.item()``), weight gather and multiply,
#   index_add_ = 11 kernels and 4 syncs per expert; one ``nonzero`` per layer.
HF_EAGER_LOOP = ExpertDispatch("transformers eager loop", True, 11, 28, 5, 4, 4, 1)
# - this project's grouped forward (adapters/grouped_experts.py), counted with a dispatch mode
#   on the CPU (aten calls that are not views; qwen3_moe-style gate): sort, counts, cumsum, rank,
#   gather, two grouped_mm, gate, weight gather and multiply, zeros, index_add = 23 per layer, 19
#   backward, whatever the number of experts; no host sync.
GROUPED = ExpertDispatch("grouped", False, forward_kernels_per_layer=23, backward_kernels_per_layer=19, bf16_only=True)
# - its padded path (``moe_experts="padded_bmm"``), counted the same way: + max and the host
#   read, the block's zeros and index_copy, two bmm, the index_select out = 28 per layer, 22
#   backward; one host read per layer. The imbalance assumed: 1.25, the capacity factor the Switch
#   Transformer paper (Fedus et al. 2021, JMLR 23) trained with under a load-balancing loss as
#   GPT-OSS has; the uniform-router floor is ~1.05 at the reference workload's 2,048 pairs per
#   expert (the mean plus ~2 standard deviations of 32 counts); docs/simulator.md sweeps it.
PADDED_LOAD_IMBALANCE = 1.25
PADDED_BMM = ExpertDispatch("padded bmm", False, forward_kernels_per_layer=28, backward_kernels_per_layer=22,
                            syncs_per_layer=1, padded=True, load_imbalance=PADDED_LOAD_IMBALANCE)
# GPT-OSS's biased, clamped gate adds kernels to both (counted the same way): grouped 32 / 33, padded 35 / 38.
GPT_OSS_GATE_KERNELS = {"grouped": (32, 33), "padded bmm": (35, 38)}

DISPATCHES = {"grouped": GROUPED, "padded_bmm": PADDED_BMM, "hf_eager_loop": HF_EAGER_LOOP, "reference_loop": None}


def reference_loop(model_name: str) -> ExpertDispatch:
    """The reference RoundPipe's loop for a model: GPT-OSS's own (biased, clamped gate) or the SwiGLU one."""
    return REFERENCE_GPT_OSS_LOOP if "gpt-oss" in model_name.lower() else REFERENCE_SWIGLU_LOOP


def for_shape(dispatch: "str | ExpertDispatch", model_name: str) -> ExpertDispatch:
    """``"reference_loop"``, ``"hf_eager_loop"``, ``"grouped"``, ``"padded_bmm"`` or an ``ExpertDispatch``,
    for ``model_name``."""
    if isinstance(dispatch, ExpertDispatch):
        return dispatch
    if dispatch not in DISPATCHES:
        raise ValueError(f"unknown expert dispatch {dispatch!r}; use one of {sorted(DISPATCHES)}")
    found = DISPATCHES[dispatch]
    if found is None:
        return reference_loop(model_name)
    if "gpt-oss" in model_name.lower() and found.gate_bytes_per_intermediate == 10:
        # GPT-OSS's gate is the same code in every dispatch (adapters/grouped_experts.py gpt_oss_gate)
        forward, backward = GPT_OSS_GATE_KERNELS.get(found.name, (found.forward_kernels_per_layer,
                                                                 found.backward_kernels_per_layer))
        return ExpertDispatch(**{**found.__dict__, "gate_bytes_per_intermediate": 44, "biased": True,
                                 "forward_kernels_per_layer": forward, "backward_kernels_per_layer": backward})
    return found


def wave_efficiency(rows: float, cols: int, sms: int, tile: int = TILE) -> float:
    """Share of a GEMM's last-wave-padded tile work that is useful: ``rows * cols / (waves * SMs * tile^2)``.

    A GEMM of ``rows x cols`` outputs runs ``ceil(rows/tile) * ceil(cols/tile)`` tiles in waves
    of ``sms`` tiles; ``waves = ceil(tiles / sms)``. A large GEMM tends to 1.
    """
    if rows <= 0:
        return 1.0
    tiles = math.ceil(rows / tile) * math.ceil(cols / tile)
    waves = math.ceil(tiles / sms)
    return rows * cols / (waves * sms * tile * tile)


def batched_wave_efficiency(useful_rows: float, batch: int, rows: int, cols: int, sms: int, tile: int = TILE) -> float:
    """Share of a batched GEMM's tile work that is useful: ``useful_rows * cols / (waves * SMs * tile^2)``.

    ``batch`` GEMMs of ``rows x cols`` outputs run ``batch * ceil(rows/tile) * ceil(cols/tile)``
    tiles in ``waves = ceil(tiles / sms)``; only ``useful_rows`` of the ``batch * rows`` rows are
    wanted (the padded dispatch's routed pairs).
    """
    if useful_rows <= 0:
        return 1.0
    tiles = batch * math.ceil(rows / tile) * math.ceil(cols / tile)
    waves = math.ceil(tiles / sms)
    return useful_rows * cols / (waves * sms * tile * tile)


def expected_capacity(pairs: int, experts: int, tokens: int, load_imbalance: float, multiple: int = TILE) -> int:
    """The padded dispatch's slots per expert: the busiest expert's expected load, ``load_imbalance``
    times the mean ``pairs / experts``, rounded up to ``multiple`` (the adapter's
    ``CAPACITY_MULTIPLE``), and no more than the tokens rounded up (a token picks an expert once)."""
    def rounded(rows: float) -> int:
        return math.ceil(rows / multiple) * multiple
    return min(rounded(load_imbalance * pairs / experts), rounded(tokens))


@dataclass(frozen=True)
class DispatchCost:
    """Seconds one MoE layer adds to a microbatch's forward and backward, its extra launches, and
    (the padded dispatch) the extra graph bytes per token its empty slots keep for the backward."""

    forward_s: float
    backward_s: float
    forward_launches: int
    backward_launches: int  # the backward proper's own (a backward task also re-runs the forward)
    graph_bytes_per_token: int = 0


def dispatch_cost(shape, tokens: int, hardware: HardwareProfile, dispatch: ExpertDispatch, dtype_bytes: int = 2,
                  fp16_accumulation: bool = False) -> DispatchCost:
    """What ``dispatch`` adds to one MoE decoder layer of ``shape`` over ``tokens`` tokens (see the module doc).

    Only profiles with physical rates are priced (``cost/physical.py``); others get zero.
    """
    if not shape.is_moe or not has_physical_rates(hardware):
        return DispatchCost(0.0, 0.0, 0, 0)
    e, k, h, i = shape.num_experts, shape.experts_per_token, shape.hidden, shape.expert_intermediate
    scale = dtype_bytes / 2
    bandwidth = hardware.memory_bytes_per_s
    pairs = tokens * k
    # Both dispatches: gather, routing-weight multiply and index_add of the routed rows; a gate
    # heavier than act(gate) * up; biased experts' output bias.
    row_bytes = (14 * h + (dispatch.gate_bytes_per_intermediate - 10) * i + (4 * h if dispatch.biased else 0)) * scale
    forward_s = pairs * row_bytes / bandwidth
    backward_s = 2 * forward_s
    rate = matmul_tflops(hardware, fp16_accumulation) * 1e12
    expert_flops = pairs * 2 * sum(a * b for a, b in shape.mlp_shapes())  # forward, routed
    experts_hit = min(e, pairs)
    if dispatch.loop:
        sms = STREAMING_MULTIPROCESSORS.get(hardware.name, DEFAULT_SMS)
        rows = pairs / e
        # gate_up (or gate and up) to the intermediate, down back to hidden: FLOP-weighted efficiency.
        shapes = shape.mlp_shapes()
        flops = [a * b for a, b in shapes]
        efficiency = sum(flops) / sum(f / wave_efficiency(rows, b, sms) for f, (_, b) in zip(flops, shapes))
        lost = expert_flops * (1 / efficiency - 1) / rate
        forward_s += lost + (experts_hit * dispatch.syncs_per_expert + dispatch.syncs_per_layer) * hardware.latency_s
        backward_s += 2 * lost + experts_hit * tokens * h * dtype_bytes * 4 / bandwidth
        forward_launches = experts_hit * dispatch.forward_kernels_per_expert + dispatch.forward_kernels_per_layer
        backward_launches = experts_hit * dispatch.backward_kernels_per_expert + dispatch.backward_kernels_per_layer
    elif dispatch.padded:
        sms = STREAMING_MULTIPROCESSORS.get(hardware.name, DEFAULT_SMS)
        capacity = expected_capacity(pairs, e, tokens, dispatch.load_imbalance)
        slots = e * capacity
        shapes = shape.mlp_shapes()
        flops = [a * b for a, b in shapes]
        efficiency = sum(flops) / sum(f / batched_wave_efficiency(pairs, e, capacity, b, sms)
                                      for f, (_, b) in zip(flops, shapes))
        lost = expert_flops * (1 / efficiency - 1) / rate
        empty = slots - pairs
        block_bytes = (slots * 2 * h + pairs * 8 * h
                       + empty * (dispatch.gate_bytes_per_intermediate * i + (4 * h if dispatch.biased else 0))) * scale
        forward_s += lost + block_bytes / bandwidth + dispatch.syncs_per_layer * hardware.latency_s
        backward_s += 2 * lost + 2 * block_bytes / bandwidth
        graph = math.ceil(empty * (h + 3 * i) * dtype_bytes / tokens)
        return DispatchCost(forward_s, backward_s, dispatch.forward_kernels_per_layer,
                            dispatch.backward_kernels_per_layer, graph)
    else:
        if dispatch.bf16_only and fp16_accumulation:
            # fp16 rows: grouped_mm refuses them and the padded bmm computes every expert on
            # every token, E / top_k times the routed FLOPs (adapters/grouped_experts.py).
            padded = expert_flops * (e / k - 1) / rate
            forward_s += padded
            backward_s += 2 * padded
        forward_launches, backward_launches = dispatch.forward_kernels_per_layer, dispatch.backward_kernels_per_layer
    return DispatchCost(forward_s, backward_s, forward_launches, backward_launches)

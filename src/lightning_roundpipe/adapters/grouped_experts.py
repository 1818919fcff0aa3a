"""Grouped expert computation for Hugging Face MoE layers (``moe_experts="grouped"``).

Replaces HF's per-expert loop (host syncs on a GPU) by the (token, expert) pairs sorted by
expert once and ONE grouped matmul per projection (``grouped_mm``), or, for
``moe_experts="padded_bmm"``, ONE fp16-capable ``bmm`` over slots padded to the busiest expert
(one host read per layer call). Both are exact against the loop; the router and aux loss are
untouched. Only the mapped expert layouts are swapped, as an instance ``forward``. The kernels
and why they are exact: docs/design.md, design notes, ``adapters/grouped_experts.py``.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..user_patches import remove_instance_attribute, set_instance_attribute


class GroupedMatmul(torch.autograd.Function):
    """``rows[ends[g-1]:ends[g]] @ weight[g]`` for every group g, forward and backward grouped too."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weight, ends)
        return F.grouped_mm(rows, weight, offs=ends)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight, ends = ctx.saved_tensors
        grad = grad.contiguous()
        grad_rows = F.grouped_mm(grad, weight.transpose(1, 2), offs=ends) if ctx.needs_input_grad[0] else None
        grad_weight = F.grouped_mm(rows.t(), grad, offs=ends) if ctx.needs_input_grad[1] else None
        return grad_rows, grad_weight, None


def grouped_kernel_fits(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``grouped_mm`` takes these operands: 16-byte aligned rows, and on CUDA (or when traced by
    ``torch.compile``, whose shape rule for it is bf16-only) bf16, on SM80+."""
    if not hasattr(F, "grouped_mm"):
        return False
    if torch.compiler.is_compiling() and rows.dtype != torch.bfloat16:
        return False
    item = rows.element_size()
    if (rows.shape[-1] * item) % 16 or (weight.shape[-1] * item) % 16 or (weight.shape[-2] * item) % 16:
        return False
    if rows.device.type == "cuda":
        return rows.dtype == torch.bfloat16 and torch.cuda.get_device_capability(rows.device) >= (8, 0)
    return rows.device.type == "cpu"


CAPACITY_MULTIPLE = 128  # the padded path's slots per expert are a multiple of a GEMM output tile's rows


def padded_capacity(counts: torch.Tensor, multiple: int = CAPACITY_MULTIPLE) -> int:
    """The busiest expert's pair count rounded up to ``multiple``: the one host read of the padded path."""
    busiest = int(counts.max().item()) if counts.numel() else 0
    return -(-busiest // multiple) * multiple


def padded_matmul(rows: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, capacity: int) -> torch.Tensor:
    """The fallback: rows placed in ``capacity`` slots per group, one ``torch.bmm``, rows read back.

    ``capacity`` is the number of tokens, which bounds any group (a token picks an expert at most
    once), so no row is dropped; it costs ``groups * tokens`` rows of compute instead of ``pairs``.
    """
    groups = weight.shape[0]
    padded = rows.new_zeros(groups * capacity, rows.shape[-1]).index_copy(0, slots, rows)
    out = torch.bmm(padded.view(groups, capacity, rows.shape[-1]), weight)
    return out.reshape(groups * capacity, weight.shape[-1]).index_select(0, slots)


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, transposed: bool, route: dict) -> torch.Tensor:
    """Each sorted row times its expert's matrix; ``weight`` is [E, out, in] (``transposed``: [E, in, out])."""
    matrix = weight if transposed else weight.transpose(1, 2)  # [E, in, out], a view
    if route["kernel"] == "grouped_mm" and grouped_kernel_fits(rows, matrix):
        return GroupedMatmul.apply(rows, matrix, route["ends"])
    if route["kernel"] == "grouped_mm" and rows.is_cuda and not torch.compiler.is_compiling():
        warnings.warn(f"moe_experts='grouped': grouped_mm does not take {rows.dtype} rows of {rows.shape[-1]} on "
                      "this GPU (it takes bf16, 16-byte aligned, on SM80+); the padded bmm fallback computes "
                      "num_experts x tokens rows, slower than moe_experts='hf' here; moe_experts='padded_bmm' "
                      "takes fp16 (one host read per layer)", stacklevel=2)
    return padded_matmul(rows, matrix, route["slots"], route["capacity"])


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int, kernel: str) -> dict:
    """The pairs' order by expert (stable: token order inside a group), their tokens, the group ends, and
    each pair's slot in ``capacity`` rows per expert (the tokens; for ``"padded_bmm"`` the busiest
    expert's count rounded up, read once on the host)."""
    tokens, top_k = top_k_index.shape
    experts = top_k_index.reshape(-1)
    order = torch.sort(experts, stable=True).indices
    sorted_experts = experts.index_select(0, order)
    counts = torch.zeros(num_experts, dtype=torch.long, device=experts.device)
    counts = counts.scatter_add(0, experts, torch.ones_like(experts))
    ends = counts.cumsum(0)
    starts = ends - counts
    rank = torch.arange(order.numel(), device=order.device) - starts.index_select(0, sorted_experts)
    capacity = padded_capacity(counts) if kernel == "padded_bmm" else tokens
    return {"order": order, "token": order // top_k, "experts": sorted_experts, "ends": ends.to(torch.int32),
            "slots": sorted_experts * capacity + rank, "capacity": capacity, "kernel": kernel}


def concatenated_gate(experts: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' default expert gate: ``act_fn(gate) * up`` over the two halves."""
    gate, up = gate_up.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def gpt_oss_gate(experts: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: interleaved halves, gate clamped above, up clamped both sides,
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=experts.limit)
    up = up.clamp(min=-experts.limit, max=experts.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * experts.alpha))


def gate_of(experts: nn.Module) -> Callable | None:
    """The gate of a mapped experts layout, or None (the module keeps HF's forward)."""
    if not all(isinstance(getattr(experts, name, None), nn.Parameter) and getattr(experts, name).dim() == 3
               for name in ("gate_up_proj", "down_proj")):
        return None
    if getattr(experts, "has_post_expert_norm", False) or not getattr(experts, "has_gate", False):
        return None
    if getattr(experts, "_is_expert_parallel", False) or not isinstance(getattr(experts, "num_experts", None), int):
        return None
    if type(experts).__name__ == "GptOssExperts" and not experts.is_concatenated and experts.has_bias:
        return gpt_oss_gate
    own_gate = getattr(type(experts), "_apply_gate", None)
    if (experts.is_concatenated and not experts.has_bias and hasattr(experts, "act_fn")
            and getattr(own_gate, "__name__", "") == "_default_apply_gate"):
        return concatenated_gate
    return None


def grouped_experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, gate: Callable = concatenated_gate,
                            kernel: str = "grouped_mm") -> torch.Tensor:
    """HF's experts call (``hidden [tokens, H]``, ``top_k_index`` / ``top_k_weights [tokens, k]``), grouped.

    ``kernel``: "grouped_mm" (when the operands fit it, else the padded ``bmm`` at capacity = tokens),
    "bmm" (always that), or "padded_bmm" (``padded_experts_forward``: capacity the busiest expert's count).
    """
    route = sort_by_expert(top_k_index, experts.num_experts, kernel)
    if kernel == "padded_bmm":
        return padded_experts_forward(experts, hidden_states, route, top_k_weights, gate)
    rows = hidden_states.index_select(0, route["token"])
    transposed = bool(experts.is_transposed)
    projected = grouped_linear(rows, experts.gate_up_proj, transposed, route)
    if experts.has_bias:
        projected = projected + experts.gate_up_proj_bias.index_select(0, route["experts"])
    projected = grouped_linear(gate(experts, projected), experts.down_proj, transposed, route)
    if experts.has_bias:
        projected = projected + experts.down_proj_bias.index_select(0, route["experts"])
    weights = top_k_weights.reshape(-1).index_select(0, route["order"]).unsqueeze(-1)
    weighted = (projected * weights).to(hidden_states.dtype)
    return torch.zeros_like(hidden_states).index_add(0, route["token"], weighted)


def padded_experts_forward(experts: nn.Module, hidden_states: torch.Tensor, route: dict, top_k_weights: torch.Tensor,
                           gate: Callable) -> torch.Tensor:
    """The padded path (module doc): one ``[experts, capacity, .]`` block through both projections and the gate."""
    groups, capacity, width = experts.num_experts, route["capacity"], hidden_states.shape[-1]
    transposed = bool(experts.is_transposed)
    rows = hidden_states.index_select(0, route["token"])
    block = rows.new_zeros(groups * capacity, width).index_copy(0, route["slots"], rows).view(groups, capacity, width)
    gate_up = experts.gate_up_proj if transposed else experts.gate_up_proj.transpose(1, 2)  # [E, in, out] views
    down = experts.down_proj if transposed else experts.down_proj.transpose(1, 2)
    block = torch.bmm(block, gate_up)
    if experts.has_bias:
        block = block + experts.gate_up_proj_bias.unsqueeze(1)
    block = torch.bmm(gate(experts, block), down)
    if experts.has_bias:
        block = block + experts.down_proj_bias.unsqueeze(1)
    projected = block.reshape(groups * capacity, block.shape[-1]).index_select(0, route["slots"])
    weights = top_k_weights.reshape(-1).index_select(0, route["order"]).unsqueeze(-1)
    weighted = (projected * weights).to(hidden_states.dtype)
    return torch.zeros_like(hidden_states).index_add(0, route["token"], weighted)


class GroupedExpertsForward:
    """The instance-level ``forward`` of one experts module; ``remove()`` gives it back HF's."""

    def __init__(self, experts: nn.Module, gate: Callable, kernel: str = "grouped_mm"):
        self.experts = experts
        self.gate = gate
        self.kernel = kernel  # see grouped_experts_forward

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        return grouped_experts_forward(self.experts, hidden_states, top_k_index, top_k_weights, self.gate, self.kernel)

    def remove(self) -> None:
        """Give the experts module back its own forward, if this one is still installed."""
        remove_instance_attribute(self.experts, "forward", installed=self)


def install_grouped_experts(model: nn.Module, kernel: str = "grouped_mm") -> tuple[list[GroupedExpertsForward], list[str]]:
    """Swap every mapped experts module of ``model`` to the grouped forward with ``kernel``
    (``grouped_experts_forward``; ``"padded_bmm"`` for ``moe_experts="padded_bmm"``).

    Returns (the installed forwards, the names of experts modules whose layout is not mapped
    and that keep HF's forward); ``target.unpatch`` (the runtime's detach) removes them. An
    experts module is one with a 3-D ``gate_up_proj`` or ``down_proj`` parameter (transformers
    5's fused experts).
    """
    installed, kept = [], []
    for name, module in model.named_modules():
        if not any(isinstance(p, nn.Parameter) and p.dim() == 3 for p in
                   (getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None))):
            continue
        gate = gate_of(module)
        if gate is None or "forward" in vars(module):
            kept.append(name)
            continue
        forward = GroupedExpertsForward(module, gate, kernel)
        set_instance_attribute(module, "forward", forward)  # shadows HF's dispatching forward, nothing else changes
        installed.append(forward)
    return installed, kept

"""The MoE router's auxiliary (load-balancing) loss, exact across microbatches and stages.

Hugging Face's load-balancing loss is a product of batch-wide sums, not a sum over microbatches,
so the pipeline carries the three sums (assignments ``A``, routing probabilities ``P``, pairs
``N``) through each microbatch's layers and the host forms the loss from their totals: loss and
router gradients equal the unpipelined model's. The router is found through the model's own
``_can_record_outputs["router_logits"]``. The formula: docs/design.md, design notes,
``adapters/hf_moe.py``.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

STAT_KEYS = ("moe_counts", "moe_probs", "moe_rows")
"""Carry keys of the router statistics: ``A`` [E], ``P`` [E] (differentiable), ``N`` [] (see module doc)."""


@dataclass(frozen=True)
class Router:
    """How to read one model's router logits and aux-loss settings.

    router_class: module class whose output ``index`` is a layer's router logits [tokens, E].
    num_experts, top_k: the ``num_experts`` / ``num_experts_per_tok`` HF's aux loss is called with.
    coefficient: what the family's forward multiplies the aux loss by before adding it to the loss
        (``router_aux_loss_coef`` in most families, JetMoE's ``aux_loss_coef``; see ``aux_coefficient``);
        None: the family adds no aux loss to its loss.
    """

    router_class: type
    index: int
    num_experts: int
    top_k: int
    coefficient: float | None


def find_router(hf_model: nn.Module) -> Router | None:
    """The router of an MoE causal LM, from its own output recorders; None for a dense model."""
    backbone = getattr(hf_model, "model", None)
    recorders = getattr(type(backbone), "_can_record_outputs", None) or {}
    recorder = recorders.get("router_logits")
    if recorder is None:
        return None
    router_class = getattr(recorder, "target_class", None)
    if router_class is None:
        return None
    if not any(isinstance(m, router_class) for m in hf_model.modules()):
        return None  # the family can route, this configuration is dense (Gemma4 without its MoE block)
    config = hf_model.config
    num_experts = getattr(hf_model, "num_experts", None) or getattr(config, "num_local_experts", None) or getattr(
        config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    top_k = getattr(hf_model, "num_experts_per_tok", None) or getattr(config, "num_experts_per_tok", None)
    if num_experts is None or top_k is None:
        raise ValueError(f"{type(hf_model).__name__} has {router_class.__name__} routers, but neither the model nor its "
                         f"config names the number of experts ({num_experts}) and of experts per token ({top_k}) "
                         "that HF's load-balancing loss is called with")
    coefficient = aux_coefficient(hf_model)
    return Router(router_class, int(getattr(recorder, "index", 0)), int(num_experts), int(top_k),
                  None if coefficient is None else float(coefficient))


_COEFFICIENT_READ = re.compile(r"self\.([A-Za-z_][\w.]*)\s*\*\s*aux_loss\b")
"""``loss += self.<path> * aux_loss``: how every MoE ``ForCausalLM.forward`` in transformers adds its aux loss."""


def aux_coefficient(hf_model: nn.Module) -> float | None:
    """The coefficient the family's own ``forward`` multiplies the aux loss by (None: it adds none).

    Read from that forward's source, so a family that names it differently (JetMoE's
    ``self.aux_loss_coef``, Qwen3-VL's ``self.config.text_config.router_aux_loss_coef``) gets
    its own. When the source cannot be read, ``router_aux_loss_coef`` as most families name it.
    The self-check of an unverified family compares the model's own loss, aux included, so a
    wrong reading here is refused, never trained on.
    """
    try:
        source = inspect.getsource(type(hf_model).forward)
    except (OSError, TypeError):  # no source (compiled, interactive): the common name
        coefficient = getattr(hf_model, "router_aux_loss_coef", None)
        return None if coefficient is None else float(coefficient)
    match = _COEFFICIENT_READ.search(source)
    if match is None:
        return None
    value: Any = hf_model
    for part in match.group(1).split("."):
        value = getattr(value, part, None)
    return None if value is None else float(value)


def routers_in(layer: nn.Module, router: Router) -> list[nn.Module]:
    """The router modules inside one decoder layer (none for a dense layer of an MoE model)."""
    return [m for m in layer.modules() if isinstance(m, router.router_class)]


def empty_stats(reference: torch.Tensor, num_experts: int) -> dict[str, torch.Tensor]:
    """Zero statistics for one microbatch (fp32, on the device of ``reference``)."""
    zeros = dict(dtype=torch.float32, device=reference.device)
    return {"moe_counts": torch.zeros(num_experts, **zeros), "moe_probs": torch.zeros(num_experts, **zeros),
            "moe_rows": torch.zeros((), **zeros)}


def add_layer_stats(stats: dict[str, torch.Tensor], logits: torch.Tensor, token_mask: torch.Tensor | None,
                    router: Router) -> dict[str, torch.Tensor]:
    """Add one MoE layer's statistics (mirrors ``load_balancing_loss_func``'s per-layer sums)."""
    probs = torch.softmax(logits, dim=-1)
    _, selected = torch.topk(probs, router.top_k, dim=-1)
    if token_mask is None:
        weight = torch.ones(probs.shape[0], dtype=torch.float32, device=probs.device)
    else:
        weight = token_mask.reshape(-1).to(device=probs.device, dtype=torch.float32)
    counts = torch.zeros(router.num_experts, dtype=torch.float32, device=probs.device)
    counts = counts.scatter_add(0, selected.reshape(-1), weight.repeat_interleave(router.top_k))
    return {
        "moe_counts": stats["moe_counts"] + counts,
        "moe_probs": stats["moe_probs"] + (probs.float() * weight.unsqueeze(-1)).sum(dim=0),
        "moe_rows": stats["moe_rows"] + weight.sum(),
    }


def aux_loss(counts: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``E * sum_e (A_e / N) * (P_e / N)`` from the whole batch's sums (see the module doc)."""
    counts, rows = counts.detach(), rows.detach()
    return torch.sum((counts / rows) * (probs / rows)) * num_experts


def per_microbatch_aux_loss(counts: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The naive alternative (mean over microbatches of each microbatch's own aux loss), for comparison.

    Args are per-microbatch rows ([M, E], [M, E], [M]); NOT what the pipeline uses.
    """
    parts = [aux_loss(counts[m], probs[m], rows[m], num_experts) for m in range(counts.shape[0])]
    return torch.stack(parts).mean()


class RouterTap:
    """Collects the router logits of one decoder layer's call through forward hooks."""

    def __init__(self, routers: list[nn.Module], index: int):
        self.routers = routers
        self.index = index
        self.logits: list[torch.Tensor] = []
        self.handles: list[Any] = []

    def __enter__(self) -> "RouterTap":
        def hook(module, args, output):
            self.logits.append(output[self.index] if isinstance(output, (tuple, list)) else output)

        self.handles = [m.register_forward_hook(hook) for m in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

"""Which parameters of a layer a token actually runs through: routed experts run top_k of E.

A Mixture-of-Experts layer holds every expert's weights but routes each token through ``top_k``
of its ``num_experts``, so its compute follows the *active* parameters. Routers, fused experts
(transformers 5) and listed experts are found from the modules' attribute names, as every Hugging
Face MoE family (and common hand-written blocks) spells them; everything else is dense. The rules:
docs/design.md, design notes, ``cost/experts.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class RoutedExperts:
    """One group of routed experts in a layer: its parameters and the share of them a token runs."""

    params: tuple[nn.Parameter, ...]
    num_experts: int
    top_k: int

    @property
    def active_share(self) -> float:
        """Fraction of the group's parameters one token runs through: ``top_k / num_experts``."""
        return self.top_k / self.num_experts


def _int_attr(module: nn.Module, name: str) -> int | None:
    value = getattr(module, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _router_top_k(layer: nn.Module) -> dict[int, int | None]:
    """``num_experts -> top_k`` of the layer's routers (None where two routers disagree)."""
    found: dict[int, int | None] = {}
    for module in layer.modules():
        experts, top_k = _int_attr(module, "num_experts"), _int_attr(module, "top_k")
        if experts is None or top_k is None:
            continue
        found[experts] = top_k if found.get(experts, top_k) == top_k else None
    return found


def routed_experts(layer: nn.Module) -> list[RoutedExperts]:
    """The routed expert groups inside ``layer`` (empty for a dense layer)."""
    top_ks = _router_top_k(layer)
    groups = []
    for module in layer.modules():
        num_experts = _int_attr(module, "num_experts")
        if num_experts is None or num_experts < 1:
            continue
        top_k = top_ks.get(num_experts)
        if top_k is None or not 0 < top_k <= num_experts:
            continue
        if _int_attr(module, "top_k") is None:
            fused = tuple(p for p in module.parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == num_experts)
            if fused:
                groups.append(RoutedExperts(fused, num_experts, top_k))
        else:
            for child in module.children():
                if isinstance(child, nn.ModuleList) and len(child) == num_experts:
                    groups.append(RoutedExperts(tuple(child.parameters()), num_experts, top_k))
    return groups


def inactive_parameters(layer: nn.Module) -> dict[int, float]:
    """``id(parameter) -> share of it a token does not run`` for every routed expert parameter."""
    return {id(p): 1.0 - group.active_share for group in routed_experts(layer) for p in group.params}

"""Per-layer costs before and during training.

Before the first step nothing has been measured, so ``estimate_costs`` prices every layer
from its size: matmul-dominated layers cost ``2 * params * tokens`` FLOPs forward, backward
twice that, and the recompute inside backward as much as the forward. ``params`` there are the
parameters a token runs through: a Mixture-of-Experts layer holds all its experts (their bytes
are uploaded and their gradients downloaded in full) but routes each token through ``top_k`` of
them (``experts``). During training the
engine measures stages, and ``MovingCostProfile`` turns those measurements into per-layer
moving averages; ``cost_change`` says how far the numbers moved, so the planner re-plans
only when it matters.
"""

from __future__ import annotations

import dataclasses

import threading
from typing import Iterable, Sequence

import torch
from torch import nn

from .activations import (SCORES_BACKWARD, SCORES_FORWARD, SCORES_KEPT, scores_bytes_per_token,
                          sdpa_kept_mask_bytes_per_token)
from .attention_blocks import attention_blocks, attention_flops_per_token, materialised_score_heads
from .experts import inactive_parameters
from .profile import CostProfile, LayerCost
from .autocast_cast import layer_device_bytes
from ..schedule.plan import Plan
from ..setup_progress import ProgressCallback, report

TIME_KINDS = ("forward", "recompute", "backward")
ESTIMATE_PHASE = "RoundPipe: estimating layer costs"


# --------------------------------------------------------------------- estimates from sizes
def _unique_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Drop repeats (tied weights appear twice in ``parameters()`` of some modules)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _embedding_param_ids(layer: nn.Module) -> set[int]:
    """Parameters of embedding tables: a lookup, not a matmul, so they cost ~no compute."""
    return {id(p) for m in layer.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for p in m.parameters()}


def _output_features(layer: nn.Module) -> int:
    """Width of the layer's output, guessed from its last sized submodule (0 when unknown)."""
    width = 0
    for m in layer.modules():
        if isinstance(m, nn.Linear):
            width = m.out_features
        elif isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            width = m.embedding_dim
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            width = int(torch.Size(m.normalized_shape).numel())
    return width


def estimate_costs(
    layers: Sequence[nn.Module],
    example_tokens: int,
    hidden_bytes_per_token: int | None,
    compute_dtype: torch.dtype,
    flops_per_second: float = 5e10,
    link_bytes_per_second: float | None = None,
    progress: ProgressCallback | None = None,
    context_tokens: int | None = None,
) -> CostProfile:
    """Estimate every layer's costs for microbatches of ``example_tokens`` tokens.

    * forward time: ``2 * params * tokens`` FLOPs at ``flops_per_second``, counting only
      matmul parameters (embedding tables are lookups) and of routed experts only the
      ``top_k / num_experts`` share a token runs (``experts.routed_experts``); every layer
      also pays one FLOP per output element, so parameter-free layers and embeddings are cheap
      but not free; with ``context_tokens`` (the tokens of one sequence), an attention block
      adds its scores and weighted sums for causal sequences of that length
      (``attention_blocks``: ``4 x q_dim x min(context / 2, window)`` FLOPs per token);
    * ``active_params``: the parameters one token runs through (all of them in a dense layer);
    * recompute time equals the forward, backward time is twice the forward;
    * ``weight_bytes``: parameters as uploaded (``cost.autocast_cast``: those autocast casts in
      the compute dtype, other floating ones such as embeddings and norms in their own), buffers in
      their own dtype; ``device_weight_bytes``: as the worker holds them (a trainable cast
      parameter as its fp32 leaf plus autocast's compute-dtype copy);
    * ``grad_bytes``: trainable parameters in their own dtype (the fp32 leaves' gradients);
      ``download_grad_bytes``: those gradients as downloaded (``autocast_cast.download_dtype``);
    * ``act_bytes_per_token``: ``hidden_bytes_per_token`` for every layer when given, otherwise
      the width of the layer's last Linear/Embedding/Norm times the compute dtype size; a layer with an
      ``activation_bytes_per_token(dtype_bytes)`` method (the Hugging Face adapter's layers) gives its
      own ``LayerCost`` activation fields instead (its carry, graph and transients, ``cost.activations``).

    With ``context_tokens``, what grows with the sequence is priced too (``cost.activations``): a
    layer with attention that materialises its scores (``materialised_score_heads``) holds them in
    its working sets, and a layer with a ``dense_mask_bytes_per_token(context_tokens, dtype_bytes)``
    method (the Hugging Face prefix) puts dense masks in its output, which every following layer
    with attention blocks passes on (they read it). A fused attention block (sdpa) that reads a carried
    dense mask keeps an additive copy of it (``sdpa_kept_mask_bytes_per_token``).

    ``link_bytes_per_second`` (host <-> worker) is kept with the profile for the partitioner.
    ``progress(phase, done, total)`` hears of each layer done (phase ``ESTIMATE_PHASE``).
    """
    if example_tokens < 1:
        raise ValueError(f"example_tokens must be at least 1, got {example_tokens}")
    if flops_per_second <= 0:
        raise ValueError(f"flops_per_second must be positive, got {flops_per_second}")
    if not compute_dtype.is_floating_point:
        raise ValueError(f"compute_dtype must be a floating dtype, got {compute_dtype}")
    dtype_bytes = torch.empty((), dtype=compute_dtype).element_size()
    device_bytes = layer_device_bytes(layers, compute_dtype)
    out = []
    carried_mask = 0  # per token, dense attention masks in the carry (passed on by attention layers)
    for index, layer in enumerate(layers):
        report(progress, ESTIMATE_PHASE, index, len(layers))
        params = _unique_tensors(layer.parameters())
        lookups = _embedding_param_ids(layer)
        inactive = inactive_parameters(layer)
        idle = sum(p.numel() * inactive[id(p)] for p in params if id(p) in inactive)
        matmul_params = sum(p.numel() for p in params if id(p) not in lookups) - idle
        on_device = device_bytes[index]
        if hidden_bytes_per_token is not None:
            act_bytes = int(hidden_bytes_per_token)
        else:
            act_bytes = _output_features(layer) * dtype_bytes
        output_elements = act_bytes // dtype_bytes
        attention = attention_flops_per_token(attention_blocks(layer), context_tokens) if context_tokens else 0.0
        forward_s = (2.0 * matmul_params * example_tokens + output_elements * example_tokens
                     + attention * example_tokens) / flops_per_second
        cost = LayerCost(forward_s, forward_s, 2.0 * forward_s, on_device.upload, on_device.grads, act_bytes,
                         params=sum(p.numel() for p in params),
                         trainable_params=sum(p.numel() for p in params if p.requires_grad),
                         active_params=round(sum(p.numel() for p in params) - idle),
                         device_weight_bytes=on_device.held, download_grad_bytes=on_device.downloads)
        own = getattr(layer, "activation_bytes_per_token", None)
        if hidden_bytes_per_token is None and callable(own):
            for name, value in own(dtype_bytes).items():
                setattr(cost, name, int(value))
        if context_tokens:
            carried_mask = _price_sequence_memory(cost, layer, context_tokens, dtype_bytes, carried_mask)
        out.append(cost)
    report(progress, ESTIMATE_PHASE, len(layers), len(layers))
    return CostProfile(out, tokens_per_microbatch=int(example_tokens), measured=False, source="estimate",
                       dtype_bytes=dtype_bytes, link_bytes_per_second=link_bytes_per_second)


def _price_sequence_memory(cost: LayerCost, layer: nn.Module, context_tokens: int, dtype_bytes: int,
                           carried_mask: int) -> int:
    """Add to ``cost`` what grows with the sequence (see ``estimate_costs``); return the mask bytes per
    token its output carries on."""
    own_mask = getattr(layer, "dense_mask_bytes_per_token", None)
    blocks = attention_blocks(layer)
    if callable(own_mask):
        carried_mask = int(own_mask(context_tokens, dtype_bytes))
    elif not blocks:
        carried_mask = 0  # a layer without attention does not pass the masks on
    if cost.act_grad_bytes_per_token is None:
        cost.act_grad_bytes_per_token = cost.act_bytes_per_token  # a mask gets no gradient
    # Without a graph of its own, a layer's graph was its output (``CostProfile``): the carried masks stay out
    # of it, they are the stage input's (``CostView.in_bytes``) and no new tensor.
    graph = cost.act_bytes_per_token if cost.graph_bytes_per_token is None else cost.graph_bytes_per_token
    if callable(own_mask) and cost.graph_bytes_per_token is not None:
        cost.graph_bytes_per_token = graph = graph + carried_mask  # the masks it makes are new tensors of its own
    cost.act_bytes_per_token += carried_mask
    heads = materialised_score_heads(layer)
    if heads:
        scores = scores_bytes_per_token(heads, context_tokens, dtype_bytes)
        cost.graph_bytes_per_token = graph + carried_mask + SCORES_KEPT * scores
        cost.forward_transient_bytes_per_token = (cost.forward_transient_bytes_per_token or 0) + SCORES_FORWARD * scores
        cost.backward_transient_bytes_per_token = (cost.backward_transient_bytes_per_token or 0) + SCORES_BACKWARD * scores
    elif blocks and carried_mask:
        # a fused kernel turns the carried boolean mask into an additive one it keeps, once per block
        cost.graph_bytes_per_token = graph + len(blocks) * sdpa_kept_mask_bytes_per_token(context_tokens, dtype_bytes)
    return carried_mask


# --------------------------------------------------------------------- how far costs moved
def _stage_totals(costs: CostProfile, plan: Plan) -> dict[str, float]:
    """Per-stage compute per microbatch: the totals a plan's balance depends on."""
    totals = {}
    layers = costs.layers
    for stage in plan.forward_stages():
        fused = plan.fused_last and stage.index == len(plan.forward) - 1
        per_layer = (lambda c: c.forward_s + c.backward_s) if fused else (lambda c: c.forward_s)
        totals[stage.name] = sum(per_layer(layers[i]) for i in stage.layers)
    for stage in plan.dispatched_backward_stages():
        totals[stage.name] = sum(layers[i].recompute_s + layers[i].backward_s for i in stage.layers)
    return totals


def cost_change(previous: CostProfile, current: CostProfile, plan: Plan | None = None) -> tuple[float, str]:
    """Largest relative change between two profiles, and what changed (for a log line).

    With a ``plan``, compares each stage's total (forward stages: forward time; backward stages:
    recompute + backward; the fused stage: forward + backward): only changes that move a stage
    matter to the plan. Without one, compares each layer's forward and recompute+backward time
    relative to the average layer time of that direction, so a tiny layer that doubles does not
    count as a big move but a typical layer that does, does.
    """
    if len(previous) != len(current):
        return float("inf"), f"the layer count ({len(previous)} -> {len(current)})"

    def rel(old: float, new: float, scale: float) -> float:
        if scale <= 0:
            return 0.0 if new == old else float("inf")
        return abs(new - old) / scale

    worst, where = 0.0, "nothing"
    if plan is not None:
        old, new = _stage_totals(previous, plan), _stage_totals(current, plan)
        for name in old:
            change = rel(old[name], new[name], old[name])
            if change > worst:
                worst, where = change, f"stage {name} ({old[name]:.3g}s -> {new[name]:.3g}s per microbatch)"
        return worst, where
    directions = {
        "forward": lambda c: c.forward_s,
        "recompute+backward": lambda c: c.recompute_s + c.backward_s,
    }
    for label, get in directions.items():
        olds = [get(c) for c in previous.layers]
        news = [get(c) for c in current.layers]
        mean = sum(olds) / len(olds) if olds else 0.0
        for i, (o, n) in enumerate(zip(olds, news)):
            change = rel(o, n, mean)
            if change > worst:
                worst, where = change, f"layer {i} {label} ({o:.3g}s -> {n:.3g}s)"
    return worst, where


# --------------------------------------------------------------------- moving averages of measurements
COMBINED_KINDS = {"fused": ("forward", "backward"), "recompute_backward": ("recompute", "backward"),
                  # layer-grain recompute: a forward without grad keeping layer inputs, then recompute + backward
                  "layer_recompute_backward": ("forward", "recompute", "backward")}


class MovingCostProfile:
    """Per-layer exponential moving averages of measured times, seeded by an estimate.

    The first measurement of a layer and kind replaces the estimate outright (estimates from
    sizes can be off by a large factor); later ones are blended with weight ``smoothing``.
    Times are seconds per microbatch. Thread-safe: workers may report concurrently.
    """

    def __init__(self, base: CostProfile, smoothing: float = 0.3) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        self._base = base
        self._times = {kind: [getattr(c, f"{kind}_s") for c in base.layers] for kind in TIME_KINDS}
        self._seen = {kind: [False] * len(base.layers) for kind in TIME_KINDS}
        self._lock = threading.Lock()
        self.observations = 0

    def __len__(self) -> int:
        return len(self._base.layers)

    def _check_kind(self, kind: str, allowed: Sequence[str]) -> None:
        if kind not in allowed:
            raise ValueError(f"unknown time kind {kind!r}; use one of {', '.join(repr(k) for k in allowed)}")

    def _check_layer(self, index: int) -> None:
        if not 0 <= index < len(self):
            raise IndexError(f"layer index {index} is outside the model's {len(self)} layers")

    def _observe_locked(self, index: int, kind: str, seconds: float) -> None:
        times, seen = self._times[kind], self._seen[kind]
        times[index] = seconds if not seen[index] else (1 - self.smoothing) * times[index] + self.smoothing * seconds
        seen[index] = True
        self.observations += 1

    def observe(self, layer_index: int, kind: str, seconds: float) -> None:
        """Record one microbatch's measured ``seconds`` of ``kind`` ("forward", "recompute", "backward")."""
        self._check_kind(kind, TIME_KINDS)
        self._check_layer(layer_index)
        if seconds < 0:
            raise ValueError(f"a measured time cannot be negative, got {seconds}")
        with self._lock:
            self._observe_locked(layer_index, kind, float(seconds))

    def observe_stage(self, layer_range: tuple[int, int] | range, kind: str, seconds: float, microbatches: int = 1) -> None:
        """Record a stage measurement, spread over its layers in proportion to their current times.

        ``seconds`` covers ``microbatches`` microbatches of the stage ``[start, end)``. ``kind``
        may also be a task that does two kinds of work, spread over both together: "fused"
        (forward + loss + backward of the last stage, no recompute) and "recompute_backward"
        (a backward task that recomputes the stage's forward first).
        """
        self._check_kind(kind, TIME_KINDS + tuple(COMBINED_KINDS))
        start, end = (layer_range.start, layer_range.stop) if isinstance(layer_range, range) else layer_range
        if start >= end:
            raise ValueError(f"stage range [{start}:{end}] is empty")
        self._check_layer(start)
        self._check_layer(end - 1)
        if microbatches < 1:
            raise ValueError(f"microbatches must be at least 1, got {microbatches}")
        per_microbatch = float(seconds) / microbatches
        kinds = COMBINED_KINDS.get(kind, (kind,))
        with self._lock:
            shares = [(i, k, self._times[k][i]) for i in range(start, end) for k in kinds]
            total = sum(s for _, _, s in shares)
            for i, k, s in shares:
                # Without estimates to go by (all zero), split evenly.
                part = s / total if total > 0 else 1.0 / len(shares)
                self._observe_locked(i, k, per_microbatch * part)

    def profile(self) -> CostProfile:
        """A snapshot as a ``CostProfile`` (``measured`` once anything was observed)."""
        with self._lock:
            layers = [
                dataclasses.replace(c, forward_s=self._times["forward"][i], recompute_s=self._times["recompute"][i],
                                    backward_s=self._times["backward"][i])
                for i, c in enumerate(self._base.layers)
            ]
            measured = self.observations > 0
        return dataclasses.replace(self._base, layers=layers, measured=measured,
                                   source="measured" if measured else self._base.source)

    def moved_since(self, previous: CostProfile, threshold: float = 0.2, plan: Plan | None = None) -> bool:
        """True when some stage-relevant total changed by more than ``threshold`` (see ``cost_change``)."""
        change, _ = cost_change(previous, self.profile(), plan)
        return change > threshold

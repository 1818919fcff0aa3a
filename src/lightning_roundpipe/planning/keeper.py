"""Keeps the plan of a running pipeline: the first plan from estimates, re-plans from measurements.

The first plan comes from costs estimated from sizes and FLOPs (``cost_estimate``), so the first
step already runs a reasonable plan. Measured stage times feed per-layer moving averages; only the
``auto`` policy re-plans when they move by more than the threshold, so the default ``compute``
plan depends only on shapes, options and the first batch (bit-identical weights for the same seed
and data). Microbatches, recompute and the host's work are chosen and priced here too
(``defaults``, ``PlanKeeper.observe_host``; ``tracing/records.HostClock`` times the host's work). A steady
step only appends its measurements to ``unread``; they are folded in, in order, when the keeper next
plans or reports (``read``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..cost.attention_blocks import attention_blocks
from ..cost.estimate import MovingCostProfile, estimate_costs
from .defaults import (MICROBATCHES_PER_WORKER, choose_microbatches, choose_recompute, estimate_host_work,
                       host_memory_budget, no_recompute_peak_bytes, rescaled)
from ..cost.profile import format_bytes
from .keeper_config import KeeperConfig
from .partition import partition
from .predictor import HostWork, predict
from .replan import Replanner
from ..schedule.plan import Plan, PlanError, PlanFacts
from .cuts import simple_plan
from .report import PlanReport, build_report
from ..setup_progress import ProgressCallback

log = logging.getLogger("lightning_roundpipe")

ASSUMED_TOKENS_PER_MICROBATCH = 512  # for the estimate before the first batch is seen
CHECK_STEPS = (1, 2, 3, 5, 8)  # re-plan checks early, then every CHECK_EVERY steps
CHECK_EVERY = 25
HOST_SMOOTHING = 0.3  # weight of a new host measurement (the first one replaces the estimate)


def backward_cut_like_forward(cfg) -> bool:
    """Whether the partition options allow backward stages equal to the forward ones (what keeping
    the forward graphs needs): not when the user cut them differently by hand or by stage counts."""
    if cfg.policy == "manual":
        return cfg.manual_backward is None or [list(r) for r in cfg.manual_backward] == [list(r) for r in cfg.manual_forward]
    if cfg.policy in ("uniform", "params"):
        return cfg.backward_stages is None or cfg.backward_stages == cfg.forward_stages
    return True


class PlanKeeper:
    """The running plan; ``progress`` hears how far the first estimate and plan search are."""

    def __init__(self, layers: list[nn.Module], num_workers: int, config: KeeperConfig, *, fused_last: bool,
                 progress: ProgressCallback | None = None):
        """``config.microbatches`` None and ``config.recompute`` "auto" are chosen from the estimate
        (``defaults``); ``recompute`` may also be "always", "never" or a bool (True: recompute).
        ``fused_last``: the module computes its loss in its last stage.

        Under a memory budget the activations of the assumed microbatch may not fit where the real,
        smaller ones do: the first plan then prices one-token microbatches (weights and gradients
        must fit whatever the batch) and the first batch plans again with its real tokens per
        microbatch, refusing there, before the step runs, when they do not fit."""
        microbatches, partition_cfg, recompute = config.microbatches, config.partition, config.recompute
        compute_dtype, backend = config.compute_dtype, config.backend
        link_bytes_per_second, flops_per_second = config.link_bytes_per_second, config.flops_per_second
        memory_budget_bytes, budget_option = config.memory_budget_bytes, config.budget_option
        microbatch_overhead_s = config.microbatch_overhead_s
        self.config = config
        self.microbatch_overhead_s = microbatch_overhead_s
        self.num_workers = num_workers
        self.cfg = partition_cfg
        self.fused_last = fused_last
        dtype = compute_dtype or next((p.dtype for l in layers for p in l.parameters()), torch.float32)
        # Attention is priced for sequences of the assumed microbatch's length until the first batch shows the real one.
        self.context_tokens = ASSUMED_TOKENS_PER_MICROBATCH

        def estimate(progress=None):
            return estimate_costs(layers, ASSUMED_TOKENS_PER_MICROBATCH, None, dtype, flops_per_second=flops_per_second,
                                  link_bytes_per_second=link_bytes_per_second, progress=progress,
                                  context_tokens=self.context_tokens)

        self.estimate = estimate
        costs = estimate(progress)
        # With attention blocks, the first batch's sequence length prices them (``first_batch``).
        self.context_pending = any(attention_blocks(layer) for layer in layers)
        self._moving = MovingCostProfile(costs)
        n = len(layers)
        p = partition_cfg

        def plan_for(profile, m: int, rec: bool) -> Plan:
            if p.policy in ("uniform", "params"):
                plan = simple_plan(n, num_workers, p.policy, layer_weights=[c.weight_bytes for c in profile.layers],
                                   forward_stages=p.forward_stages, backward_stages=p.backward_stages,
                                   same_cuts=not rec, fused_last=fused_last)
                return plan.with_facts(PlanFacts(policy=p.policy, recompute=rec))
            return partition(p.policy, profile, num_workers, m, memory_budget_bytes=memory_budget_bytes,
                             link_bytes_per_second=link_bytes_per_second, fused_last=fused_last, recompute=rec,
                             manual_forward=p.manual_forward, manual_backward=p.manual_backward, progress=progress,
                             microbatch_overhead_s=microbatch_overhead_s, budget_option=budget_option)

        # Open choices are made for an assumed step of two microbatches per worker (the batch is not seen yet).
        step_microbatches = microbatches or MICROBATCHES_PER_WORKER[1] * num_workers
        if recompute == "auto" and not backward_cut_like_forward(p):
            recompute = "always"  # the user's backward stages differ from the forward ones: only recompute runs them
        self.recompute_open = recompute == "auto"  # kept graphs are checked again for the first batch's tokens
        self.memory_budget_bytes, self.budget_option = memory_budget_bytes, budget_option
        if isinstance(recompute, str):
            budget = memory_budget_bytes if memory_budget_bytes is not None else host_memory_budget()
            recompute = choose_recompute(recompute, backend, costs, step_microbatches, budget)
        self.recompute = recompute
        def predicted_step(profile, m: int) -> float:
            return predict(plan_for(profile, m, recompute), profile, num_workers, m,
                           link_bytes_per_second=link_bytes_per_second, recompute=recompute,
                           microbatch_overhead_s=microbatch_overhead_s).step_s

        self.plan_for, self.predicted_step = plan_for, predicted_step
        self.open_microbatches = microbatches is None  # chosen again for the first batch seen
        if microbatches is None:
            microbatches = choose_microbatches(costs, num_workers, ASSUMED_TOKENS_PER_MICROBATCH * step_microbatches,
                                               predicted_step)
        # Under a budget, the first batch's real microbatches are checked against it before anything runs:
        # the plan was priced for ``budget_checked_tokens`` tokens per microbatch (issue 43: a longer
        # first batch was refused only by a worker's allocation, after layers had run).
        self.memory_check_pending = memory_budget_bytes is not None
        self.budget_checked_tokens = ASSUMED_TOKENS_PER_MICROBATCH
        try:
            self.use(costs, microbatches)
        except PlanError:
            if memory_budget_bytes is None:
                raise
            self.use(rescaled(costs, 1), microbatches)  # still refused when weights and gradients alone do not fit
            self.budget_checked_tokens = 1
        self.steps_seen = 0
        self.choice_note: str | None = None  # how the first batch changed the microbatch count, if it did
        self._host_source = "estimate"
        self.host_measured: set[str] = set()  # the HostWork fields measured at least once
        # Steps ended but not folded in yet: the runtime appends each step's measurements (``unread``) and
        # host times (``unread_host``, ``observe_host``'s arguments), and calls ``after_steps`` once
        # ``steps_seen + len(unread)`` reaches ``next_read``: the next re-plan check (the first step always).
        self.unread: list = []
        self.unread_host: list[tuple[float | None, float | None]] = []
        self.next_read = 1

    def use(self, costs, microbatches: int) -> None:
        """Plan for ``microbatches`` under ``costs`` (the estimate) and start the re-planner and host estimate
        afresh."""
        p = self.cfg
        self.microbatches = microbatches
        self.plan = self.plan_for(costs, microbatches, self.recompute)
        self.replanner = Replanner(self.plan, costs, self.num_workers, microbatches, threshold=p.replan_threshold,
                                   policy=p.policy, microbatch_overhead_s=self.microbatch_overhead_s) \
            if p.policy == "auto" else None
        self._host = estimate_host_work(costs, microbatches, self.fused_last)

    @property
    def wants_first_batch(self) -> bool:
        """Whether ``first_batch`` still has a choice to make (before the first step)."""
        return (self.open_microbatches or self.memory_check_pending or self.context_pending) and not self.steps_seen

    def first_batch(self, batch_size: int, tokens: int) -> Plan | None:
        """The microbatch count left open, chosen again for the first batch (``batch_size`` samples,
        ``tokens`` rows of work), attention re-priced for its sequences of ``tokens / batch_size``
        tokens (``cost.attention_blocks``), and a memory budget checked against its real
        microbatches; returns the new plan when it changed (once, before any step)."""
        if not self.wants_first_batch:
            return None
        repriced = False
        if self.context_pending:  # attention priced for the first batch's sequences (``tokens / batch_size`` each)
            self.context_pending = False
            self.context_tokens = max(1, tokens // max(1, batch_size))
            # estimated again even for the assumed length: the batch may have changed what layers price (masks)
            fresh = self.estimate()
            if fresh.layers != self._moving.profile().layers:
                self._moving = MovingCostProfile(fresh)
                repriced = True
        costs = self._moving.profile()  # still the estimate: nothing has been measured yet
        m = (choose_microbatches(costs, self.num_workers, tokens, self.predicted_step, most=batch_size)
             if self.open_microbatches else self.microbatches)
        if self.memory_check_pending:  # a PlanError here names the budget's option; the next batch checks again
            split = max(1, min(m, batch_size))
            per_microbatch = -(-tokens // split)
            # Re-priced sequences (attention scores, dense masks) change every layer's bytes per token.
            switched = self._check_kept_graphs(rescaled(costs, per_microbatch), m)  # to recompute: plan again
            if (repriced or switched or self.budget_checked_tokens < ASSUMED_TOKENS_PER_MICROBATCH
                    or per_microbatch > self.budget_checked_tokens):
                self.use(rescaled(costs, per_microbatch), m)
                self.memory_check_pending = self.open_microbatches = False
                return self.plan
            self.memory_check_pending = False  # the plan was priced for longer microbatches: it fits these
        self.open_microbatches = False
        if m == self.microbatches:
            if not repriced:
                return None
            before = self.plan
            self.use(costs, m)
            return self.plan if self.plan != before else None
        # Said once, in the plan table (``report``), not logged per runtime: the strategy builds
        # one runtime per Trainer call and each makes the same choice.
        self.choice_note = (f"microbatches: {m}, chosen for the first batch ({batch_size} samples); "
                            f"the estimate before any batch was seen gave {self.microbatches}")
        log.debug("RoundPipe chose %d microbatches (not %d) for batches of %d samples", m, self.microbatches, batch_size)
        self.use(costs, m)
        return self.plan

    def _check_kept_graphs(self, costs, microbatches: int) -> bool:
        """With recompute off, a worker keeps the forward graphs of every microbatch of its stages until their
        backward (``no_recompute_peak_bytes`` bounds them). Chosen for the assumed 512-token microbatches, that may
        not fit the first batch's: ``recompute="auto"`` then recomputes, ``"never"`` is refused here, before any
        work (issue 43: a 4 x 4,096-token batch used to fail on the worker after its forward stages ran).
        Returns whether it switched to recompute."""
        if self.recompute or self.memory_budget_bytes is None:
            return False
        need = no_recompute_peak_bytes(costs, microbatches)
        if need <= self.memory_budget_bytes:
            return False
        if self.recompute_open:
            log.debug("RoundPipe recomputes: %d microbatches' kept forward graphs (%s) exceed the budget (%s)",
                      microbatches, format_bytes(need), format_bytes(self.memory_budget_bytes))
            self.recompute = True
            return True
        raise PlanError(
            f"recompute='never' keeps the forward graphs of all {microbatches} microbatches until their backward: "
            f"{format_bytes(need)} ({need} bytes) at {costs.tokens_per_microbatch} tokens per microbatch, over the "
            f"per-worker memory budget of {format_bytes(self.memory_budget_bytes)} ({self.memory_budget_bytes} "
            f"bytes, {self.budget_option}). Use recompute='auto' or 'always', fewer tokens per microbatch, or raise "
            f"{self.budget_option}.")

    def observe_host(self, between_s: float | None, outside_s: float | None) -> None:
        """Record the host's work of one step as measured (None: not measured this step). The first
        measurement of each part replaces the estimate; later ones are blended in (``HOST_SMOOTHING``)."""
        parts = {"between_s": between_s, "outside_s": outside_s}
        values = {}
        for name, new in parts.items():
            old = getattr(self._host, name)
            if new is None:
                values[name] = old
            else:
                values[name] = new if name not in self.host_measured else (1 - HOST_SMOOTHING) * old + HOST_SMOOTHING * new
                self.host_measured.add(name)
        self._host = HostWork(**values)
        if self.host_measured:
            self._host_source = "measured"

    def report(self) -> PlanReport:
        """The plan table's data: the plan with its costs, microbatches, recompute and host memory."""
        self.read()
        return build_report(self.plan, self._moving.profile(), self.num_workers, self.microbatches,
                            recompute=self.recompute, host=self._host, host_source=self._host_source,
                            microbatch_overhead_s=self.microbatch_overhead_s)

    def observe(self, measurements) -> None:
        """Fold one step's measured ``(stage, kind, seconds)`` into the moving cost estimate."""
        for stage, kind, seconds in measurements:
            self._moving.observe_stage((stage.start, stage.end), kind, seconds)

    @property
    def moving(self) -> MovingCostProfile:
        """The per-layer moving estimate of measured times, with every step ended read in (``read``)."""
        self.read()
        return self._moving

    @property
    def host(self) -> HostWork:
        """The host's work per step: the estimate, then the measured steps' blend (``observe_host``)."""
        self.read()
        return self._host

    @property
    def host_source(self) -> str:
        """Where ``host`` comes from: "estimate", or "measured" once a step's host work was measured."""
        self.read()
        return self._host_source

    def read(self) -> None:
        """Fold the steps not read yet into the moving estimates, in the order they ended (the same
        estimates as observing each step as it ended)."""
        host = list(self.unread_host)
        self.unread_host.clear()  # the same list stays HostClock's sink (tracing/records.py)
        for between_s, outside_s in host:
            self.observe_host(between_s, outside_s)
        steps, self.unread = self.unread, []
        for measurements in steps:
            self.observe(measurements)
            self.steps_seen += 1

    def after_steps(self) -> Plan | None:
        """Read the steps ended since the last read (``unread``); return a new plan when the auto policy
        decided to re-plan. The runtime calls it when ``next_read`` is reached: a re-plan check."""
        self.read()
        if self.replanner is None:  # nothing to check: read every CHECK_EVERY steps (memory stays flat) and when reported
            self.next_read = (self.steps_seen // CHECK_EVERY + 1) * CHECK_EVERY
            return None
        self.next_read = next((n for n in CHECK_STEPS if n > self.steps_seen),
                              (self.steps_seen // CHECK_EVERY + 1) * CHECK_EVERY)
        if self.steps_seen not in CHECK_STEPS and self.steps_seen % CHECK_EVERY:
            return None
        new = self.replanner.maybe_replan(self._moving.profile())
        if new is not None:
            self.plan = new
        return new


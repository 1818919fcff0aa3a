"""Puts the parts together for one pipelined module: layers, pool, plan, engine, patched forward.

Free of Lightning, so the same set-up serves the strategy and plain PyTorch users:

    runtime = RoundPipeRuntime.attach(model.net, backend="cpu", num_workers=2)
    optimizer = runtime.overlap_optimizer(torch.optim.AdamW(model.parameters()))  # optional
    loss = loss_fn(model.net(x), y); loss.backward()   # pipelined forward and backward
    optimizer.step()                                   # layer by layer, behind the next forward
    runtime.join()                                     # before reading the weights directly
    runtime.detach()
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .options import PartitionConfig, TransferConfig
from .engine import EngineOptions, PipelineEngine
from .schedule.plan import PlanError
from .planning.keeper import PlanKeeper
from .adapters.target import STACK_KINDS, locate, patch_forward, unpatch
from .tracing.records import TraceRecorder
from .workers import make_pool

log = logging.getLogger("lightning_roundpipe")


@dataclass
class RuntimeOptions:
    """Everything that decides how a module is pipelined (the strategy's options, minus Lightning)."""

    microbatches: int | None = None  # None: workers + 1
    recompute: str = "always"  # "always" or "never"
    timeout_s: float = 300.0
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    compute_dtype: torch.dtype | None = None
    cpu_compute_delay_s: float = 0.0
    cpu_jitter_s: float = 0.0
    cpu_threads_per_worker: int = 1
    seed: int = 0
    trace_steps: int = 0  # keep the timeline of this many training steps (for export)
    step_metrics: bool = True  # time every step's tasks for bubble / exposed transfer / tokens per second

    def validate(self) -> "RuntimeOptions":
        if self.microbatches is not None and int(self.microbatches) < 1:
            raise ValueError(f"RoundPipeStrategy(microbatches={self.microbatches}): microbatches must be >= 1")
        if self.recompute not in ("always", "never"):
            raise ValueError(f"RoundPipeStrategy(recompute={self.recompute!r}): use 'always' or 'never'")
        if float(self.timeout_s) <= 0:
            raise ValueError(f"RoundPipeStrategy(timeout={self.timeout_s}): the timeout must be > 0 seconds")
        self.partition.validate()
        return self


class RoundPipeRuntime:
    """A module pipelined over a worker pool; ``detach`` restores it."""

    def __init__(self, module: nn.Module, layers: list[nn.Module], forward: Callable[["RoundPipeRuntime"], Callable],
                 backend: str, num_workers: int, options: RuntimeOptions, fused_last: bool = False,
                 device_indices=None, trace: TraceRecorder | None = None):
        self.module = module
        self.layers = layers
        self.options = options.validate()
        self.num_workers = num_workers
        self.trace = trace or TraceRecorder()
        self.trace.enabled = bool(options.step_metrics or options.trace_steps)
        self.kept_steps: list[int] = []
        self.last_metrics: dict = {}
        self.last_tokens: int | None = None
        t = options.transfer
        pool_opts: dict[str, Any] = dict(timeout_s=options.timeout_s, trace=self.trace, fifo_transfers=t.queue == "fifo")
        if backend == "cpu":
            pool_opts.update(
                compute_delay_s=options.cpu_compute_delay_s,
                jitter_s=options.cpu_jitter_s,
                bandwidth_bytes_per_s=t.bandwidth_bytes_per_s,
                latency_s=t.latency_s,
                threads_per_worker=options.cpu_threads_per_worker,
                seed=options.seed,
            )
        if backend == "cuda" and options.recompute == "never":
            raise ValueError("recompute='never' keeps forward graphs across workers and is only supported on the CPU backend")
        microbatches = int(options.microbatches or num_workers + 1)
        self.planner = PlanKeeper(
            layers, num_workers, microbatches, options.partition, recompute=options.recompute == "always",
            fused_last=fused_last, compute_dtype=options.compute_dtype,
            link_bytes_per_second=t.bandwidth_bytes_per_s or (None if backend == "cpu" else 25e9),
            flops_per_second=5e10 if backend == "cpu" else 1e14,
            memory_budget_bytes=options.partition.memory_budget_bytes or _device_budget(backend, device_indices),
        )
        plan = self.planner.plan
        self.pool = make_pool(backend, num_workers, device_indices=device_indices, **pool_opts)
        engine_opts = EngineOptions(
            microbatches=microbatches,
            recompute=options.recompute == "always",
            compute_dtype=options.compute_dtype,
            priorities=dict(t.priorities),
            chunk_bytes=int(t.chunk_bytes),
            prefetch_depth=int(t.prefetch_depth),
        )
        try:
            self.engine = PipelineEngine(layers, self.pool, plan, engine_opts)
        except BaseException:
            self.pool.shutdown()
            raise
        self.engine.step_end_hooks.append(self._after_step)
        self.overlapped: list = []  # OverlappedOptimizer per optimizer handed to overlap_optimizer
        patch_forward(module, forward(self))

    def overlap_optimizer(self, optimizer: torch.optim.Optimizer, *, staleness: int = 0, shadows=None,
                          delay_per_layer_s: float = 0.0):
        """Step ``optimizer`` layer by layer on a host thread, hidden behind the pipeline.

        Patches ``optimizer.step`` and ``optimizer.zero_grad`` in place and returns the
        :class:`~.optim.overlap.OverlappedOptimizer` driving them. ``optimizer.step()`` then
        submits every layer's update (in layer order) and returns at once; the next forward
        uploads a layer only once its update is done, so results equal the synchronous step bit
        for bit (``staleness=0``). ``staleness=1`` is RoundPipe's one-step-delayed update: the
        pipeline reads host shadows refreshed once per step (``shadows``, a
        :class:`~.shadows.ShadowStore`; one is made when not given, also with a
        ``compute_dtype``, whose shadows hold the weights already cast and are refreshed after each
        layer's update; pinned on CUDA). Call :meth:`join` before
        reading weights or optimizer state directly; :meth:`detach` joins and restores the
        optimizer. ``delay_per_layer_s`` slows every layer step (tests and benchmarks).
        """
        from .optim.overlap import OverlappedOptimizer
        from .params.shadows import ShadowStore

        engine = self.engine
        if (staleness or self.options.compute_dtype is not None) and shadows is None:
            shadows = engine.shadows
            if shadows is None:  # uploads read compute-dtype copies, refreshed per layer step
                shadows = ShadowStore(engine.master_parameters(), self.options.compute_dtype,
                                      pin=self.pool.backend == "cuda")
                engine.shadows = shadows
        ov = OverlappedOptimizer(optimizer, engine.tables, self.trace, notifier=self.pool, staleness=staleness,
                                 delay_per_layer_s=delay_per_layer_s,
                                 after_layer_step=shadows.refresh if shadows is not None else None)
        if shadows is not None:
            ov.refresh_shadows = shadows.refresh
        engine.grad_hooks.append(ov.on_layer_grads)
        self.overlapped.append(ov)
        engine._weight_gate_fn = lambda ids: [c for o in self.overlapped for c in o.weight_gates(ids)]
        return ov

    def join(self) -> None:
        """Wait for every submitted layer optimizer step (see :meth:`overlap_optimizer`)."""
        for ov in self.overlapped:
            ov.join()

    def run(self, inputs, loss_scale: float | None = None, tokens: int | None = None):
        """One pipelined call (what the patched forward does); keeps the step's bookkeeping."""
        self.last_tokens = tokens
        out = self.engine(inputs, loss_scale=loss_scale)
        run = self.engine.last_run
        if run is not None and not run.training:
            self.trace.discard_step(run.step)  # evaluation calls are not part of the training timeline
        return out

    def _after_step(self, run) -> None:
        new_plan = self.planner.after_step(run.measurements)
        if new_plan is not None:
            self.engine.set_plan(new_plan)
        if self.trace.enabled:
            from .tracing.timeline import step_metrics

            records = self.trace.records(run.step)
            if records:
                self.last_metrics = step_metrics(records, self.last_tokens)
            if len(self.kept_steps) < self.options.trace_steps:
                self.kept_steps.append(run.step)
            else:
                self.trace.discard_step(run.step)

    def export_timeline(self, directory) -> list[str]:
        """Write the kept steps as a Chrome/Perfetto trace and, with matplotlib, a PNG Gantt chart."""
        import os

        from .tracing.timeline import save_gantt_png, to_chrome_trace

        records = [r for r in self.trace.records() if r.step in self.kept_steps]
        if not records:
            return []
        os.makedirs(directory, exist_ok=True)
        written = [os.path.join(directory, "roundpipe_trace.json")]
        to_chrome_trace(records, written[0])
        try:
            save_gantt_png(records, os.path.join(directory, "roundpipe_timeline.png"), title="RoundPipe timeline")
            written.append(os.path.join(directory, "roundpipe_timeline.png"))
        except ImportError as err:
            log.warning("timeline PNG not written: %s", err)
        return written

    # ------------------------------------------------------------------ constructors
    @classmethod
    def attach(cls, module: nn.Module, backend: str = "cpu", num_workers: int = 2, options: RuntimeOptions | None = None,
               kind: str | None = None, **kwargs) -> "RoundPipeRuntime":
        """Pipeline ``module`` in place: an nn.Sequential, a supported Hugging Face causal LM, a model built from a
        stack of blocks (or the block list itself), or a module declaring its chain (see adapters/target.py)."""
        options = options or RuntimeOptions()
        if kind is None:
            target = locate(module)
            module, kind = target.module, target.kind
        if kind in STACK_KINDS:
            from .adapters.stack_runtime import stack_runtime_parts

            patched, layers, forward = stack_runtime_parts(module, kind)
            return cls(patched, layers, forward, backend, num_workers, options, **kwargs)
        if kind == "sequential":
            if len(module) == 0:
                raise PlanError("the nn.Sequential to pipeline is empty")
            return cls(module, list(module), _sequential_forward, backend, num_workers, options, **kwargs)
        from .adapters.hf_runtime import causal_lm_runtime_parts

        patched, layers, forward = causal_lm_runtime_parts(module)
        return cls(patched, layers, forward, backend, num_workers, options, fused_last=True, **kwargs)

    def describe(self) -> str:
        """The plan's text form, the dispatch of the first step, and the predicted cost table."""
        return f"{self.engine.describe()}\n{self.planner.report().to_table()}"

    def peak_weight_bytes(self) -> list[int]:
        return self.pool.peak_weight_bytes()

    def detach(self) -> None:
        """Join and restore overlapped optimizers, restore the module's forward, stop the workers."""
        try:
            for ov in self.overlapped:
                ov.close()
        finally:
            self.overlapped = []
            unpatch(self.module)
            self.engine.close()


def _device_budget(backend: str, device_indices) -> int | None:
    """Per-worker memory budget for the auto partitioner: 90% of the smallest GPU, none on the CPU backend."""
    if backend != "cuda":
        return None
    indices = list(device_indices) if device_indices is not None else [0]
    return int(0.9 * min(torch.cuda.get_device_properties(i).total_memory for i in indices))


def _sequential_forward(runtime: RoundPipeRuntime) -> Callable:
    def forward(x):
        return runtime.run(x, tokens=int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() else None)

    return forward

"""Puts the parts together for one pipelined module: layers, pool, plan, engine, patched forward.

Free of Lightning, so the same set-up serves the strategy and plain PyTorch users:

    runtime = RoundPipeRuntime.attach(model.net, backend="cpu", num_workers=2)
    loss = loss_fn(model.net(x), y); loss.backward()   # pipelined forward and backward
    runtime.detach()
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .config import PartitionConfig, TransferConfig
from .engine import EngineOptions, PipelineEngine
from .plan import PlanError
from .planning import PlanKeeper
from .target import patch_forward, unpatch
from .trace import TraceRecorder
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
        t = options.transfer
        pool_opts: dict[str, Any] = dict(timeout_s=options.timeout_s, trace=self.trace)
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
            memory_budget_bytes=options.partition.memory_budget_bytes,
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
        patch_forward(module, forward(self))

    def _after_step(self, run) -> None:
        new_plan = self.planner.after_step(run.measurements)
        if new_plan is not None:
            self.engine.set_plan(new_plan)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def attach(cls, module: nn.Module, backend: str = "cpu", num_workers: int = 2, options: RuntimeOptions | None = None,
               kind: str | None = None, **kwargs) -> "RoundPipeRuntime":
        """Pipeline ``module`` (an nn.Sequential or a supported Hugging Face causal LM) in place."""
        options = options or RuntimeOptions()
        kind = kind or ("sequential" if isinstance(module, nn.Sequential) else "causal_lm")
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
        unpatch(self.module)
        self.engine.close()


def _sequential_forward(runtime: RoundPipeRuntime) -> Callable:
    def forward(x):
        return runtime.engine(x)

    return forward

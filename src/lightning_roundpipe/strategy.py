"""RoundPipeStrategy: the Lightning glue. The machinery lives in ``runtime`` and ``engine``.

The LightningModule stays on the host; the strategy finds the module to pipeline, replaces its
forward with the pipelined one, and leaves Lightning's loops, precision plugin, optimizer step,
gradient clipping, accumulation and logging as they are: they act on host parameters whose
``.grad`` the pipeline filled.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from .config import partition_config, transfer_config
from .runtime import RoundPipeRuntime, RuntimeOptions
from .target import find_target


class RoundPipeStrategy(ParallelStrategy):
    """Train with RoundPipe: host-resident weights, stateless workers, round-robin stage dispatch.

    ``Trainer(strategy="roundpipe", accelerator="cpu", devices=N)`` gives N virtual CPU workers;
    ``accelerator="gpu", devices=N`` gives N CUDA workers, all driven by one process.

    Args:
        microbatches: microbatches per batch (None: number of workers + 1).
        partition: "params" | "uniform" | "auto" | "manual", or a dict of
            :class:`~lightning_roundpipe.config.PartitionConfig` fields (Hydra group ``partition``).
        transfer: dict of :class:`~lightning_roundpipe.config.TransferConfig` fields (priorities,
            chunk size, prefetch depth, CPU link model; Hydra group ``transfer``).
        recompute: "always" (keep stage inputs, recompute in backward) or "never" (keep forward
            graphs; CPU backend only).
        module: dotted attribute path of the module to pipeline (None: found automatically).
        timeout: seconds any wait may take before it fails with an error naming what it waited for.
        workers: expected number of workers; must equal ``devices`` when given.
        cpu_compute_delay_s, cpu_jitter_s: CPU backend only: injected delay / random jitter per task.
        cpu_threads_per_worker: CPU backend only: torch threads per worker's compute queue.
        seed: seed of the CPU backend's jitter.
        trace_steps: keep the timeline of the first N training steps and write it at the end of the
            run to ``trace_dir`` as ``roundpipe_trace.json`` (Chrome/Perfetto) and ``roundpipe_timeline.png``.
        trace_dir: where the timeline goes (None: the trainer's ``default_root_dir``).
        step_metrics: log ``roundpipe/bubble_fraction``, ``roundpipe/exposed_transfer_s``,
            ``roundpipe/step_s`` and ``roundpipe/tokens_per_s`` to the trainer's loggers every step.
    """

    strategy_name = "roundpipe"

    def __init__(
        self,
        microbatches: int | None = None,
        partition: Any = None,
        transfer: Any = None,
        recompute: str = "always",
        module: str | None = None,
        timeout: float = 300.0,
        workers: int | None = None,
        cpu_compute_delay_s: float = 0.0,
        cpu_jitter_s: float = 0.0,
        cpu_threads_per_worker: int = 1,
        seed: int = 0,
        trace_steps: int = 0,
        trace_dir: str | None = None,
        step_metrics: bool = True,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
    ):
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.options = RuntimeOptions(
            microbatches=microbatches,
            recompute=recompute,
            timeout_s=timeout,
            partition=partition_config(partition),
            transfer=transfer_config(transfer),
            cpu_compute_delay_s=cpu_compute_delay_s,
            cpu_jitter_s=cpu_jitter_s,
            cpu_threads_per_worker=cpu_threads_per_worker,
            seed=seed,
            trace_steps=int(trace_steps),
            step_metrics=bool(step_metrics),
        ).validate()
        self.trace_dir = trace_dir
        self.module_path = module
        self.expected_workers = workers
        self.runtime: RoundPipeRuntime | None = None
        self.num_nodes = 1

    # ------------------------------------------------------------------ devices
    @property
    @override
    def root_device(self) -> torch.device:
        return torch.device("cpu")  # the host is the home of all model state

    def _backend(self) -> tuple[str, list[int] | None]:
        devices = self.parallel_devices or [torch.device("cpu")]
        types = {d.type for d in devices}
        if types == {"cpu"}:
            return "cpu", None
        if types == {"cuda"}:
            return "cuda", [d.index or 0 for d in devices]
        raise ValueError(
            f"RoundPipeStrategy runs on accelerator='cpu' (virtual workers) or accelerator='gpu' (CUDA workers); "
            f"got devices of type {sorted(types)}"
        )

    @property
    def num_workers(self) -> int:
        return len(self.parallel_devices or [None])

    @override
    def setup_environment(self) -> None:
        backend, indices = self._backend()
        if self.expected_workers is not None and int(self.expected_workers) != self.num_workers:
            raise ValueError(
                f"RoundPipeStrategy(workers={self.expected_workers}) does not match Trainer(devices={self.num_workers}): "
                "set them to the same number (or leave workers unset)"
            )
        if backend == "cuda":
            self.accelerator.setup_device(torch.device("cuda", indices[0]))

    # ------------------------------------------------------------------ model
    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)  # precision conversion, model to host, optimizers
        backend, indices = self._backend()
        target = find_target(self.lightning_module, self.module_path)
        self.runtime = RoundPipeRuntime.attach(
            target.module, backend=backend, num_workers=self.num_workers, options=self.options, kind=target.kind,
            device_indices=indices,
        )
        rank_zero_info(f"RoundPipe pipelines `{target.path}` ({type(target.module).__name__})\n{self.runtime.describe()}")

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._log_step_metrics()
        return out

    def _log_step_metrics(self) -> None:
        if self.runtime is None or not self.runtime.last_metrics or self.lightning_module is None:
            return
        trainer = self.lightning_module.trainer
        m = self.runtime.last_metrics
        metrics = {f"roundpipe/{k}": float(m[k]) for k in ("bubble_fraction", "exposed_transfer_s", "step_s", "tokens_per_s")
                   if m.get(k) is not None}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def teardown(self) -> None:
        if self.runtime is not None:
            if self.options.trace_steps:
                directory = self.trace_dir or (self.lightning_module.trainer.default_root_dir if self.lightning_module else ".")
                written = self.runtime.export_timeline(directory)
                if written:
                    rank_zero_info(f"RoundPipe timeline written: {', '.join(written)}")
            self.runtime.detach()
            self.runtime = None
        super().teardown()

    # ------------------------------------------------------------------ collectives (one process per node)
    @property
    @override
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @override
    def reduce(self, tensor, group=None, reduce_op: ReduceOp | str | None = "mean"):
        return tensor

    @override
    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        pass

    @override
    def broadcast(self, obj, src: int = 0):
        return obj

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": 1, "rank": 0}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="RoundPipe pipeline over stateless workers")


def register() -> None:
    if RoundPipeStrategy.strategy_name not in StrategyRegistry:
        RoundPipeStrategy.register_strategies(StrategyRegistry)

"""RoundPipeStrategy: the Lightning glue. The machinery lives in ``runtime`` and ``engine``.

The LightningModule stays on the host; the strategy finds the module to pipeline, replaces its
forward with the pipelined one, and leaves Lightning's loops, precision plugin, optimizer step,
gradient clipping, accumulation and logging as they are: they act on host parameters whose
``.grad`` the pipeline filled.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning.pytorch.trainer.states import TrainerFn

from .checkpoint_io import AtomicCheckpointIO
from ..options import partition_config, transfer_config
from ..distributed.gradient_sync import GradientSync, broadcast_module
from ..optim import OverlappedOptimizer
from .precision import compute_dtype_of, translate
from ..params.shadows import ShadowStore, check_pinned_policy, register_pinned, unregister_pinned
from ..runtime import RoundPipeRuntime, RuntimeOptions
from ..adapters.target import find_target


class RoundPipeStrategy(ParallelStrategy):
    """Train with RoundPipe: host-resident weights, stateless workers, round-robin stage dispatch.

    ``Trainer(strategy="roundpipe", accelerator="cpu", devices=N)`` gives N virtual CPU workers;
    ``accelerator="gpu", devices=N`` gives N CUDA workers, all driven by one process.

    Args:
        microbatches: microbatches per batch (None: number of workers + 1).
        partition: "params" | "uniform" | "auto" | "manual", or a dict of
            :class:`~lightning_roundpipe.options.PartitionConfig` fields (Hydra group ``partition``).
        transfer: dict of :class:`~lightning_roundpipe.options.TransferConfig` fields (priorities,
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
        overlap_optimizer: step the user's optimizer layer by layer on a host thread, hidden behind
            backward and the next forward (exact). False: the plain synchronous ``optimizer.step()``.
        staleness: 0 (exact) or 1: RoundPipe's one-step-delayed update (the gradient of step t is
            taken at the weights from before update t-1): more overlap, NOT exact.
        pinned: pinned host memory policy for the CUDA backend: "alloc", "register" or "off"
            (see ``shadows.py`` for the trade-off); no effect on the CPU backend.
        optimizer_delay_s: testing knob: sleep this long before each layer's optimizer step.
        allow_unverified: pipeline a Hugging Face family that is not verified (docs/models.md) after
            checking the pipelined against the unpipelined forward on the first microbatch.
        logits_with_loss: a Hugging Face causal LM called with ``labels`` also returns ``.logits``
            (costs the full logits; without it, reading them raises an error saying so).
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
        overlap_optimizer: bool = True,
        staleness: int = 0,
        pinned: str = "alloc",
        optimizer_delay_s: float = 0.0,
        allow_unverified: bool = False,
        logits_with_loss: bool = False,
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
            checkpoint_io=checkpoint_io or AtomicCheckpointIO(),
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
            allow_unverified=bool(allow_unverified),
            logits_with_loss=bool(logits_with_loss),
        ).validate()
        self.trace_dir = trace_dir
        if int(staleness) not in (0, 1):
            raise ValueError(f"RoundPipeStrategy(staleness={staleness}): use 0 (exact) or 1 (one-step-delayed update)")
        if int(staleness) and not overlap_optimizer:
            raise ValueError("RoundPipeStrategy(staleness=1) is a mode of the overlapped optimizer: keep overlap_optimizer=True")
        self.overlap_optimizer = bool(overlap_optimizer)
        self.staleness = int(staleness)
        self.pinned = check_pinned_policy(pinned)
        self.optimizer_delay_s = float(optimizer_delay_s)
        self.overlaps: list[OverlappedOptimizer] = []
        self.shadows: ShadowStore | None = None
        self._registered: list = []
        self._patched_reads: list[str] = []
        self.module_path = module
        self.expected_workers = workers
        self.runtime: RoundPipeRuntime | None = None
        self.num_nodes = 1
        self.grad_sync: GradientSync | None = None
        self._params_outside_pipeline: list = []  # trainable, all-reduced whole at the end of backward
        self.last_bytes_reduced = 0

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

    # ------------------------------------------------------------------ nodes (one process per node)
    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank)
            self.cluster_environment.set_world_size(self.num_nodes)
        rank_zero_only.rank = self.global_rank

    @override
    def _configure_launcher(self) -> None:
        env = self.cluster_environment
        if self.num_nodes > 1 and env is not None and not env.creates_processes_externally:
            # Lightning's own launcher, with one process per node: it sets the environment and starts no child.
            self._launcher = _SubprocessScriptLauncher(env, num_processes=1, num_nodes=self.num_nodes)

    @override
    def setup_environment(self) -> None:
        if self.world_size > 1:
            try:
                _init_dist_connection(self.cluster_environment, "gloo", timeout=timedelta(seconds=self.options.timeout_s))
            except Exception as err:
                raise RuntimeError(
                    f"rank {self.global_rank} of {self.world_size} could not join the other nodes at "
                    f"{self.cluster_environment.main_address}:{self.cluster_environment.main_port} within "
                    f"{self.options.timeout_s:g}s: {err}"
                ) from err
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
        backend, indices = self._backend()
        self.precision_plugin = translate(self.precision_plugin, backend)
        super().setup(trainer)  # precision conversion, model to host, optimizers
        target = find_target(self.lightning_module, self.module_path)
        self.options.compute_dtype = compute_dtype_of(self.precision_plugin)
        self.runtime = RoundPipeRuntime.attach(
            target.module, backend=backend, num_workers=self.num_workers, options=self.options, kind=target.kind,
            device_indices=indices,
        )
        if self.world_size > 1:
            broadcast_module(self.lightning_module)  # every node starts from rank 0's weights
            self.grad_sync = GradientSync(self.runtime.engine.tables, self.runtime.trace, self.options.timeout_s)
            self.runtime.engine.grad_hooks.append(self.grad_sync.on_layer_grads)
            inside = {id(t) for table in self.runtime.engine.tables for t in table.tensors}
            self._params_outside_pipeline = [p for p in self.lightning_module.parameters()
                                             if p.requires_grad and id(p) not in inside]
        self._setup_host_state(trainer, backend)
        rank_zero_info(f"RoundPipe pipelines `{target.path}` ({type(target.module).__name__})\n{self.runtime.describe()}")

    def _setup_host_state(self, trainer, backend: str) -> None:
        """Shadows, pinned memory and the overlapped optimizer, once the optimizers exist."""
        engine = self.runtime.engine
        masters = engine.master_parameters()
        pin = backend == "cuda" and self.pinned == "alloc"
        if self.options.compute_dtype is not None or self.staleness:
            self.shadows = ShadowStore(masters, self.options.compute_dtype, pin=pin)
            engine.shadows = self.shadows
        if backend == "cuda" and self.pinned == "register":
            self._registered = register_pinned(masters)
        self.runtime.pool.pin_memory = backend == "cuda" and self.pinned != "off"
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not (fitting and self.overlap_optimizer and self.optimizers):
            return
        early = self._early_steps_allowed(trainer)
        for opt in self.optimizers:
            ov = self.runtime.overlap_optimizer(opt, staleness=self.staleness, shadows=self.shadows,
                                                delay_per_layer_s=self.optimizer_delay_s)
            ov.early_steps = early
            if self.grad_sync is not None:
                ov.before_layer_step = self.grad_sync.finalize_params
            self.overlaps.append(ov)
        self._patch_reads()

    def _early_steps_allowed(self, trainer) -> bool:
        """Layers may step during backward only if nothing after backward can change gradients."""
        import lightning.pytorch as pl

        module = self.lightning_module
        if trainer.gradient_clip_val or getattr(self.precision_plugin, "scaler", None) is not None:
            return False
        if not module.automatic_optimization:
            return False
        for hook in ("on_before_optimizer_step", "configure_gradient_clipping"):
            if getattr(type(module), hook) is not getattr(pl.LightningModule, hook):
                return False
        return all(type(cb).on_before_optimizer_step is pl.Callback.on_before_optimizer_step for cb in trainer.callbacks)

    def _patch_reads(self) -> None:
        """Reading the module's weights through the usual methods waits for in-flight layer steps."""
        module = self.lightning_module
        for name in ("parameters", "named_parameters", "state_dict"):
            original = getattr(module, name)

            def joined(*args, _original=original, **kwargs):
                self.join()
                return _original(*args, **kwargs)

            object.__setattr__(module, name, joined)
            self._patched_reads.append(name)

    def join(self) -> None:
        """Wait for every submitted layer optimizer step (call before reading weights directly)."""
        for ov in self.overlaps:
            ov.join()

    # Every place Lightning reads weights or optimizer state joins first.
    @override
    def on_validation_start(self) -> None:
        self.join()

    @override
    def on_test_start(self) -> None:
        self.join()

    @override
    def on_predict_start(self) -> None:
        self.join()

    @override
    def on_train_end(self) -> None:
        self.join()

    @override
    def lightning_module_state_dict(self) -> dict:
        self.join()
        state = self.lightning_module.state_dict()
        frozen = [n for n, p in self.lightning_module.named_parameters() if not p.requires_grad]
        if frozen and any(p.requires_grad for p in self.lightning_module.parameters()):
            # LoRA and other adapters: keep what is trained (and buffers); the frozen base is rebuilt
            # from the model path the module was created with (its hyper-parameters).
            frozen_set = set(frozen)
            state = {k: v for k, v in state.items() if k not in frozen_set}
        return state

    @override
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        state = checkpoint["state_dict"]
        module = self.lightning_module
        missing = set(module.state_dict().keys()) - set(state)
        frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
        if strict and missing - frozen:
            raise KeyError(f"checkpoint lacks trainable weights {sorted(missing - frozen)[:5]}")
        module.load_state_dict(state, strict=False)
        if self.shadows is not None:
            self.shadows.refresh()

    @override
    def optimizer_state(self, optimizer) -> dict:
        self.join()
        return super().optimizer_state(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        self.join()
        super().load_optimizer_state_dict(checkpoint)

    @override
    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        self.join()
        if self.is_global_zero:  # every node holds the same weights
            super().save_checkpoint(checkpoint, filepath, storage_options)

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
        module = self.lightning_module
        for name in self._patched_reads:
            vars(module).pop(name, None)
        self._patched_reads = []
        for ov in self.overlaps:
            ov.close()
        self.overlaps = []
        if self._registered:
            unregister_pinned(self._registered)
            self._registered = []
        self.shadows = None
        if self.grad_sync is not None:
            self.grad_sync.close()
            self.grad_sync = None
        if self.runtime is not None:
            if self.options.trace_steps:
                directory = self.trace_dir or (self.lightning_module.trainer.default_root_dir if self.lightning_module else ".")
                written = self.runtime.export_timeline(directory)
                if written:
                    rank_zero_info(f"RoundPipe timeline written: {', '.join(written)}")
            self.runtime.detach()
            self.runtime = None
        super().teardown()

    # ------------------------------------------------------------------ gradients across nodes
    @contextmanager
    def block_backward_sync(self):
        """Lightning enters this on accumulation-only steps: nothing is communicated then."""
        if self.grad_sync is None:
            yield
            return
        self.grad_sync.blocked = True
        try:
            yield
        finally:
            self.grad_sync.blocked = False

    @override
    def pre_backward(self, closure_loss) -> None:
        if self.grad_sync is not None:
            if self.grad_sync.blocked:
                self.last_bytes_reduced = 0  # accumulation only: nothing is sent
            else:
                self.grad_sync.new_step()

    @override
    def post_backward(self, closure_loss) -> None:
        if self.grad_sync is not None and not self.grad_sync.blocked:
            self.grad_sync.finish_backward(self._params_outside_pipeline)
            self.last_bytes_reduced = self.grad_sync.bytes_reduced

    # ------------------------------------------------------------------ collectives (one process per node)
    @property
    @override
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def _dist(self) -> bool:
        return self.world_size > 1 and torch.distributed.is_initialized()

    @override
    def reduce(self, tensor, group=None, reduce_op: ReduceOp | str | None = "mean"):
        if isinstance(tensor, torch.Tensor) and self._dist():
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        if self._dist():
            return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        if self._dist():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj, src: int = 0):
        if not self._dist():
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src)
        return holder[0]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="RoundPipe pipeline over stateless workers")


def register() -> None:
    if RoundPipeStrategy.strategy_name not in StrategyRegistry:
        RoundPipeStrategy.register_strategies(StrategyRegistry)

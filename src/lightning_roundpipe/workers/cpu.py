"""CPU backend: N virtual workers in one process that keep the asynchrony of the CUDA backend.

Every lane is a real thread, so uploads, compute and downloads overlap the way CUDA streams do
and the engine's event waits are exercised for real: this is how everything is tested without a
GPU. Knobs make the machine slower or noisier for tests and measurements (``compute_delay_s``,
``jitter_s``, ``bandwidth_bytes_per_s``, ``latency_s``), set threads per worker, measure each
worker's "device" bytes (``measure_memory``) or cap them (``memory_cap_bytes``). What is copied
and what is shared, as a GPU's copy engine would: docs/design.md, design notes, ``workers/cpu.py``.
"""

from __future__ import annotations

import random
import threading
import time

import torch

from ..schedule.graph_task import TaskKind
from .device_memory import AllocationTally
from ..host.host_allocator import keep_freed_memory
from .completions import Lane, WorkOrder
from .pool import WorkerPool, Worker

TALLIED_UPLOADS = (TaskKind.ACT_IN, TaskKind.GRAD_IN)  # weights are counted by the engine's uploads and releases

# What one more microbatch of a stage costs on the CPU backend besides its compute (the host
# submitting its tasks, lane and worker hand-overs): ``python -m benchmarks.peers.out_of_box --overhead``
# (8 one-layer stages of Linear(8, 8), no recompute, 2 workers: the step at 8 microbatches minus
# the step at 2, per extra microbatch-stage) measured 0.33 ms on the 2-core development machine
# at a load average of 4 from other jobs (0.96 ms at 7: it grows with the machine's load).
CPU_MICROBATCH_OVERHEAD_S = 0.33e-3


class CpuWorkerPool(WorkerPool):
    """The CPU backend: N virtual workers in this process (see the module doc)."""
    backend = "cpu"
    keeps_graphs_across_workers = True  # one process, one memory
    pins_uploads = False  # host memory is the device memory
    planner_device = "cpu"
    assumed_link_bytes_per_s = None  # a copy costs only the memory copy unless a bandwidth is injected
    assumed_flops_per_s = 5e10  # a few CPU cores
    microbatch_overhead_s = CPU_MICROBATCH_OVERHEAD_S

    @classmethod
    def options_from(cls, options) -> dict:
        """The CPU backend's knobs among the user's options: injected delay, jitter and link model,
        threads per worker, the virtual GPU's memory cap, the jitter's seed."""
        t = options.transfer
        return dict(compute_delay_s=options.testing.compute_delay_s, jitter_s=options.testing.jitter_s,
                    bandwidth_bytes_per_s=t.bandwidth_bytes_per_s, latency_s=t.latency_s,
                    threads_per_worker=options.cpu_threads_per_worker, seed=options.seed,
                    memory_cap_bytes=options.cpu_memory_cap_bytes, reuse_freed_memory=options.cpu_reuse_freed_memory)

    def __init__(
        self,
        num_workers: int,
        timeout_s: float = 300.0,
        trace=None,
        compute_delay_s: float = 0.0,
        jitter_s: float = 0.0,
        bandwidth_bytes_per_s: float | None = None,
        latency_s: float = 0.0,
        threads_per_worker: int = 1,
        seed: int = 0,
        fifo_transfers: bool = False,
        measure_memory: bool = False,
        memory_cap_bytes: int | None = None,
        reuse_freed_memory: bool = False,
    ):
        super().__init__([torch.device("cpu")] * num_workers, timeout_s=timeout_s, trace=trace,
                         fifo_transfers=fifo_transfers)
        self.compute_delay_s = float(compute_delay_s)
        self.jitter_s = float(jitter_s)
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.latency_s = float(latency_s)
        self.threads_per_worker = int(threads_per_worker)
        self._rand = random.Random(seed)
        self._rand_lock = threading.Lock()
        # The step's large host tensors reused instead of page-faulting afresh (host/host_allocator.py).
        self.reuses_freed_memory = keep_freed_memory() if reuse_freed_memory else False
        self.measure_memory = False
        self._tallies: dict[int, AllocationTally] = {}  # id(lane) -> the tally its tasks run under
        if measure_memory or memory_cap_bytes is not None:
            self.start_measuring_memory(memory_cap_bytes)

    def start_measuring_memory(self, cap_bytes: int | None = None) -> None:
        """Measure each worker's device memory from the next task on (``peak_device_bytes()``), with
        an optional per-worker cap. Call between steps (a task already running is not tallied)."""
        for w in self.workers:
            w.memory.cap_bytes = cap_bytes
            for lane in (w.lanes["compute"], w.lanes["upload"]):
                self._tallies.setdefault(id(lane), AllocationTally(w.memory))
        self.measure_memory = True

    def lane_threads(self, lane: Lane) -> int:
        """``threads_per_worker`` for a compute lane, 1 for a transfer lane (a copy is bound by memory
        bandwidth; its threads would take cores from the computes). The rule for choosing
        ``threads_per_worker``: workers x threads_per_worker at most the host's cores (the default
        1 fits as many workers as cores); more oversubscribes the cores the workers share."""
        return max(1, self.threads_per_worker) if lane.queue == "compute" else 1

    def _jitter(self) -> float:
        if self.jitter_s <= 0:
            return 0.0
        with self._rand_lock:
            return self._rand.uniform(0.0, self.jitter_s)

    def _run(self, lane: Lane, task: WorkOrder):
        tally = self._tallies.get(id(lane))
        if tally is None or (lane.queue == "upload" and task.done.label.kind not in TALLIED_UPLOADS):
            return task.fn()
        tally.label = task.done.label
        with tally:
            return task.fn()

    def execute(self, lane: Lane, task: WorkOrder) -> None:
        start = self.trace.now()
        if task.done.label.kind == TaskKind.RELEASE:
            value = task.fn()
        elif lane.queue == "compute":
            pause = self._jitter() + self.compute_delay_s
            if pause > 0:
                time.sleep(pause)
            value = self._run(lane, task)
        else:
            # A transfer: copy, then pay what the modelled link would charge for these bytes.
            value = self._run(lane, task)
            if not task.nbytes:
                task.nbytes = _bytes_of(value)
            pause = self._jitter() + self.latency_s
            if self.bandwidth_bytes_per_s:
                pause += task.nbytes / float(self.bandwidth_bytes_per_s)
            if pause > 0:
                time.sleep(pause)
        self.record(lane, task, start, self.trace.now())
        task.done.set(value)

    def copy_to_device(self, worker: Worker, tensors, dtypes, read_only=False):
        flags = list(read_only) if isinstance(read_only, (list, tuple)) else [read_only] * len(tensors)
        out = []
        for t, dt, shared in zip(tensors, dtypes, flags):
            if t is None:
                out.append(None)
            elif shared and (dt is None or dt == t.dtype):
                out.append(t.detach())  # shares the host memory (see the module doc)
            else:
                out.append(t.detach().to(dtype=dt or t.dtype, copy=True))
        return out

    def copy_to_host(self, worker: Worker, tensors, reusable: bool = False):
        if self.measure_memory:  # distinct host storage, so the device one is seen to die (module doc)
            return [None if t is None else t.detach().clone() for t in tensors]
        # The device side is done with these tensors: the host takes them as they are.
        return [None if t is None else t.detach() for t in tensors]


def _bytes_of(value) -> int:
    from torch.utils import _pytree as pytree

    leaves = pytree.tree_leaves(value.leaves if hasattr(value, "leaves") else value)
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))

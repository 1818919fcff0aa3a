"""Emulated GPUs: the fake-stream backend whose device work takes the time a hardware profile gives it.

The ``fake_cuda`` backend runs the CUDA protocol on CPU executor threads standing for streams.
This backend is that protocol unchanged (dispatch, lanes, events, completions, the overlapped
optimizer, undo, gradient accumulation and the loss are all the real host code), with one
addition: each piece of stream work lasts at least the device time of its task. The work itself
runs first on the stream's thread (the real tensor work on a model scaled down in width, which
stands for the host's cost of launching the task's kernels), then the thread sleeps for what is
left of the task's device time. ``time.sleep`` releases the GIL, so a busy emulated device costs
the host nothing, as a busy GPU does; a task whose launches take longer than its device time is
launch-bound here as it would be on the GPU.

The device time of a task comes from a ``device_time(label, nbytes) -> seconds`` callable handed
to ``EmulatedWorkerPool.emulate``. ``cost.task_seconds.ProfileDeviceTimes`` is the one the
benchmarks use: the calibrated cost model of a real model shape (``cost/transformer.py``) on a hardware profile
(``cost/profiles/*.yaml``), exactly as the simulator prices the same task (``sim/simulate.py``):
compute seconds from the cost view, transfers as latency plus bytes over the host link, the bytes
being those of the *real* shape (the scaled tensors' bytes only say which share of a stage's
weights a chunk carries). Without ``emulate`` every task takes its real time (``fake_cuda``).

``time_scale`` multiplies every device time: the published workloads take 20-370 s per optimizer
step on the profiles' GPUs, so benchmarks on a small host run them faster than life. Host work is
not scaled, so a scale below 1 makes the host's share look ``1 / time_scale`` times larger than
it would be (``docs/emulated_gpus.md``).

On a profile whose link is not ``duplex`` a worker's uploads and downloads take turns on one
link (a lock per worker held while a transfer's time passes).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .completions import PipelineTimeout, TaskLabel
from .cuda import FakeCudaWorkerPool
from .host_buffers import DEFAULT_CAP_BYTES
from .pool import Lane, Task

DeviceTime = Callable[[TaskLabel, int], float]
TRANSFER_KINDS = frozenset({"weights", "act_in", "grad_in", "act_out", "act_save", "grad_out", "loss", "wgrad"})


class EmulatedWorkerPool(FakeCudaWorkerPool):
    """The fake-stream pool with device time (see the module doc): ``time_scale`` multiplies every
    device time; ``duplex=False`` makes a worker's uploads and downloads share one link. The device
    times come from ``emulate`` (until then tasks take their real time). ``device_seconds`` sums,
    per worker, the device time charged so far (what the tests check against hand-computed steps)."""

    backend = "emulated"

    def __init__(self, num_workers: int, timeout_s: float = 300.0, trace=None, max_in_flight: int = 2,
                 pin_memory: bool = True, fifo_transfers: bool = False, stream_jitter_s: float = 0.0, seed: int = 0,
                 host_buffer_cap_bytes: int = DEFAULT_CAP_BYTES, cudart=None, copy_delay_s: float = 0.0,
                 time_scale: float = 1.0, duplex: bool = True):
        if not time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        super().__init__(num_workers, timeout_s=timeout_s, trace=trace, max_in_flight=max_in_flight,
                         pin_memory=pin_memory, fifo_transfers=fifo_transfers, stream_jitter_s=stream_jitter_s,
                         seed=seed, host_buffer_cap_bytes=host_buffer_cap_bytes, cudart=cudart,
                         copy_delay_s=copy_delay_s)
        self.time_scale = float(time_scale)
        self.duplex = duplex
        self.device_time: DeviceTime | None = None
        self.device_seconds = [0.0] * num_workers
        self.late_seconds = [0.0] * num_workers  # real work that ran past its device time (launch-bound)
        self._links = [threading.Lock() for _ in range(num_workers)]
        self._charge_lock = threading.Lock()

    def emulate(self, device_time: DeviceTime | None, time_scale: float | None = None,
                duplex: bool | None = None) -> "EmulatedWorkerPool":
        """Give every later task the device time ``device_time(label, nbytes)`` (times ``time_scale``);
        None: real time again. Returns the pool."""
        if time_scale is not None:
            if not time_scale > 0:
                raise ValueError(f"time_scale must be positive, got {time_scale}")
            self.time_scale = float(time_scale)
        if duplex is not None:
            self.duplex = duplex
        self.device_time = device_time
        return self

    def execute(self, lane: Lane, task: Task) -> None:
        """Issue ``task`` as the fake-stream pool does, its work made to last its device time."""
        label = task.done.label
        if self.device_time is not None and label.kind != "release":
            seconds = self.device_time(label, task.nbytes) * self.time_scale
            task.fn = self._timed(task.fn, seconds, lane.worker.index, label.kind in TRANSFER_KINDS)
        super().execute(lane, task)

    def _timed(self, fn, seconds: float, worker: int, transfer: bool):
        """``fn`` lasting at least ``seconds`` on the stream thread that runs it (sleeping, GIL released)."""
        link = self._links[worker] if transfer and not self.duplex else None

        def run():
            if link is not None and not link.acquire(timeout=self.timeout_s):
                raise PipelineTimeout(f"a transfer of worker {worker} waited {self.timeout_s:g}s for its link")
            try:
                t0 = time.perf_counter()
                out = fn()
                left = seconds - (time.perf_counter() - t0)
                if left > 0:
                    time.sleep(left)
                with self._charge_lock:
                    self.device_seconds[worker] += seconds
                    self.late_seconds[worker] += max(0.0, -left)
                return out
            finally:
                if link is not None:
                    link.release()

        return run

"""CUDA backend: one worker per GPU, each with an upload, a compute and a download stream.

A lane thread issues its task on its stream after making the stream wait for the CUDA events
of the task's dependencies, then records an event; the completion is set when the work is
*issued*, so the host never blocks on the GPU except where it reads data. Host buffers for
downloads are pinned so copies are asynchronous. Tensors handed from one stream to another are
marked with ``record_stream`` so the caching allocator does not reuse them too early.

Transfer lanes keep at most ``max_in_flight`` copies issued and unfinished: a later
high-priority copy then waits behind at most that many chunks, which is what makes priorities
work on a FIFO stream.
"""

from __future__ import annotations

import collections

import torch

from .pool import Lane, WorkerPool, Worker, _Task


class CudaWorkerPool(WorkerPool):
    backend = "cuda"

    def __init__(self, device_indices, timeout_s: float = 300.0, trace=None, max_in_flight: int = 2, pin_memory: bool = True,
                 fifo_transfers: bool = False):
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA backend needs CUDA: use accelerator='cpu' for virtual CPU workers")
        super().__init__([torch.device("cuda", int(i)) for i in device_indices], timeout_s=timeout_s, trace=trace,
                         fifo_transfers=fifo_transfers)
        self.max_in_flight = max(1, int(max_in_flight))
        self.pin_memory = pin_memory
        self._in_flight: dict[int, collections.deque] = {}
        for w in self.workers:
            for lane in w.lanes.values():
                with torch.cuda.device(w.device):
                    lane.stream = torch.cuda.Stream(device=w.device)
                self._in_flight[id(lane)] = collections.deque()

    def _on_lane_start(self, lane: Lane) -> None:
        torch.cuda.set_device(lane.worker.device)

    def _execute(self, lane: Lane, task: _Task) -> None:
        stream = lane.stream
        in_flight = self._in_flight[id(lane)]
        if lane.queue != "compute":
            while len(in_flight) >= self.max_in_flight:
                in_flight.popleft().synchronize()
        for dep in task.deps:
            if dep.cuda_event is not None:
                stream.wait_event(dep.cuda_event)
        record = self.trace.recording and task.done.label.kind != "release"
        if record:
            t0 = torch.cuda.Event(enable_timing=True)
            t0.record(stream)
        with torch.cuda.device(lane.worker.device), torch.cuda.stream(stream):
            value = task.fn()
        event = torch.cuda.Event(enable_timing=record)
        event.record(stream)
        task.done.cuda_event = event
        if lane.queue != "compute":
            in_flight.append(event)
        if record:
            # Timed on the GPU: resolve once finished (cheap for a profiling run).
            event.synchronize()
            start = self.trace.now() - t0.elapsed_time(event) / 1e3
            self._record(lane, task, start, self.trace.now())
        task.done.set(value)

    def _copy_to_device(self, worker: Worker, tensors, dtypes, read_only=False):
        compute_stream = worker.lanes["compute"].stream
        out = []
        for t, dt in zip(tensors, dtypes):
            if t is None:
                out.append(None)
                continue
            src = t.detach()
            if self.pin_memory and not src.is_pinned():
                src = src.pin_memory()
            dev = src.to(worker.device, dtype=dt or src.dtype, non_blocking=True)
            dev.record_stream(compute_stream)
            out.append(dev)
        return out

    def _copy_to_host(self, worker: Worker, tensors):
        stream = torch.cuda.current_stream(worker.device)
        out = []
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            t = t.detach()
            t.record_stream(stream)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin_memory)
            host.copy_(t, non_blocking=True)
            out.append(host)
        return out

    def synchronize(self) -> None:
        for w in self.workers:
            torch.cuda.synchronize(w.device)

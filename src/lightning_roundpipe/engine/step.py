"""One pipelined call over a pool: the lowered task graph submitted, its phases and the host's share.

The rules (which tasks, on which worker and lane, waiting for what, at which priority) are
in ``lightning_roundpipe.schedule.lowering.lower``; what each task kind does with tensors
is in ``task_work``; which device values are still to be read, in ``device_values``.
A call reads only its ``StepContext`` (never the engine), and the host
adds stage gradients in dispatch order.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..params.weights import StageWeights, accumulate_host_grads
from ..schedule.lowering import GraphTask, TaskGraph, TaskKind
from ..schedule.plan import Stage
from ..host.compile_clock import COMPILE_CLOCK
from ..workers.completions import Completion, TaskLabel
from .carry import HostCarry
from .device_values import NOT_READING, DeviceReaders
from .measurements import call_measurements
from .microbatch import batch_size_of
from .output_merge import OutputAssembly
from .rng import CallRng
from .step_context import StepContext, TableSizes
from .task_work import HANDLERS, TaskWork

__all__ = ["HostCarry", "StepRun", "TableSizes"]


class StepRun:
    """One forward (+ backward) call: submits the lowered task graph, holds host activations and gradients."""

    def __init__(self, ctx: StepContext, microbatches: list[Any], *, step: int, autocast: dict, training: bool,
                 loss_scale: float | None, input_requires_grad: bool):
        self.ctx = ctx
        self.pool = ctx.pool
        self.plan = ctx.plan
        self.M = len(microbatches)
        self.training = training
        self.fused = training and loss_scale is not None and self.plan.fused_last
        self.loss_scale = loss_scale
        self.input_requires_grad = input_requires_grad
        # A seed per (layer, microbatch): recompute draws what forward drew.
        self.rng = CallRng(timeout_s=self.pool.timeout_s, owner=self.pool, task_of=self.pool.task_text)
        self.step = step
        self.compile_mark = COMPILE_CLOCK.seconds()  # a call that compiles measures its compiles
        self.backwards = 0  # backward phases submitted (a second one recomputes: the first freed kept graphs)
        self.graph: TaskGraph = ctx.lower(self.M, training=training, fused=self.fused,
                                          input_gradient=input_requires_grad)
        self.done: dict[int, Completion] = {}  # graph task id -> its completion
        self.readers = DeviceReaders(self.graph, self.done)
        # Downloads in reused host buffers that this call may read again (activations, for the
        # recompute of every backward, a second one included; a fused call's weight gradients):
        # they go back to the pool when the call is gone.
        self.lent_buffers: list = []
        weakref.finalize(self, self.pool.release_host, self.lent_buffers)
        self.work = TaskWork(ctx, self.graph, self.done, microbatches, training=training, fused=self.fused,
                             loss_scale=loss_scale, input_requires_grad=input_requires_grad, autocast=autocast,
                             rng=self.rng, lent_buffers=self.lent_buffers)
        self.host_work: list[tuple[StageWeights, Completion, list, bool]] = []  # weight-gradient downloads, dispatch order
        self.output_spec = None  # the merged output's tree spec, and per leaf whether it is floating
        self.output_is_float: list[bool] = []
        self.output_sizes: list = []  # per microbatch, its output tree (to split the output's gradients)
        # The caller's merged output (a call with loss_scale returns the summed losses: nothing to merge).
        self.outputs = OutputAssembly([batch_size_of(mb) for mb in microbatches] if loss_scale is None else [])
        self._measurements: list | None = None
        self.grad_scale: float | None = None  # what the fused run's results are multiplied by (submit_backward)

    def record_outputs(self, spec, is_float: list[bool], sizes: list) -> None:
        """What the forward returned to autograd, for splitting the gradients its backward gets."""
        self.output_spec, self.output_is_float, self.output_sizes = spec, is_float, sizes

    def _wait(self, c: Completion) -> Any:
        return c.wait(self.pool.timeout_s, waiter="the host thread", diagnose=self.pool.diagnose)

    # ------------------------------------------------------------------ submission
    def _submit(self, tasks: list[GraphTask]) -> None:
        """Submit graph tasks in order: the graph's deps, the history waits, and each kind's tensor work."""
        history = self.ctx.history
        for t in tasks:
            worker = self.pool.workers[t.worker]
            fn, nbytes, extra = HANDLERS[t.kind](self.work, t, worker)
            fn = self.readers.reading(fn, t.deps if t.kind not in NOT_READING else ())
            deps = [self.done[d] for d in t.deps] + history.resolve(t, usable=lambda c: not c.failed()) + extra
            kind = "release" if t.kind == TaskKind.FREE_KEPT else ("layer_" + t.kind if t.grain == "layer" else str(t.kind))
            label = TaskLabel(kind, t.stage, t.microbatch, t.worker, t.lane)
            c = worker.submit(t.lane, fn, deps, label, priority=t.priority, nbytes=nbytes,
                              always=t.kind in (TaskKind.RELEASE, TaskKind.FREE_KEPT))
            self.done[t.id] = c
            history.record(t, c)

    def drop_device_values(self) -> None:
        """After a failed call: forget every device value and kept graph (their readers will not run)."""
        self.readers.drop_all()
        self.work.graphs.clear()

    # ------------------------------------------------------------------ forward
    def forward(self, after_submit=None) -> list[HostCarry]:
        """Submit the forward phase; return each microbatch's output carry (host).

        A fused run's forward phase holds the backward stages too (backward is linear in the
        loss's gradient, so they run for a gradient of 1 while the host goes on).
        ``after_submit``: called once the phase is submitted, before anything is waited for (the
        engine finishes the previous call's backward tail there, while this forward runs)."""
        tasks = self.graph.phase("forward")
        self._submit(tasks)
        if after_submit is not None:
            after_submit()
        if self.fused:
            self.host_work = self.work.wgrad_work(tasks)
            return []
        L = self.plan.num_layers
        homes = sorted((t for t in tasks if t.kind == TaskKind.ACT_OUT and t.boundary == L), key=lambda t: t.microbatch)
        outs = []
        for t in homes:  # each into its rows of the merged output while later microbatches still run
            out = self._wait(self.done[t.id])
            self.outputs.add(len(outs), out)
            outs.append(out)
        self.rng.finish_forward()
        return outs

    def fused_loss(self) -> torch.Tensor:
        """The sum of the fused last stage's per-microbatch losses, in microbatch order."""
        total = torch.zeros((), dtype=torch.float32)
        for t in self.graph.tasks:  # fixed order: microbatch 0..M-1
            if t.kind == TaskKind.LOSS:
                total = total + self._wait(self.done[t.id])[0]
        self.rng.finish_forward()
        return total * self.loss_scale

    # ------------------------------------------------------------------ backward
    def backward(self, output_grads: list[HostCarry | None], incoming_scale: float | None = None,
                 accumulate: bool = True) -> list[list | None]:
        """Add every stage's weight gradients to the host ``.grad`` (dispatch order); return input grads.

        ``accumulate=False`` (``torch.autograd.grad`` for the inputs only): leave ``.grad`` alone.

        Ordinary runs submit the backward phase now. A fused run submitted it already: here its
        results are only multiplied by ``incoming_scale``. The same as ``submit_backward`` then
        ``finish_backward``.
        """
        self.submit_backward(output_grads, incoming_scale)
        return self.finish_backward(accumulate)

    def submit_backward(self, output_grads: list[HostCarry | None], incoming_scale: float | None = None) -> None:
        """Submit the backward phase (a fused run's is submitted already); return without waiting."""
        if self.fused:
            self.grad_scale = incoming_scale
            return
        self.work.output_grads = list(output_grads)
        if self.backwards:  # a second backward of this call (retain_graph=True)
            self._relower_backward()  # the first one freed the kept graphs: recompute from the stage inputs
        tasks = self.graph.phase("backward")
        self._submit(tasks)
        self.backwards += 1
        self.host_work = self.work.wgrad_work(tasks)
        self.grad_scale = None

    def finish_backward(self, accumulate: bool = True) -> list[list | None]:
        """The host's tail of a submitted backward: wait for every stage's weight gradients and add
        them to ``.grad`` in dispatch order, then bring the input gradients home (if asked for)."""
        ctx = self.ctx
        scale = self.grad_scale
        # Host side: gradients into .grad in dispatch order (deterministic whatever the timing).
        for weights, wg, chunk, last in self.host_work:
            grads = self._wait(wg)
            if accumulate:
                accumulate_host_grads(weights, grads, scale, ctx.grad_buffers, chunk)
                if last:  # every chunk of the stage is in: its layers' .grad are complete
                    ctx.grads_accumulated(weights.layer_ids)
            if not self.fused:  # each backward downloads afresh: these are read once, here
                kept = {id(p.grad) for p in weights.host if p.grad is not None}
                self.pool.release_host([g for g in grads if g is not None and id(g) not in kept])
                wg.drop_value()  # the worker's gradients (the CPU backend hands them over) go now
        if not self.input_requires_grad:
            self.pool.finish_step()  # device timings of the step into the trace, read once
            return [None] * self.M
        firsts = sorted((t for t in self.graph.tasks if t.kind == TaskKind.GRAD_OUT and t.boundary == 0),
                        key=lambda t: t.microbatch)
        trees = [self._wait(self.done[t.id]) for t in firsts]
        self.pool.finish_step()
        if scale is not None and scale != 1.0:
            trees = [HostCarry([x * scale if isinstance(x, torch.Tensor) else x for x in t.leaves], t.spec) for t in trees]
        return [t.tree() for t in trees]

    def _relower_backward(self) -> None:
        """Lower this call again so its backward phase can be submitted once more, dispatched from
        where the last stage left off, recomputing from the stage inputs. The lowering orders a
        call's tasks the same way whatever the first worker, so the new graph's forward tasks carry
        the ids of the tasks that already ran: the backward's inputs on the host resolve to their
        completions."""
        graph = self.ctx.lower(self.M, training=self.training, fused=self.fused,
                               input_gradient=self.input_requires_grad, kept_backward=False)
        old = self.graph.phase("forward")
        new = graph.phase("forward")
        assert [(a.id, a.kind, a.stage, a.microbatch) for a in old] == [(b.id, b.kind, b.stage, b.microbatch) for b in new]
        self.graph = graph
        self.work.use_graph(graph)
        self.readers.add_backward(graph)

    # ------------------------------------------------------------------ measurements
    @property
    def measurements(self) -> list[tuple[Stage, str, float]]:
        """(stage, kind, seconds) of every compute task of this call (``measurements.call_measurements``); none
        from a call during which ``torch.compile`` ran: its tasks' times hold compiles, not the stages' work."""
        if self._measurements is None:
            measured = call_measurements(self.pool, self.step, self.work.stages, self.work.keep_graph)
            self._measurements = [] if COMPILE_CLOCK.seconds() > self.compile_mark else measured
        return self._measurements

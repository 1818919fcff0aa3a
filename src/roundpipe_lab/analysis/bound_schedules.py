"""Bound pipeline schedules with CPU offload (GPipe, 1F1B, interleaved 1F1B), for comparison.

Each GPU owns fixed stages (virtual stage ``s`` on GPU ``s % P``), with model state on the host as
for RoundPipe and the same favours the simulator grants RoundPipe (activations through host
memory, per-layer checkpointing, resident or streamed weights, an overlapped host optimizer), so
the comparison isolates the schedule. ``mobius`` is the Mobius-like schedule (stages mapped
round-robin, weights streamed per direction). The assumptions in full: docs/design.md, design
notes, ``analysis/bound_schedules.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_roundpipe.cost.profile import CostProfile
from lightning_roundpipe.planning.cuts import balanced_ranges
from lightning_roundpipe.cost.view import CostView
from lightning_roundpipe.cost.graph_timing import LaneTimer, LaneWork, compute_seconds
from lightning_roundpipe.cost.hardware import HardwareProfile
from lightning_roundpipe.schedule.graph_task import COMPUTE, DEFAULT_PRIORITIES, DOWNLOAD, UPLOAD, TaskKind
from lightning_roundpipe.sim.simulate import SimConfig, SimResult, add_optimizer, link_of, summarize

BOUND_SCHEDULES = ("gpipe", "1f1b", "interleaved")
STREAMED_SCHEDULES = ("mobius",)
Action = tuple[str, int, int]  # ("F" or "B", virtual stage, microbatch)
# Transfer priorities (lower goes first): what a stage waits for, then weight prefetch, then
# gradients going home, as RoundPipe's defaults (its steps take theirs from the lowering).
PRIO_ACTIVATIONS = DEFAULT_PRIORITIES["activation"]
PRIO_WEIGHTS = DEFAULT_PRIORITIES["weights"]
PRIO_GRADS = DEFAULT_PRIORITIES["gradients"]
COMPUTE_KIND = {"F": TaskKind.FORWARD, "B": TaskKind.BACKWARD}


def bound_order(schedule: str, gpu: int, num_gpus: int, microbatches: int, chunks: int = 2) -> list[Action]:
    """The compute order of one GPU under a bound schedule.

    ``gpipe``: all forwards, then all backwards. ``1f1b``: ``P - p - 1`` warm-up forwards, then
    one forward one backward, then the remaining backwards. ``interleaved``: Megatron-LM's
    interleaved 1F1B with ``chunks`` model chunks per GPU (needs microbatches divisible by GPUs).
    """
    p, P, M = gpu, num_gpus, microbatches
    if schedule == "gpipe":
        return [("F", p, i) for i in range(M)] + [("B", p, i) for i in range(M)]
    if schedule == "1f1b":
        warm = min(P - p - 1, M)
        order: list[Action] = [("F", p, i) for i in range(warm)]
        for k in range(M - warm):
            order += [("F", p, warm + k), ("B", p, k)]
        return order + [("B", p, k) for k in range(M - warm, M)]
    if schedule == "interleaved":
        v = chunks
        if M % P:
            raise ValueError(f"interleaved 1F1B needs the microbatch count ({M}) to be a multiple of the GPU count ({P})")

        def unit(k: int, backward: bool) -> Action:
            chunk = (k // P) % v
            if backward:
                chunk = v - 1 - chunk
            return ("B" if backward else "F", chunk * P + p, (k // (P * v)) * P + k % P)

        total = M * v
        warm = min((P - p - 1) * 2 + (v - 1) * P, total)
        order = [unit(k, False) for k in range(warm)]
        for k in range(total - warm):
            order += [unit(warm + k, False), unit(k, True)]
        return order + [unit(k, True) for k in range(total - warm, total)]
    if schedule == "mobius":
        mine = list(range(p, chunks * P, P))
        return ([("F", s, i) for s in mine for i in range(M)]
                + [("B", s, i) for s in reversed(mine) for i in range(M)])
    raise ValueError(f"unknown bound schedule {schedule!r}; choose from {BOUND_SCHEDULES + STREAMED_SCHEDULES}")


def max_in_flight(order: list[Action]) -> int:
    """Most microbatch-stages forwarded but not yet backwarded at once on a GPU (checkpoints held)."""
    live = peak = 0
    for direction, _, _ in order:
        live += 1 if direction == "F" else -1
        peak = max(peak, live)
    return peak


@dataclass
class BoundLayout:
    """Where a bound schedule puts the layers and whether each GPU keeps its weights resident."""

    ranges: tuple[tuple[int, int], ...]  # layer range of each virtual stage
    resident: list[bool]  # per GPU
    need_bytes: list[int]  # per GPU, estimated peak under the chosen policy
    fits: bool


def bound_layout(schedule: str, view: CostView, num_gpus: int, microbatches: int, memory_bytes: float,
                 chunks: int = 2, offload: str = "auto", optimizer_state_bytes_per_param: float = 0.0) -> BoundLayout:
    """Balanced split, and per GPU the offload policy that fits (``offload``: auto, resident, stream).

    ``mobius`` always streams whole stages (two stages' weights and gradients resident).
    ``optimizer_state_bytes_per_param``: optimizer state each GPU keeps for its trainable
    parameters (0 when the optimizer runs on the host).
    """
    v = chunks if schedule in ("interleaved", "mobius") else 1
    num_stages = num_gpus * v
    if num_stages > len(view):
        raise ValueError(f"{schedule} over {num_gpus} GPUs needs {num_stages} stages but the model has {len(view)} layers")
    ranges = balanced_ranges(view.total_per_layer(), num_stages)
    resident, need = [], []
    for p in range(num_gpus):
        mine = [ranges[s] for s in range(p, num_stages, num_gpus)]
        order = bound_order(schedule, p, num_gpus, microbatches, chunks)
        checkpoints = max_in_flight(order) * max(sum(view.in_bytes(l) for l in range(a, b)) for a, b in mine)
        working = max(view.max_layer_graph(a, b) for a, b in mine)
        buffers = 2 * max(max(view.in_bytes(a), view.out_bytes(b - 1)) for a, b in mine)
        state = sum(view.weights(a, b) + view.grads(a, b) for a, b in mine)
        layer_state = max(view.layers[l].weight_bytes + view.layers[l].grad_bytes for a, b in mine for l in range(a, b))
        optimizer = optimizer_state_bytes_per_param * sum(view.trainable[l] for a, b in mine for l in range(a, b))
        resident_need = state + checkpoints + working + buffers + optimizer
        stream_need = 2 * layer_state + checkpoints + working + buffers
        if schedule == "mobius":
            # Breadth-first: every microbatch's checkpoints of every stage of this GPU are live at
            # the forward/backward turn; two whole stages' weights and gradients resident.
            checkpoints = microbatches * sum(view.in_bytes(l) for a, b in mine for l in range(a, b))
            stage_state = max(view.weights(a, b) + view.grads(a, b) for a, b in mine)
            need.append(2 * stage_state + checkpoints + working + buffers)
            resident.append(False)
            continue
        keep = offload == "resident" or (offload == "auto" and resident_need <= memory_bytes)
        if offload not in ("auto", "resident", "stream"):
            raise ValueError(f"unknown offload policy {offload!r}; use 'auto', 'resident' or 'stream'")
        resident.append(keep)
        need.append(resident_need if keep else stream_need)
    return BoundLayout(tuple(ranges), resident, need, all(n <= memory_bytes for n in need))


def stage_streamed(schedule: str) -> bool:
    """Whether the bound schedule streams a stage's weights from the host (an offloading baseline)."""
    return schedule in STREAMED_SCHEDULES


class _BoundBuilder:
    def __init__(self, sim: LaneTimer, schedule: str, view: CostView, hardware: HardwareProfile,
                 layout: BoundLayout, microbatches: int, num_gpus: int, chunks: int, config: SimConfig) -> None:
        self.sim, self.schedule, self.view, self.hw, self.layout = sim, schedule, view, hardware, layout
        self.m, self.P, self.chunks, self.cfg = microbatches, num_gpus, chunks, config
        self.V = len(layout.ranges)
        self.optim_prev: dict[int, list[LaneWork]] = {}
        self.stream_computes: list[list[LaneWork]] = [[] for _ in range(num_gpus)]  # per-layer compute sequence
        self.allocated_state: set[int] = set()  # layers whose resident weights/grads are already counted
        self.stage_passes: list[list[LaneWork]] = [[] for _ in range(num_gpus)]  # mobius: last compute of each stage pass

    def gpu_of(self, stage: int) -> int:
        return stage % self.P

    def step(self, step: int) -> None:
        view, m, P, V = self.view, self.m, self.P, self.V
        sim = self.sim
        first: dict[tuple[str, int, int], LaneWork] = {}  # first compute op of each action
        last: dict[tuple[str, int, int], LaneWork] = {}
        wgrads: list[tuple[int, LaneWork]] = []
        weight_ops: dict[int, list[LaneWork]] = {}  # resident: stage -> this step's uploads

        # Resident weights: one upload per layer per step, after the host updated it.
        for s, (a, b) in enumerate(self.layout.ranges):
            p = self.gpu_of(s)
            if not self.layout.resident[p]:
                continue
            ops = []
            for layer in range(a, b):
                nbytes = view.layers[layer].weight_bytes
                alloc = [] if layer in self.allocated_state else [(p, nbytes + view.layers[layer].grad_bytes)]
                self.allocated_state.add(layer)
                deps = list(self.optim_prev.get(layer, []))
                ops.append(sim.add(LaneWork(p, UPLOAD, TaskKind.WEIGHTS, f"S{s}", -1, step, bytes=nbytes, priority=PRIO_WEIGHTS,
                                      deps=deps, alloc=alloc)))
            weight_ops[s] = ops

        # Compute ops, GPU by GPU in schedule order (the queue order); dependencies wired below.
        for p in range(P):
            for direction, s, i in bound_order(self.schedule, p, P, m, self.chunks):
                a, b = self.layout.ranges[s]
                name = f"{direction}{s}"
                if stage_streamed(self.schedule):
                    op = self._stage_pass(p, direction, s, i, step, a, b, wgrads)
                    first[(direction, s, i)] = last[(direction, s, i)] = op
                elif self.layout.resident[p]:
                    graph, checkpoint = view.max_layer_graph(a, b), sum(view.in_bytes(l) for l in range(a, b))
                    forward = direction == "F"  # forward keeps the checkpoint, backward frees it
                    op = sim.add(LaneWork(p, COMPUTE, COMPUTE_KIND[direction], name, i, step,
                                          seconds=compute_seconds(view, COMPUTE_KIND[direction], a, b),
                                          deps=list(weight_ops[s]) if forward else [],
                                          alloc=[(p, checkpoint + graph if forward else graph)],
                                          free=[(p, graph if forward else graph + checkpoint)]))
                    first[(direction, s, i)] = last[(direction, s, i)] = op
                else:
                    ops = self._streamed(p, direction, s, i, step, a, b, wgrads)
                    first[(direction, s, i)], last[(direction, s, i)] = ops[0], ops[-1]

        # Activations and gradients between stages, through the host.
        def hop(src, dst, kind, from_stage, to_stage, i, nbytes, producer):
            """``producer``'s output of microbatch i downloaded from GPU ``src`` and uploaded to ``dst``
            (``kind``: the download's and the upload's task kinds)."""
            down = sim.add(LaneWork(src, DOWNLOAD, kind[0], from_stage, i, step, bytes=nbytes,
                              priority=PRIO_ACTIVATIONS, deps=[producer], free=[(src, nbytes)]))
            producer.alloc.append((src, nbytes))
            return sim.add(LaneWork(dst, UPLOAD, kind[1], to_stage, i, step, bytes=nbytes,
                              priority=PRIO_ACTIVATIONS, deps=[down], alloc=[(dst, nbytes)]))

        for s in range(V):
            p = self.gpu_of(s)
            a, b = self.layout.ranges[s]
            for i in range(m):
                f_first, f_last = first[("F", s, i)], last[("F", s, i)]
                b_first, b_last = first[("B", s, i)], last[("B", s, i)]
                b_first.deps.append(f_last)
                if s == 0:
                    ids = sim.add(LaneWork(p, UPLOAD, TaskKind.ACT_IN, f"F{s}", i, step, bytes=view.in_bytes(0),
                                     priority=PRIO_ACTIVATIONS, alloc=[(p, view.in_bytes(0))]))
                    f_first.deps.append(ids)
                    f_last.free.append((p, view.in_bytes(0)))
                if s < V - 1:
                    q = self.gpu_of(s + 1)
                    nxt_f, nxt_b_last = first[("F", s + 1, i)], last[("B", s + 1, i)]
                    nbytes = view.out_bytes(b - 1)
                    if q == p:  # next stage on the same GPU: nothing moves
                        nxt_f.deps.append(f_last)
                        b_first.deps.append(nxt_b_last)
                        continue
                    nxt_f.deps.append(hop(p, q, (TaskKind.ACT_OUT, TaskKind.ACT_IN), f"F{s}", f"F{s + 1}", i, nbytes, f_last))
                    last[("F", s + 1, i)].free.append((q, nbytes))
                    b_first.deps.append(hop(q, p, (TaskKind.GRAD_OUT, TaskKind.GRAD_IN), f"B{s + 1}", f"B{s}", i, nbytes, nxt_b_last))
                    b_last.free.append((p, nbytes))
            # Resident: accumulated gradients go home once, after the stage's last backward.
            if self.layout.resident[p]:
                done = [last[("B", s, i)] for i in range(m)]
                self._wgrads(p, f"B{s}", -1, step, reversed(range(a, b)), done, wgrads, frees=False)

        by_layer: dict[int, list[LaneWork]] = {}
        for layer, op in wgrads:
            by_layer.setdefault(layer, []).append(op)
        self.optim_prev = add_optimizer(sim, by_layer, view, self.hw, self.cfg, step)

    def _wgrads(self, p: int, stage: str, microbatch: int, step: int, layers, deps: list[LaneWork],
                wgrads: list[tuple[int, LaneWork]], frees: bool = True) -> None:
        """Downloads of the weight gradients of ``layers`` (in that order; frozen layers send nothing)
        after ``deps``; ``frees``: they leave the GPU (False: resident gradients)."""
        for layer in layers:
            nbytes = self.view.layers[layer].grad_bytes
            if nbytes > 0:
                wgrads.append((layer, self.sim.add(LaneWork(p, DOWNLOAD, TaskKind.WGRAD, stage, microbatch, step,
                                                            bytes=nbytes, priority=PRIO_GRADS, deps=list(deps),
                                                            free=[(p, nbytes)] if frees else []))))

    def _stage_pass(self, p: int, direction: str, s: int, i: int, step: int, a: int, b: int,
                    wgrads: list[tuple[int, LaneWork]]) -> LaneWork:
        """Microbatch ``i`` of a stage whose weights are streamed once per direction (mobius)."""
        view, sim = self.view, self.sim
        weights, grads = view.weights(a, b), view.grads(a, b)
        checkpoint = sum(view.in_bytes(l) for l in range(a, b))
        graph = view.max_layer_graph(a, b)
        deps, alloc, free = [], [(p, graph)], [(p, graph)]
        if i == 0:  # the stage's weights arrive once the pass two back on this GPU is done
            passes = self.stage_passes[p]
            slot = [passes[-2]] if len(passes) >= 2 else []
            updated = [op for layer in range(a, b) for op in self.optim_prev.get(layer, [])]
            up = sim.add(LaneWork(p, UPLOAD, TaskKind.WEIGHTS, f"{direction}{s}", -1, step, bytes=weights, priority=PRIO_WEIGHTS,
                            deps=slot + (updated if direction == "F" else []), alloc=[(p, weights)]))
            deps.append(up)
            if direction == "B":
                alloc.append((p, grads))
        if direction == "F":
            alloc.append((p, checkpoint))
        else:
            free.append((p, checkpoint))
        last = i == self.m - 1
        if last:
            free.append((p, weights))
        op = sim.add(LaneWork(p, COMPUTE, COMPUTE_KIND[direction], f"{direction}{s}", i, step,
                              seconds=compute_seconds(view, COMPUTE_KIND[direction], a, b), deps=deps, alloc=alloc,
                              free=free))
        if last:
            self.stage_passes[p].append(op)
            if direction == "B":
                self._wgrads(p, f"B{s}", -1, step, reversed(range(a, b)), [op], wgrads)
        return op

    def _streamed(self, p: int, direction: str, s: int, i: int, step: int, a: int, b: int,
                  wgrads: list[tuple[int, LaneWork]]) -> list[LaneWork]:
        """One forward or backward of a microbatch with weights streamed layer by layer."""
        view, sim, seq = self.view, self.sim, self.stream_computes[p]
        name = f"{direction}{s}"
        layers = range(a, b) if direction == "F" else reversed(range(a, b))
        ops = []
        for layer in layers:
            cost = view.layers[layer]
            slot = [seq[-2]] if len(seq) >= 2 else []  # two layers' weights resident
            deps = slot + self.optim_prev.get(layer, [])
            up = sim.add(LaneWork(p, UPLOAD, TaskKind.WEIGHTS, name, i, step, bytes=cost.weight_bytes, priority=PRIO_WEIGHTS,
                            deps=deps, alloc=[(p, cost.weight_bytes)]))
            graph = view.graph_per_token[layer] * view.tokens
            seconds = compute_seconds(view, COMPUTE_KIND[direction], layer, layer + 1)
            if direction == "F":
                op = LaneWork(p, COMPUTE, TaskKind.FORWARD, name, i, step, seconds=seconds, deps=[up] + ops[-1:],
                              alloc=[(p, view.in_bytes(layer) + graph)], free=[(p, graph + cost.weight_bytes)])
            else:
                op = LaneWork(p, COMPUTE, TaskKind.BACKWARD, name, i, step, seconds=seconds, deps=[up] + ops[-1:],
                              alloc=[(p, graph + cost.grad_bytes)],
                              free=[(p, graph + cost.weight_bytes + view.in_bytes(layer))])
            sim.add(op)
            seq.append(op)
            ops.append(op)
            if direction == "B":
                self._wgrads(p, name, i, step, [layer], [op], wgrads)
        return ops


def simulate_bound(
    schedule: str,
    costs: CostProfile,
    hardware: HardwareProfile,
    microbatches: int,
    *,
    num_gpus: int | None = None,
    chunks_per_gpu: int = 2,
    offload: str = "auto",
    memory_fraction: float = 0.9,
    config: SimConfig | None = None,
    optimizer_state_bytes_per_param: float = 0.0,
) -> SimResult:
    """Simulate ``gpipe``, ``1f1b``, ``interleaved`` or ``mobius`` with stages bound to GPUs and CPU offload.

    ``memory_fraction`` of each GPU's memory is usable (the rest is CUDA context and allocator
    slack); when even streamed weights do not fit, the result has ``fits=False`` and an infinite
    step time, without simulating.
    """
    P = hardware.num_gpus if num_gpus is None else int(num_gpus)
    cfg = config or SimConfig()
    view = CostView(costs)
    budget = hardware.gpu_memory_bytes * memory_fraction
    layout = bound_layout(schedule, view, P, microbatches, budget, chunks_per_gpu, offload,
                          optimizer_state_bytes_per_param)
    notes = {"ranges": layout.ranges, "resident": layout.resident, "estimated_gpu_bytes": layout.need_bytes}
    if not layout.fits:
        return SimResult(schedule, math.inf, 0.0, list(layout.need_bytes), [], P, microbatches,
                         microbatches * view.tokens, fits=False, notes=notes)
    sim = LaneTimer(link_of(hardware, cfg))
    builder = _BoundBuilder(sim, schedule, view, hardware, layout, microbatches, P, chunks_per_gpu, cfg)
    for step in range(cfg.steps):
        builder.step(step)
    sim.run()
    return summarize(sim, schedule, P, microbatches, view.tokens, cfg.steps, **notes)

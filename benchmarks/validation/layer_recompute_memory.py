"""Measured: the memory a CPU worker holds during a backward stage, stage-grain versus layer-grain recompute.

A stack of transformer-like blocks (Linear h->4h, GELU, Linear 4h->h, residual, LayerNorm) runs
as ONE forward and ONE backward stage on one CPU worker, so the backward stage holds every
layer. Each backward compute task is run under torch's profiler with ``profile_memory=True``
inside the worker's thread (the profiler records the thread that starts it; on the CPU backend
autograd runs the backward in the caller's thread too). The figure is the peak of the running
sum of the task's allocations minus its frees: the bytes the task holds above what was alive
when it started (the uploaded weights and the stage input are not counted, they are the same
in both modes). The model next to it is ``cost/memory.py``'s stage working set for each grain,
from graph bytes per layer measured with saved-tensor hooks.

    python benchmarks/validation/layer_recompute_memory.py [--tokens 4096 --width 256 --layers 8]
"""

from __future__ import annotations

import argparse
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.cost.memory import stage_activation_bytes
from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.cost.view import CostView
from lightning_roundpipe.schedule.plan import Plan


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.down(nn.functional.gelu(self.up(x))))


def _task_peak(fn):
    """Run ``fn`` in this thread under the profiler; (its value, peak bytes held above the start)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        value = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return value, peak


def _measure_backward_tasks(worker, peaks: list):
    """Wrap the worker's backward computes so that each is measured in the worker's own thread."""
    submit = worker.submit

    def measured_submit(lane, fn, deps, label, **kwargs):
        if lane == "compute" and label.kind in ("backward", "layer_backward"):
            inner = fn

            def fn():
                value, peak = _task_peak(inner)
                peaks.append(peak)
                return value

        return submit(lane, fn, deps, label, **kwargs)

    worker.submit = measured_submit


def graph_bytes_per_layer(width: int, tokens: int) -> int:
    """Bytes autograd saves for one block's backward (saved-tensor hooks, unique storages)."""
    block = Block(width)
    x = torch.randn(tokens, width, requires_grad=True)
    seen: dict[int, int] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    inputs = x.untyped_storage().nbytes()
    return sum(seen.values()) - (inputs if x.untyped_storage().data_ptr() in seen else 0)


def modelled(recompute: str, tokens: int, width: int, layers: int, graph_bytes: int) -> int:
    """``cost/memory.py``'s graph term of the one backward stage (the stage input is its input buffer)."""
    per_token = width * 4
    costs = CostProfile([LayerCost(0.0, 0.0, 0.0, 0, 0, per_token, graph_bytes_per_token=graph_bytes // tokens)
                         for _ in range(layers)], tokens_per_microbatch=tokens, dtype_bytes=4,
                        input_bytes_per_token=per_token)
    plan = Plan(layers, ((0, layers),), ((0, layers),))
    return stage_activation_bytes(plan, CostView(costs), plan.backward_stages()[0], recompute)[0]


def measure(recompute: str, tokens: int, width: int, layers: int, microbatches: int = 1) -> int:
    """Peak bytes a backward stage of ``layers`` blocks holds above its start (largest microbatch)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[Block(width) for _ in range(layers)])
    x = torch.randn(tokens * microbatches, width)
    whole = [[0, layers]]
    rt = RoundPipeRuntime.attach(net, "cpu", 1, RuntimeOptions(
        microbatches=microbatches, step_metrics=False, recompute=recompute,
        partition={"policy": "manual", "manual_forward": whole, "manual_backward": whole}))
    peaks: list[int] = []
    try:
        net(x).pow(2).mean().backward()  # warm-up: first-call allocations are not the steady state
        for w in rt.engine.pool.workers:
            _measure_backward_tasks(w, peaks)
        net.zero_grad(set_to_none=True)
        net(x).pow(2).mean().backward()
    finally:
        rt.detach()
    return max(peaks)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    graph = graph_bytes_per_layer(a.width, a.tokens)
    act = a.tokens * a.width * 4
    print(f"{a.layers} blocks of width {a.width}, {a.tokens} tokens per microbatch, fp32, one backward stage on one "
          f"CPU worker (measured)")
    print(f"graph saved per block {graph / 2**20:.1f} MiB (saved-tensor hooks), layer input {act / 2**20:.1f} MiB")
    rows = []
    for recompute in ("always", "layer"):
        rows.append((recompute, measure(recompute, a.tokens, a.width, a.layers)))
    model = {"always": modelled("stage", a.tokens, a.width, a.layers, graph),
             "layer": modelled("layer", a.tokens, a.width, a.layers, graph)}
    print(f"{'recompute':<10} {'measured peak':>14} {'model graph term':>18}")
    for recompute, peak in rows:
        print(f"{recompute:<10} {peak / 2**20:>10.1f} MiB {model[recompute] / 2**20:>14.1f} MiB")
    print(f"saving: {rows[0][1] / rows[1][1]:.2f}x less held by the worker during the backward stage with layer grain")


if __name__ == "__main__":
    main()

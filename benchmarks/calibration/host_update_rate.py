"""Host optimizer update rate at one decoder layer, per AdamW implementation and thread count.

    python -m benchmarks.calibration.host_update_rate [--threads 1 2] [--quick] [--json PATH]

What the overlapped optimizer's lane does per layer (``optim/host_lane.py``): ``torch.optim.AdamW``
on one decoder layer's fp32 parameters, here a Qwen3-1.7B layer (hidden 2048, intermediate 6144,
16 query and 8 key/value heads of 128: 50.3e6 parameters; ``--quick``: a 256-wide one). Timed,
best of ``--repeats`` steps after one untimed step, for the for-loop (torch's CPU default),
``foreach`` and ``fused`` implementations at each thread count (``--threads``; the optimizer
lane's count is ``host/threads.host_optimizer_threads``). Also checks whether ``fused`` and
``foreach`` give the for-loop's weights bit for bit after 3 steps (``bitwise_equal_to_for_loop``).
"""

from __future__ import annotations

import platform
import time

import torch

from benchmarks.harness import cli, write_json
from lightning_roundpipe.host.threads import host_optimizer_threads, usable_cores

IMPLEMENTATIONS = {"for_loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def layer_shapes(hidden: int = 2048, intermediate: int = 6144, heads: int = 16, kv_heads: int = 8,
                 head_dim: int = 128) -> list[tuple[int, ...]]:
    """The parameter shapes of one Qwen3 decoder layer (attention with q/k norms, gated MLP, 2 norms)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (head_dim,), (head_dim,),
            (intermediate, hidden), (intermediate, hidden), (hidden, intermediate), (hidden,), (hidden,)]


def make_params(shapes, seed: int = 0) -> list[torch.nn.Parameter]:
    """Parameters of ``shapes`` with gradients, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
        p.grad = torch.randn(shape, generator=g) * 1e-3
        params.append(p)
    return params


def step_seconds(shapes, impl: str, threads: int, repeats: int) -> float:
    """Fastest of ``repeats`` AdamW steps over ``shapes`` with ``impl`` on ``threads`` intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        opt = torch.optim.AdamW(make_params(shapes), lr=1e-3, weight_decay=0.1, **IMPLEMENTATIONS[impl])
        opt.step()  # creates the state: not timed
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            opt.step()
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(before)


def weights_after(shapes, impl: str, steps: int = 3) -> list[torch.Tensor]:
    """The weights after ``steps`` AdamW steps with ``impl`` (new gradients each step, same seeds)."""
    params = make_params(shapes)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **IMPLEMENTATIONS[impl])
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()
    return [p.detach().clone() for p in params]


def measure(shapes, threads: list[int], repeats: int) -> dict:
    """Rates (parameters/s) per implementation and thread count, and the bit-for-bit check."""
    params = sum(torch.Size(s).numel() for s in shapes)
    rates = {impl: {str(t): round(params / step_seconds(shapes, impl, t, repeats)) for t in threads}
             for impl in IMPLEMENTATIONS}
    reference = weights_after(shapes, "for_loop")
    equal, max_difference = {}, {}
    for impl in ("foreach", "fused"):
        got = weights_after(shapes, impl)
        equal[impl] = all(torch.equal(a, b) for a, b in zip(got, reference))
        max_difference[impl] = max((a - b).abs().max().item() for a, b in zip(got, reference))
    return {"layer_params": params, "params_per_s": rates, "bitwise_equal_to_for_loop": equal,
            "max_abs_difference_to_for_loop": max_difference}


def main(argv: list[str] | None = None) -> dict:
    parser = cli(__doc__.splitlines()[0], quick="a 256-wide layer and 2 repeats (a smoke run)")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="intra-op thread counts (default: 1 and every usable core)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    shapes = layer_shapes(256, 768, 2, 1, 128) if args.quick else layer_shapes()
    threads = args.threads or sorted({1, usable_cores()})
    result = measure(shapes, threads, 2 if args.quick else args.repeats)
    result.update(machine=f"{platform.processor() or platform.machine()}, {usable_cores()} usable cores, "
                          f"torch {torch.__version__}", rule_threads_without_pool=host_optimizer_threads(None))
    print(f"one layer: {result['layer_params'] / 1e6:.1f}e6 parameters ({result['machine']})")
    for impl, by_threads in result["params_per_s"].items():
        cells = ", ".join(f"{t} thread(s) {r / 1e6:.0f}e6/s" for t, r in by_threads.items())
        print(f"  AdamW {impl:8s}: {cells}")
    for impl, same in result["bitwise_equal_to_for_loop"].items():
        print(f"  {impl} equals the for-loop after 3 steps: {same} "
              f"(max |difference| {result['max_abs_difference_to_for_loop'][impl]:.3g})")
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()

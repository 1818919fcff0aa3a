"""Host-side rates of this machine, per core: fused CPU Adam, the optimizer's conversions, memory copy.

    python -m benchmarks.calibration.host_rates [--threads 1] [--mib 256]

What the host optimizer of an offloaded run does per parameter, timed on this machine's cores
(best of 5, tensors far larger than the caches so memory, not cache, is what is measured):

- ``adam``: ``torch.optim.Adam(fused=True)`` on fp32 (reads param, grad, m, v; writes param, m,
  v: 28 bytes per parameter);
- ``grad_to_fp32``: an fp16 gradient added into an fp32 one (the gradient moved into the
  optimizer's dtype; 2 + 4 read, 4 written);
- ``weight_to_fp16``: the updated fp32 weight copied into the fp16 copy the workers upload
  (4 read, 2 written);
- ``copy``: an fp32 copy (read + write), the plain memory bandwidth of the threads used.

Printed as YAML (``conf/hardware_measurements/dev_host.yaml`` holds this machine's run). A
multithreaded Adam on a server is memory bound: these per-core numbers show how many bytes a
core moves, not what a socket does; the simulator's profiles take the host's sustained memory
bandwidth (``host_memory_bytes_per_s``) instead.
"""

from __future__ import annotations

import platform
import time

import torch

from benchmarks.harness import cli, write_json


def best_seconds(fn, repeats: int = 5) -> float:
    """Fastest of ``repeats`` timed calls of ``fn``, after one untimed call (the first touch of the memory)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(threads: int = 1, mib: int = 256) -> dict:
    torch.set_num_threads(threads)
    n = mib * 2**20 // 4
    param = torch.nn.Parameter(torch.zeros(n))
    param.grad = torch.randn(n)
    adam = torch.optim.Adam([param], lr=1e-3, fused=True)
    fp16_grad, fp32_grad = torch.randn(n, dtype=torch.float16), torch.zeros(n)
    fp16_weight = torch.empty(n, dtype=torch.float16)
    source, target = torch.randn(n), torch.empty(n)
    adam_s = best_seconds(adam.step)
    grad_s = best_seconds(lambda: fp32_grad.add_(fp16_grad))
    weight_s = best_seconds(lambda: fp16_weight.copy_(param.detach()))
    copy_s = best_seconds(lambda: target.copy_(source))
    return {
        "machine": f"{platform.processor() or platform.machine()}, {threads} thread(s), torch {torch.__version__}",
        "tensor_mib": mib,
        "adam_params_per_s": round(n / adam_s),
        "adam_bytes_per_s": round(28 * n / adam_s),
        "grad_to_fp32_params_per_s": round(n / grad_s),
        "weight_to_fp16_params_per_s": round(n / weight_s),
        "copy_bytes_per_s": round(8 * n / copy_s),
    }


def main(argv: list[str] | None = None) -> None:
    parser = cli(__doc__.splitlines()[0], json_help="also write the rates to this JSON file (they go into a hardware profile)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mib", type=int, default=256, help="size of each fp32 tensor")
    args = parser.parse_args(argv)
    rates = measure(args.threads, args.mib)
    for key, value in rates.items():
        print(f"{key}: {value}")
    if args.json:
        write_json(args.json, {"threads": args.threads, "mib": args.mib, "rates": rates})


if __name__ == "__main__":
    main()

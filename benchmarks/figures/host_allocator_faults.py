"""Page faults of the loss phase's fresh tensors, with glibc's thresholds and with freed memory kept.

Each mode runs in its own process (glibc's setting is per process and cannot be put back): a
copy into a fresh merged-logits tensor (16 x 128 x 6144 floats, issue 22's bar model) and
``F.cross_entropy`` forward and backward on it, one thread, 10 times; the median time and minor
page faults are printed per mode, with the load average.

    python -m benchmarks.figures.host_allocator_faults
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = """
import resource, statistics, sys, time, torch, torch.nn.functional as F
from lightning_roundpipe.host.host_allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "kept" else False
torch.set_num_threads(1)
base = torch.randn(16 * 128, 6144); y = torch.randint(0, 6144, (16 * 128,))
runs = []
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter(); f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    merged = torch.empty_like(base); merged.copy_(base)
    F.cross_entropy(merged.requires_grad_(), y).backward()
    runs.append((time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0))
print(f"{sys.argv[1]:6s} (set: {kept}): {statistics.median(r[0] for r in runs) * 1e3:6.1f} ms, "
      f"{statistics.median(r[1] for r in runs):8.0f} page faults (medians of {len(runs)})")
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2, help="processes per mode, alternating (default 2)")
    parser.add_argument("--runs", type=int, default=10, help="runs per process; the medians are printed")
    args = parser.parse_args(argv)
    for mode in ("glibc", "kept") * args.pairs:
        subprocess.run([sys.executable, "-c", CHILD, mode, str(args.runs)], check=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

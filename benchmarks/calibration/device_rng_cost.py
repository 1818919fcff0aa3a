"""Host cost of the per-layer random-number handling on a GPU, per layer call (``engine/rng.py``).

    python -m benchmarks.calibration.device_rng_cost [--calls 20000] [--quick] [--json PATH]

Times ``CallRng.layer`` around an empty layer on ``cuda:0``, with CUDA's generator stood in for by
a Python object of the same interface (seed, offset, a 16-byte state: no GPU here), in the three
ways a layer can run: ``seeded`` (the device's gate held alone, seeded, 5 generator calls: what
every CUDA layer paid before issue 42), ``shared`` (a layer known not to draw: no seed, one state
read at the end) and ``quiet_run`` (a run of 8 such layers checked once, per layer). Best of 5
rounds, microseconds per layer call. A real CUDA generator's calls cost about as much as these
Python ones (a C++ call each), so the differences carry over; the absolute times are this host's.
"""

from __future__ import annotations

import time
from unittest import mock

import torch
from torch import nn

from benchmarks.harness import cli, write_json
from lightning_roundpipe.engine.rng import CallRng

GPU = torch.device("cuda", 0)
RUN = 8  # layers in a quiet run (a stage)


class StandInGenerator:
    """CUDA's per-device generator reduced to what ``CallRng`` uses: seed, offset and state."""

    def __init__(self):
        self.seed, self.offset = 0, 0

    def manual_seed(self, seed):
        self.seed, self.offset = int(seed), 0

    def get_offset(self):
        return self.offset

    def get_state(self):
        return torch.tensor([self.seed, self.offset], dtype=torch.int64)

    def set_state(self, state):
        self.seed, self.offset = int(state[0]), int(state[1])


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    """Best of ``rounds`` of ``calls`` calls of ``fn``, in microseconds per call."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def measure(calls: int) -> dict:
    """Microseconds per layer call in each of the three ways (see the module doc)."""
    with mock.patch.object(torch.cuda, "default_generators", (StandInGenerator(),)):
        call = CallRng(timeout_s=10)
        layers = [nn.Linear(1, 1) for _ in range(RUN)]
        for i, m in enumerate(layers):  # first calls run seeded and learn that these layers draw nothing
            with call.layer(GPU, i, 0, m):
                pass

        def seeded():
            with call.layer(GPU, 0, 0):  # no module: always seeded, as every CUDA layer ran before
                pass

        def shared():
            with call.layer(GPU, 0, 0, layers[0]):
                pass

        def quiet_run():
            with call.quiet_run(GPU, range(RUN), 0, layers) as held:  # before issue 42: never held on a GPU
                for i, m in enumerate(layers):
                    if not held:
                        with call.layer(GPU, i, 0, m):
                            pass

        return {"seeded_us": per_call_us(seeded, calls), "shared_us": per_call_us(shared, calls),
                "quiet_run_us_per_layer": per_call_us(quiet_run, max(1, calls // RUN)) / RUN}


def main(argv: list[str] | None = None) -> dict:
    parser = cli(__doc__.splitlines()[0], quick="2000 calls per round (a smoke run)")
    parser.add_argument("--calls", type=int, default=20000, help="layer calls per round")
    args = parser.parse_args(argv)
    result = measure(2000 if args.quick else args.calls)
    for key, value in result.items():
        print(f"{key}: {value:.2f}")
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()

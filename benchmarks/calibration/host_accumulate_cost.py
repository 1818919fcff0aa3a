"""Host time to add a downloaded gradient into ``.grad``, beside one Adam step, on this CPU.

    python -m benchmarks.calibration.host_accumulate_cost [--params 16000000] [--rounds 7]

The engine's ``backward()`` adds every stage's downloaded compute-dtype gradient into the fp32
``.grad`` of its master on the host's main thread (``params/weights.py``:
``accumulate_host_grads``: a cast to fp32, a multiply by the loss scale when there is one,
then ``add_``). With gradient accumulation (or any scaled loss) that is one pass over every
trainable parameter per forward-backward call, on the thread that also dispatches the tasks.
This times, on one ``--params`` tensor, side by side in one process (best of ``--rounds``):

- ``cast-scale-add``: the engine's arithmetic (three passes, two temporaries);
- ``add-alpha``: ``grad.add_(g, alpha=scale)`` (one pass, no temporary);
- ``adam``: one ``torch.optim.Adam`` step (fp32) of a parameter of the same size.

The ratios transfer to another host better than the absolute times (all three are
memory-bound): ``analysis/own_engine.py`` prices the accumulation on a GPU server as the profile's
host Adam rate times the measured ``adam / cast-scale-add`` ratio, in gradient bytes per second.
"""

from __future__ import annotations

import torch

from benchmarks.harness import cli, write_json

from .host_rates import best_seconds


def measure(params: int, rounds: int = 7, scale: float = 0.25) -> dict[str, float]:
    """Best seconds of each way (see the module doc) on ``params`` parameters."""
    g = torch.randn(params, dtype=torch.bfloat16)
    grad = torch.zeros(params, dtype=torch.float32)
    p = torch.nn.Parameter(torch.zeros(params))
    p.grad = torch.randn(params)
    adam = torch.optim.Adam([p], lr=1e-3)

    def cast_scale_add():
        grad.add_(g.to(torch.float32) * scale)

    def add_alpha():
        grad.add_(g, alpha=scale)

    out = {}
    for name, fn in (("cast-scale-add", cast_scale_add), ("add-alpha", add_alpha), ("adam", adam.step)):
        out[name] = best_seconds(fn, rounds)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = cli(__doc__.splitlines()[0], json_help="also write the seconds to this JSON file")
    parser.add_argument("--params", type=int, default=16_000_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    t = measure(args.params, args.rounds)
    for name, s in t.items():
        print(f"{name:>15}: {s * 1e3:8.2f} ms  ({args.params / s:.3g} params/s, {2 * args.params / s / 1e9:.2f} GB/s "
              f"of bf16 gradient)")
    print(f"adam / cast-scale-add: {t['adam'] / t['cast-scale-add']:.2f}   "
          f"cast-scale-add / add-alpha: {t['cast-scale-add'] / t['add-alpha']:.2f}   (torch threads {torch.get_num_threads()})")
    if args.json:
        write_json(args.json, {"params": args.params, "rounds": args.rounds, "seconds": t})


if __name__ == "__main__":
    main()

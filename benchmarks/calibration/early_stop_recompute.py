"""A decoder layer's recompute with early stop, on this CPU: the layer's forward and backward as one
compiled ``torch.func.vjp`` graph against the compiled forward with grad then backward.

    python -m benchmarks.calibration.early_stop_recompute [--quick] [--json PATH]

What it measures is the engine's ``recompute_early_stop`` (``engine/early_stop.py``) against its
plain compiled recompute. A backward stage recomputes each layer's forward with grad and then runs its
backward; the layer's last matmul (the MLP down projection) is recomputed although its output is never
read: its backward needs only its input, its weight and the output's gradient. Compiled as one
function from (weights, layer input, output gradient) to gradients, inductor leaves that matmul out.
torch's non-reentrant checkpoint skips it the same way (``set_checkpoint_early_stop``).

Builds the Llama-shaped decoder layer of ``compiled_layers`` (from a config, no download) and times,
best of ``--rounds``, one torch thread, alternating within each round:

- ``compiled_forward_backward``: the engine's compiled call with grad, then backward (what a
  backward stage runs per layer today with ``compile_layers``);
- ``compiled_vjp``: the engine's early-stopping backward of the same layer (``EARLY_STOP.grads``: the
  compiled ``torch.func.vjp`` of the layer's call, after its one-off meta trace).

It also reports the largest difference of their gradients (weights and layer input) and each
compile's first call.
"""

from __future__ import annotations

import os
import time

import torch

from benchmarks.calibration.compiled_layers import FULL, QUICK, decoder_layer, timed
from benchmarks.harness import cli, load_line, markdown_table, run_info, write_json


def compare(step, params, carry, rounds: int) -> dict:
    """Seconds (best of ``rounds``) and first-call seconds of both ways, and their largest gradient difference."""
    from torch.utils import _pytree as pytree

    from lightning_roundpipe.engine.compiled_layers import COMPILED_LAYERS
    from lightning_roundpipe.engine.early_stop import EARLY_STOP

    grad_out = torch.randn_like(carry["hidden"])
    weights = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    keys, spec = pytree.tree_flatten({k: k for k in carry})
    hidden_at = keys.index("hidden")
    out_grads = [grad_out if k == "hidden" else None for k in keys]

    def forward_backward():
        for v in leaves.values():
            v.grad = None
        hidden = carry["hidden"].detach().requires_grad_()
        COMPILED_LAYERS.call(step, leaves, dict(carry, hidden=hidden))["hidden"].backward(grad_out)
        return {k: v.grad for k, v in leaves.items()}, hidden.grad

    def by_vjp():
        grads, inputs = EARLY_STOP.grads(step, weights, dict(carry, hidden=carry["hidden"].detach()), (hidden_at,),
                                         out_grads, ("cpu", False, None))
        return grads, inputs[hidden_at]

    fns = {"compiled_forward_backward": forward_backward, "compiled_vjp": by_vjp}
    first = {name: timed(fn) for name, fn in fns.items()}
    (wa, ha), (wb, hb) = forward_backward(), by_vjp()
    diff = max([(ha - hb).abs().max().item()] + [(wa[k] - wb[k]).abs().max().item() for k in wa])
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], timed(fn))
    return {"seconds": best, "first_call_s": first, "max_grad_difference": diff}


def main(argv: list[str] | None = None) -> None:
    parser = cli(__doc__.splitlines()[0], quick="a smaller layer (width 64, 64 tokens)")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shape = QUICK if args.quick else FULL
    load, started = os.getloadavg(), time.perf_counter()
    step, params, carry = decoder_layer(**shape)
    out = compare(step, params, carry, args.rounds)
    fb, v = out["seconds"]["compiled_forward_backward"], out["seconds"]["compiled_vjp"]
    rows = [{"way": name, "ms": s * 1e3, "first_s": out["first_call_s"][name]} for name, s in out["seconds"].items()]
    info = run_info(load, started)
    print(f"Llama decoder layer, hidden {shape['hidden']}, MLP {shape['intermediate']}, {shape['seq']} tokens, 1 thread, "
          f"torch {torch.__version__}")
    print(markdown_table(rows, [("way", "recompute and backward", "{}"), ("ms", "ms", "{:.3f}"),
                                ("first_s", "first call s (compile)", "{:.1f}")]))
    print(f"vjp / forward+backward: {v / fb:.3f}; largest gradient difference {out['max_grad_difference']:.3g}")
    print(load_line(info))
    if args.json:
        write_json(args.json, {"shape": shape, "rounds": args.rounds, **out, "ratio": v / fb, "run": info})


if __name__ == "__main__":
    main()

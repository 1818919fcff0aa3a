"""A decoder layer's time compiled (``compile_layers=True``) against eager, on this CPU, and the compile time.

    python -m benchmarks.calibration.compiled_layers [--quick] [--json PATH]

Builds one Llama-shaped decoder layer from a config (no download), as the causal-LM adapter
runs it (``DecoderStep``, the carry of ``CausalLMPrefix``), and times, best of ``--rounds``, with
one torch thread, the eager and the compiled call alternating within each round:

- ``forward``: the layer without grad (a recompute-mode forward stage);
- ``forward_backward``: the layer with grad, then backward from a fixed output gradient (a
  backward stage's recompute and back-propagation);

each eager (``functional_call``, what the workers run by default) and through the engine's compiled
call (``engine/compiled_layers.py``, inductor's CPU code). ``compile_s`` is the first call of each
compiled mode (compile plus one run), in this process's inductor cache state: a fresh cache
(``TORCHINDUCTOR_CACHE_DIR`` pointing to an empty folder) gives the cold figure. The ratio is what
fusing element-wise chains buys on a CPU; the GPU's is priced in the cost model.
"""

from __future__ import annotations

import os
import time

import torch
from torch.func import functional_call

from benchmarks.harness import cli, load_line, markdown_table, run_info, write_json

FULL = dict(hidden=256, intermediate=688, heads=4, seq=256)
QUICK = dict(hidden=64, intermediate=172, heads=2, seq=64)


def decoder_layer(hidden: int, intermediate: int, heads: int, seq: int, attn: str = "sdpa"):
    """(the DecoderStep of a one-layer Llama, its parameters, the carry it receives)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_roundpipe.adapters.hf_causal_lm import CausalLMLayers

    config = AutoConfig.for_model("llama", vocab_size=128, hidden_size=hidden, intermediate_size=intermediate,
                                  num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads,
                                  max_position_embeddings=seq, attention_dropout=0.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    layers = CausalLMLayers.from_model(model).layers
    ids = torch.randint(0, 128, (1, seq))
    with torch.no_grad():
        carry = layers[0]({"input_ids": ids})
    step = layers[1]
    params = {k: v.detach().clone().requires_grad_() for k, v in step.named_parameters()}
    return step, params, carry


def modes(step, params, carry, call) -> dict:
    """The two timed modes of the layer through ``call``."""
    grad_out = torch.randn_like(carry["hidden"])

    def forward():
        with torch.no_grad():
            call(step, params, carry)

    def forward_backward():
        hidden = carry["hidden"].detach().requires_grad_()
        out = call(step, params, dict(carry, hidden=hidden))
        out["hidden"].backward(grad_out)

    return {"forward": forward, "forward_backward": forward_backward}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timings(step, params, carry, calls: dict, rounds: int) -> dict:
    """Per call and mode: the first call's seconds and the best of ``rounds``. The calls alternate
    within each round, so that a loaded machine slows them alike."""
    fns = {name: modes(step, params, carry, call) for name, call in calls.items()}
    out = {name: {} for name in calls}
    for name, by_mode in fns.items():
        for mode, fn in by_mode.items():
            out[name][f"{mode}_first_s"] = timed(fn)
            fn()  # one more untimed call: the first touch of the memory
    for _ in range(rounds):
        for mode in ("forward", "forward_backward"):
            for name, by_mode in fns.items():
                key = f"{mode}_s"
                out[name][key] = min(out[name].get(key, float("inf")), timed(by_mode[mode]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = cli(__doc__.splitlines()[0], quick="a smaller layer (width 64, 64 tokens)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"),
                        help="the attention implementation (eager: the matmul-softmax-matmul chain inductor can fuse)")
    args = parser.parse_args(argv)
    from lightning_roundpipe.engine.compiled_layers import COMPILED_LAYERS

    torch.set_num_threads(1)
    shape = QUICK if args.quick else FULL
    load, started = os.getloadavg(), time.perf_counter()
    step, params, carry = decoder_layer(**shape, attn=args.attn)
    t = timings(step, params, carry, {"eager": lambda s, p, c: functional_call(s, p, (c,)),
                                      "compiled": COMPILED_LAYERS.call}, args.rounds)
    eager, compiled = t["eager"], t["compiled"]
    rows = [{"mode": mode, "eager_ms": eager[f"{mode}_s"] * 1e3, "compiled_ms": compiled[f"{mode}_s"] * 1e3,
             "speedup": eager[f"{mode}_s"] / compiled[f"{mode}_s"], "compile_s": compiled[f"{mode}_first_s"]}
            for mode in ("forward", "forward_backward")]
    info = run_info(load, started)
    print(f"Llama decoder layer ({args.attn} attention), hidden {shape['hidden']}, {shape['seq']} tokens, 1 thread, "
          f"torch {torch.__version__}")
    print(markdown_table(rows, [("mode", "mode", "{}"), ("eager_ms", "eager ms", "{:.2f}"),
                                ("compiled_ms", "compiled ms", "{:.2f}"), ("speedup", "eager / compiled", "{:.2f}"),
                                ("compile_s", "first compiled call s", "{:.1f}")]))
    print(load_line(info))
    if args.json:
        write_json(args.json, {"shape": shape, "attn": args.attn, "rounds": args.rounds, "rows": rows, "run": info})


if __name__ == "__main__":
    main()

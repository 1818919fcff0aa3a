"""Kernel launches and host issue time per training step, for Qwen3-8B-shaped decoder layers.

Every ATen operation a stage runs is one kernel launch on CUDA (views and other aliasing ops
launch nothing and are not counted). The count does not depend on the layer's width, so it is
taken on Qwen3-8B's structure (36 decoder layers, GQA 32:8 heads, SwiGLU MLP, q/k RMSNorm)
scaled down in width (hidden 32, 4:1 heads, head_dim 8, vocab 1024): same operations, no
compute worth the name. Counted with a ``TorchDispatchMode`` on one layer:

- forward stage (no grad): what the forward pass launches per layer per microbatch;
- backward stage: the recompute (forward with grad) plus autograd's backward, per layer per microbatch.

Host issue time: one pipelined training step of the scaled model on the fake-stream backend
(the CUDA protocol with CPU "streams"), 1 worker, ``--microbatches`` microbatches of
``--tokens`` tokens. At this width the kernels cost nothing, so the step's wall time is the
host's cost of issuing them (Python, autograd, the dispatcher, the pipeline's own bookkeeping);
divided by the counted launches it gives host seconds per launch. A real CUDA launch adds the
driver's ``cudaLaunchKernel`` (``--launch-overhead-us``, default 4 us) on top.

Launch-bound point: a worker keeps its GPU busy only while the GPU time of a stage exceeds the
host time to issue it. Per layer and microbatch of T tokens the GPU does about
``4 x 2 x P_layer x T`` FLOPs (forward, recompute, backward = 2x forward), at ``--tflops``
(the hardware profiles in src/lightning_roundpipe/cost/profiles). All workers of one process share one GIL,
so with W workers the host must issue W stages in the time of one:
``T_bound = W x launches x t_issue x tflops / (8 x P_layer)``.

    python -m benchmarks.calibration.launch_budget --json launch_budget.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.harness import cli, write_json

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936)
SCALED = dict(hidden_size=32, intermediate_size=96, num_hidden_layers=36, num_attention_heads=4,
              num_key_value_heads=1, head_dim=8, vocab_size=1024)


class LaunchCounter(TorchDispatchMode):
    """Counts ATen calls that write new memory (kernels); aliasing ops (views) are free on CUDA."""

    def __init__(self):
        super().__init__()
        self.kernels = 0
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        aliasing = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        if aliasing:
            self.views += 1
        else:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def layer_params(cfg: dict) -> int:
    h, i, q, kv, d = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                      cfg["num_key_value_heads"], cfg["head_dim"])
    return h * q * d + 2 * h * kv * d + q * d * h + 3 * h * i


def count_layer(model, tokens: int) -> tuple[int, int]:
    """(forward launches, recompute+backward launches) of one decoder layer on one microbatch."""
    layer = model.model.layers[0]
    rotary = model.model.rotary_emb
    h = model.config.hidden_size
    x = torch.randn(1, tokens, h)
    pos = torch.arange(tokens)[None]
    cos, sin = rotary(x, pos)
    with torch.no_grad(), LaunchCounter() as fwd:
        layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos)
    xg = x.clone().requires_grad_(True)
    with LaunchCounter() as bwd:
        out = layer(xg, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
    return fwd.kernels, bwd.kernels


def host_step_seconds(model, microbatches: int, tokens: int, steps: int) -> float:
    from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
    import roundpipe_lab  # noqa: F401  (registers the lab's fake_cuda backend, chosen by name below)

    rt = RoundPipeRuntime.attach(model, "fake_cuda", 1, RuntimeOptions(microbatches=microbatches, step_metrics=False))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (microbatches, tokens), generator=g)
    times = []
    try:
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    finally:
        rt.detach()
    return min(times[1:])


def main(argv=None) -> dict:
    ap = cli(__doc__.split("\n")[0])
    ap.add_argument("--microbatches", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=16, help="tokens per microbatch in the host-time run")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--workers", type=int, default=8, help="workers sharing one host process")
    ap.add_argument("--tflops", type=float, default=99.0, help="effective device TFLOP/s (see the hardware profiles)")
    ap.add_argument("--launch-overhead-us", type=float, default=4.0, help="driver cost of one CUDA launch")
    args = ap.parse_args(argv)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(attn_implementation="sdpa", tie_word_embeddings=False, **SCALED))
    fwd, bwd = count_layer(model, args.tokens)
    layers = SCALED["num_hidden_layers"]
    per_step = (fwd + bwd) * layers * args.microbatches
    step_s = host_step_seconds(model, args.microbatches, args.tokens, args.steps)
    t_issue = step_s / per_step + args.launch_overhead_us * 1e-6
    p_layer = layer_params(QWEN3_8B)
    per_layer_mb = fwd + bwd
    # GPU seconds per layer per microbatch of T tokens: 8 * P * T / flops; host: launches * t_issue.
    bound_tokens_one = per_layer_mb * t_issue * args.tflops * 1e12 / (8 * p_layer)
    result = dict(
        shapes="Qwen3-8B structure (36 layers, GQA 4:1, SwiGLU, q/k norm), width scaled to hidden 32",
        launches_forward_per_layer_mb=fwd,
        launches_backward_per_layer_mb=bwd,
        launches_per_step=per_step,
        microbatches=args.microbatches,
        host_step_s_fake_streams=step_s,
        host_s_per_launch_measured=step_s / per_step,
        host_s_per_launch_with_driver=t_issue,
        host_issue_s_per_step_cuda_estimate=per_step * t_issue,
        qwen3_8b_params_per_layer=p_layer,
        tflops=args.tflops,
        launch_bound_below_tokens_per_microbatch_one_worker=bound_tokens_one,
        launch_bound_below_tokens_per_microbatch_all_workers=bound_tokens_one * args.workers,
        workers=args.workers,
    )
    for k, v in result.items():
        print(f"{k:55s} {v:.4g}" if isinstance(v, float) else f"{k:55s} {v}")
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()

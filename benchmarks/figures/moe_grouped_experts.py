"""One MoE experts layer on the CPU: HF's per-expert loop vs transformers' grouped_mm vs ``moe_experts="grouped"`` / ``"padded_bmm"``.

    python -m benchmarks.figures.moe_grouped_experts [--tokens 2048] [--experts 16] [--top-k 2] [--hidden 256]
                                             [--intermediate 512] [--repeats 7] [--threads 1] [--json PATH]

A Qwen3-MoE experts module of the given shape (fp32), a top-k routing from random router
logits, and forward + backward of: HF's eager loop (``experts_implementation="eager"``),
transformers 5's own ``grouped_mm`` path (its default), and this project's grouped forward
with its kernels (``grouped_mm``; ``bmm``, the capacity = tokens fallback; ``padded_bmm``, the
``moe_experts="padded_bmm"`` path: capacity the busiest expert's count). The runs alternate in one
process, so load on the machine hits them alike; the median of ``--repeats`` is printed with
each time over the loop's, and the output and gradient differences against the loop.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from benchmarks.harness import cli, write_json
from lightning_roundpipe.adapters.grouped_experts import gate_of, grouped_experts_forward


def experts_layer(args) -> Qwen3MoeExperts:
    config = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
                            num_experts=args.experts, num_experts_per_tok=args.top_k)
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, args.hidden ** -0.5)
        experts.down_proj.normal_(0.0, args.intermediate ** -0.5)
    return experts


def routing(args):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(args.tokens, args.hidden, generator=g)
    probs = torch.softmax(torch.randn(args.tokens, args.experts, generator=g), dim=-1)
    weights, index = torch.topk(probs, args.top_k, dim=-1)
    return hidden, index, weights / weights.sum(-1, keepdim=True)


def runners(experts):
    gate = gate_of(experts)

    def hf(implementation):
        def run(h, i, w):
            experts.config._experts_implementation = implementation
            return experts(h, i, w)
        return run

    return {"hf_loop": hf("eager"), "hf_grouped_mm": hf("grouped_mm"),
            "grouped": lambda h, i, w: grouped_experts_forward(experts, h, i, w, gate, "grouped_mm"),
            "grouped_bmm": lambda h, i, w: grouped_experts_forward(experts, h, i, w, gate, "bmm"),
            "padded_bmm": lambda h, i, w: grouped_experts_forward(experts, h, i, w, gate, "padded_bmm")}


def step(experts, run, hidden, index, weights):
    """Seconds of one forward + backward, and (output, input grad, weight grads)."""
    h = hidden.clone().requires_grad_(True)
    experts.zero_grad(set_to_none=True)
    start = time.perf_counter()
    out = run(h, index, weights)
    out.square().sum().backward()
    seconds = time.perf_counter() - start
    return seconds, (out.detach(), h.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone())


def main(argv=None) -> dict:
    parser = cli(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    experts = experts_layer(args)
    hidden, index, weights = routing(args)
    paths = runners(experts)
    times = {name: [] for name in paths}
    results = {}
    for repeat in range(args.repeats + 1):  # the first round warms up, untimed
        for name, run in paths.items():
            seconds, results[name] = step(experts, run, hidden, index, weights)
            if repeat:
                times[name].append(seconds)
    reference = results["hf_loop"]
    rows = []
    loop = statistics.median(times["hf_loop"])
    print(f"one experts layer, fp32 CPU ({args.threads} thread): {args.tokens} tokens, {args.experts} experts, "
          f"top-{args.top_k}, hidden {args.hidden}, intermediate {args.intermediate}; forward + backward, "
          f"median of {args.repeats}")
    print(f"{'path':<14} {'ms':>9} {'/ hf_loop':>10} {'out rel':>9} {'grad rel':>9}")
    for name in paths:
        median = statistics.median(times[name])
        out_rel = ((results[name][0] - reference[0]).norm() / reference[0].norm()).item()
        grad_rel = max(((a - b).norm() / b.norm()).item() for a, b in zip(results[name][1:], reference[1:]))
        rows.append({"path": name, "ms": median * 1e3, "over_hf_loop": median / loop, "output_rel": out_rel,
                     "grad_rel": grad_rel})
        print(f"{name:<14} {median * 1e3:9.2f} {median / loop:10.3f} {out_rel:9.1e} {grad_rel:9.1e}")
    report = {"shape": vars(args), "rows": rows}
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()

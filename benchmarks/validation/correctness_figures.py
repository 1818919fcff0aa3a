"""Issue-2/3 figures: parity against Lightning's single-device run, peak resident weights,
causal-LM loss/gradient parity per architecture, last-stage memory with the chunked loss.

    python -m benchmarks.validation.correctness_figures [--json out.json]

Run from the repository root (it reuses the test suite's small modules in ``tests/``).
"""

from __future__ import annotations

import sys
import warnings

import torch

warnings.filterwarnings("ignore")

from benchmarks.harness import cli, write_json  # noqa: E402
from tests._models import SeqModule, fit, grad_error, weight_error, weights  # noqa: E402
from lightning_roundpipe import RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions  # noqa: E402

CASES = [
    (1, 1, "always", {}, {}), (2, 2, "always", {}, {}), (3, 4, "always", {}, {}), (2, 4, "never", {}, {}),
    (2, 2, "always", {}, {"accumulate_grad_batches": 2}), (2, 2, "always", {}, {"gradient_clip_val": 0.05}),
    (2, 2, "always", {"scheduler": True}, {}), (2, 2, "always", {"frozen": True}, {}),
    (2, 2, "always", {"tied": True}, {}),
]


def parity() -> dict:
    worst_g, worst_w, rows = 0.0, 0.0, []
    for opt in ("sgd", "adamw"):
        for workers, mb, rec, mkw, tkw in CASES:
            mkw = dict(mkw, opt=opt)
            ref = SeqModule(**mkw)
            w0 = weights(ref)
            _, g_ref = fit(ref, "auto", **tkw)
            m = SeqModule(**mkw)
            _, g = fit(m, RoundPipeStrategy(microbatches=mb, recompute=rec), devices=workers, **tkw)
            ge, we = grad_error(g, g_ref), weight_error(weights(m), weights(ref), w0)
            worst_g, worst_w = max(worst_g, ge), max(worst_w, we)
            rows.append({"opt": opt, "workers": workers, "microbatches": mb, "recompute": rec, **mkw, **tkw,
                         "grad_err": ge, "weight_err": we})
    return {"worst_grad_err": worst_g, "worst_weight_err": worst_w, "configs": len(rows), "rows": rows}


def peak_weights() -> dict:
    from torch import nn

    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(12)])
    model_bytes = sum(p.numel() * p.element_size() for p in layers.parameters())
    rt = RoundPipeRuntime.attach(layers, "cpu", 3, RuntimeOptions(microbatches=4))
    try:
        for _ in range(2):
            layers(torch.randn(16, 256)).pow(2).mean().backward()
        peaks = rt.peak_weight_bytes()
        plan = rt.engine.plan.to_text()
    finally:
        rt.detach()
    return {"model_bytes": model_bytes, "peak_bytes_per_worker": peaks, "plan": plan, "workers": 3}


def hf_parity() -> dict:
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    archs = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**common)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**common)),
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common)),
        "mistral": lambda: MistralForCausalLM(MistralConfig(**common)),
    }
    out = {}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (6, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    mask[4, 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :4] = -100
    for name, make in archs.items():
        torch.manual_seed(0)
        model = make()
        ref = model(input_ids=ids, attention_mask=mask, labels=labels)
        ref.loss.backward()
        g_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        worst_loss, worst_grad = 0.0, 0.0
        for m in (1, 2, 3):
            rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=m))
            try:
                out_ = model(input_ids=ids, attention_mask=mask, labels=labels)
                out_.loss.backward()
            finally:
                rt.detach()
            worst_loss = max(worst_loss, abs(out_.loss.item() / ref.loss.item() - 1))
            worst_grad = max(worst_grad, max(((p.grad - g_ref[n]).norm() / g_ref[n].norm()).item()
                                             for n, p in model.named_parameters()))
            model.zero_grad(set_to_none=True)
        out[name] = {"loss_rel_err": worst_loss, "grad_rel_err": worst_grad}
    return out


_MEMORY_PROBE = """
import resource, sys, torch
from lightning_roundpipe.adapters.chunked_loss import chunked_lm_head_loss, plain_lm_head_loss
seq, vocab, hidden, chunk, kind = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
h = torch.randn(seq, hidden, requires_grad=True)
w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()
y = torch.randint(0, vocab, (seq,))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
loss = plain_lm_head_loss(h, w, y) if kind == "full" else chunked_lm_head_loss(h, w, y, chunk_size=chunk)
loss.backward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def last_stage_memory(seq_len: int = 4096, vocab: int = 32000, hidden: int = 256, chunk: int = 256) -> dict:
    """Peak RSS growth (fresh process each) of the LM head + loss of one microbatch, forward and backward.

    What the call adds to the process's peak is what the loss needs at its largest: the logits
    and their gradient for the full version, one chunk's (plus the fp32 weight gradient) for the
    chunked one.
    """
    import subprocess

    out = {}
    for kind in ("full", "chunked"):
        r = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(seq_len), str(vocab), str(hidden), str(chunk), kind],
                           capture_output=True, text=True, check=True)
        out["full logits" if kind == "full" else f"chunked ({chunk} rows)"] = int(r.stdout.strip().splitlines()[-1]) * 1024
    return {"seq_len": seq_len, "vocab": vocab, "hidden": hidden, "chunk": chunk,
            "logits_bytes": seq_len * vocab * 4, "peak_bytes": out}


def main(argv=None):
    ap = cli(__doc__.split("\n")[0])
    args = ap.parse_args(argv)
    res = {"parity": parity(), "peak": peak_weights(), "hf": hf_parity(), "loss_memory": last_stage_memory()}
    p = res["parity"]
    print(f"parity over {p['configs']} configurations: worst gradient ||g-g_ref||/||g_ref|| = {p['worst_grad_err']:.2e}, "
          f"worst weight ||w-w_ref||/||w_ref-w_init|| = {p['worst_weight_err']:.2e}")
    k = res["peak"]
    print(f"peak resident weight bytes per worker ({k['workers']} workers, plan {k['plan']}): "
          f"{k['peak_bytes_per_worker']} of a {k['model_bytes']}-byte model")
    for name, r in res["hf"].items():
        print(f"{name}: loss rel err {r['loss_rel_err']:.1e}, worst grad rel err {r['grad_rel_err']:.1e} (1-3 microbatches)")
    m = res["loss_memory"]
    print(f"last-stage loss memory, seq {m['seq_len']} x vocab {m['vocab']}: " +
          ", ".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in m["peak_bytes"].items()))
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()

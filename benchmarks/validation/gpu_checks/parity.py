"""Parity: fp32 against the CPU backend, tiny Qwen3 in bf16, dropout masks in recompute, jitter."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .context import TINY_QWEN3, Ctx, relative


def _mlp(width: int, depth: int, dropout: float = 0.0, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh(), *( [nn.Dropout(dropout)] if dropout else []))
              for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width, 8))


def _train_mlp(backend: str, ctx: Ctx, workers: int, steps: int, width: int):
    """First-step gradients and final weights of an fp32 MLP trained with SGD over ``backend``."""
    from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions

    net = _mlp(width, 6)
    indices = ctx.indices(workers) if backend == "cuda" else None
    runtime = RoundPipeRuntime.attach(net, backend, workers, RuntimeOptions(microbatches=4), device_indices=indices)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    first = None
    try:
        for step in range(steps):
            x, y = torch.randn(8, width, generator=g), torch.randn(8, 8, generator=g)
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(net(x), y).backward()
            if step == 0:
                first = [p.grad.detach().clone() for p in net.parameters()]
            opt.step()
            runtime.after_optimizer_step()
        return first, [p.detach().clone() for p in net.parameters()]
    finally:
        runtime.detach()


def check_parity_fp32(ctx: Ctx) -> tuple[str, str, dict]:
    width, steps = (256 if ctx.cuda else 16), 3
    init = [p.detach().clone() for p in _mlp(width, 6).parameters()]
    details, ok = {}, True
    for workers in sorted({1, ctx.gpus}):
        g_ref, w_ref = _train_mlp("cpu", ctx, workers, steps, width)
        g, w = _train_mlp(ctx.backend, ctx, workers, steps, width)
        grad_err = max(relative(a, b) for a, b in zip(g, g_ref))
        weight_err = max(relative(a - i, b - i) for a, b, i in zip(w, w_ref, init))
        details[f"{workers}_workers"] = dict(worst_grad_rel_error=grad_err, worst_update_rel_error=weight_err)
        ok = ok and grad_err <= 1e-5 and weight_err <= 1e-4
    summary = "; ".join(f"{k}: grads {v['worst_grad_rel_error']:.1e}, weights {v['worst_update_rel_error']:.1e}"
                        for k, v in details.items())
    return ("pass" if ok else "fail"), summary + " (bounds 1e-5, 1e-4)", details


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(attn_implementation="sdpa", tie_word_embeddings=False, **TINY_QWEN3))


def _qwen3_steps(model, ctx: Ctx, steps: int, device: torch.device, pipelined: bool) -> list[float]:
    """Losses of ``steps`` AdamW steps on ``model`` (pipelined: inputs on the host, optimizer overlapped)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runtime = None
    if pipelined:
        runtime = ctx.runtime(model, max(2, ctx.gpus), microbatches=2, compute_dtype=torch.bfloat16)
        runtime.overlap_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    losses = []
    try:
        for _ in range(steps):
            ids = torch.randint(0, TINY_QWEN3["vocab_size"], (4, 32), generator=g)
            ids = ids if pipelined else ids.to(device)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(ctx.device_type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if runtime is not None:
            runtime.join()
        return losses
    finally:
        if runtime is not None:
            runtime.detach()


def check_parity_bf16_qwen3(ctx: Ctx) -> tuple[str, str, dict]:
    steps = 5
    ref_model = tiny_qwen3().to(ctx.device)
    init = {n: p.detach().float().cpu().clone() for n, p in ref_model.named_parameters()}
    ref_losses = _qwen3_steps(ref_model, ctx, steps, ctx.device, pipelined=False)
    ref = {n: p.detach().float().cpu() for n, p in ref_model.named_parameters()}
    model = tiny_qwen3()
    losses = _qwen3_steps(model, ctx, steps, ctx.device, pipelined=True)
    got = {n: p.detach().float() for n, p in model.named_parameters()}
    loss_err = max(abs(a / b - 1) for a, b in zip(losses, ref_losses))
    worst = max(relative(got[n] - init[n], ref[n] - init[n]) for n in ref)
    # All parameters as one vector: Adam divides by tiny second moments, so a tensor whose gradients
    # are near 0 (a norm's weight) can differ a lot in relative terms while the model does not.
    update_err = relative(torch.cat([(got[n] - init[n]).flatten() for n in ref]),
                          torch.cat([(ref[n] - init[n]).flatten() for n in ref]))
    # bf16: an 8-bit mantissa, and the pipeline casts norms to bf16 where autocast keeps them fp32
    ok = loss_err <= 2e-2 and update_err <= 1e-1
    return ("pass" if ok else "fail"), (f"{steps} overlapped steps: worst loss {loss_err:.1e}, update {update_err:.1e} "
                                        f"(bounds 2e-2, 1e-1; worst tensor {worst:.1e})"), dict(
        losses=losses, reference_losses=ref_losses, worst_loss_rel_error=loss_err, update_rel_error=update_err,
        worst_tensor_update_rel_error=worst)


@contextlib.contextmanager
def reference_seed(device: torch.device, seed: int):
    """The plain layer's call with the generator the engine seeds for it (one thread here, so
    torch's own fork_rng puts the generator back afterwards)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if device.type == "cuda":
            torch.cuda.default_generators[device.index or 0].manual_seed(seed)
        else:
            torch.manual_seed(seed)
        yield


def _dropout_case(ctx: Ctx, workers: int, shared: bool) -> dict:
    from lightning_roundpipe import EngineOptions, PipelineEngine, Plan
    from lightning_roundpipe.engine import layer_seed
    from lightning_roundpipe.workers import make_pool

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.5)) for _ in range(4)]
    x, y = torch.randn(6, 32), torch.randn(6, 32)
    plan = Plan(4, [(0, 3), (3, 4)], [(0, 1), (1, 2), (2, 4)])  # backward cut unlike forward
    pool = make_pool(ctx.backend, workers, device_indices=ctx.indices(workers, shared))
    eng = PipelineEngine(layers, pool, plan, EngineOptions(microbatches=3))
    try:
        torch.manual_seed(123)
        out = eng(x)
        ((out - y) ** 2).sum().backward()
        grads = [p.grad.clone() for l in layers for p in l.parameters()]
    finally:
        eng.close()
    torch.manual_seed(123)
    base = int(torch.randint(0, 2**62, ()).item())
    outs = []
    for i, xb in enumerate(torch.tensor_split(x, 3)):
        h = xb.to(ctx.device)
        for k, layer in enumerate(layers):
            layer.zero_grad(set_to_none=True)
            layer.to(h.device)
            with reference_seed(h.device, layer_seed(base, k, i)):
                h = layer(h)
        outs.append(h)
    # The reference runs on one device; on a GPU a mask depends only on the seed and the shape.
    ref_out = torch.cat([o.cpu() for o in outs])
    ((ref_out - y) ** 2).sum().backward()
    ref = [p.grad.cpu() for l in layers for p in l.parameters()]
    for l in layers:
        l.to("cpu")
    out_err = (out.detach() - ref_out.detach()).abs().max().item()
    grad_err = max(relative(g, r) for g, r in zip(grads, ref))
    dropped = (ref_out == 0).float().mean().item()
    return dict(workers=workers, shared_gpu=shared, output_max_abs_error=out_err, worst_grad_rel_error=grad_err,
                dropped_fraction=dropped, ok=out_err <= 1e-5 and grad_err <= 1e-5 and dropped > 0.2)


def check_dropout_recompute(ctx: Ctx) -> tuple[str, str, dict]:
    cases = {"distinct": _dropout_case(ctx, max(2, ctx.gpus), shared=False) if ctx.gpus > 1 or not ctx.cuda else None,
             "shared": _dropout_case(ctx, 3, shared=True)}
    details = {k: v for k, v in cases.items() if v is not None}
    ok = all(v["ok"] for v in details.values())
    summary = "; ".join(f"{k}: grads {v['worst_grad_rel_error']:.1e}, dropped {v['dropped_fraction']:.2f}"
                        for k, v in details.items())
    if "distinct" not in details:
        summary += " (one GPU: no distinct-GPU case)"
    return ("pass" if ok else "fail"), summary, details


def _race_train(ctx: Ctx, workers: int, shared: bool, staleness: int, jitter_s: float, steps: int):
    width = 256 if ctx.cuda else 16
    net = _mlp(width, 6, dropout=0.1)
    runtime = ctx.runtime(net, workers, shared, microbatches=4, seed=5, staleness=staleness)
    if jitter_s:
        ctx.jitter(runtime, jitter_s)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    runtime.overlap_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    try:
        torch.manual_seed(3)
        for _ in range(steps):
            # Host tensors: the pipeline's outputs come home, so the loss is computed on the host.
            x, y = torch.randn(8, width, generator=g), torch.randn(8, 8, generator=g)

            def closure():
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(net(x).float(), y)
                loss.backward()
                return loss

            opt.step(closure)
        runtime.join()
        return [p.detach().clone() for p in net.parameters()]
    finally:
        runtime.detach()


def check_jitter_bit_identical(ctx: Ctx) -> tuple[str, str, dict]:
    steps = 3
    details, ok = {}, True
    layouts = [("shared", 3, True)] + ([("distinct", ctx.gpus, False)] if ctx.gpus > 1 or not ctx.cuda else [])
    for name, workers, shared in layouts:
        for staleness in (0, 1):
            calm = _race_train(ctx, workers, shared, staleness, 0.0, steps)
            amplified = _race_train(ctx, workers, shared, staleness, 0.002, steps)
            same = all(torch.equal(a, b) for a, b in zip(calm, amplified))
            details[f"{name}_staleness_{staleness}"] = dict(
                workers=workers, bit_identical=same,
                max_abs_diff=max((a - b).abs().max().item() for a, b in zip(calm, amplified)))
            ok = ok and same
    return ("pass" if ok else "fail"), ", ".join(f"{k} {'same' if v['bit_identical'] else 'DIFFERENT'}"
                                                for k, v in details.items()), details

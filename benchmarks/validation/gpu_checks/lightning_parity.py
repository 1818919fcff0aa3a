"""The Lightning strategy against Lightning's default strategy on the same device: fp32 with three workers
sharing one GPU, bf16-mixed tiny Qwen3 over 5 AdamW steps, and jittered runs bit-identical to calm ones."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .context import TINY_QWEN3, Ctx, relative
from .parity import check_jitter_bit_identical, tiny_qwen3

GRAD_TOL, WEIGHT_TOL = 1e-5, 1e-4  # DESIGN.md's exactness bounds (fp32)
# bf16-mixed: both runs compute in bf16 (8-bit mantissa) and sum in another order; bounds as gpu_validate's
BF16_LOSS_TOL, BF16_UPDATE_TOL = 2e-2, 1e-1


def roundpipe_strategy(ctx: Ctx, workers: int, **options):
    """``RoundPipeStrategy`` with ``workers`` workers sharing device 0: CUDA workers on the GPU, or on the fake
    driver (the CUDA backend's protocol on CPU threads; Lightning then runs on the CPU accelerator)."""
    from lightning_roundpipe import RoundPipeStrategy

    if ctx.compile_layers is not None:
        options.setdefault("compile_layers", ctx.compile_layers)
    if ctx.cuda:
        return RoundPipeStrategy(parallel_devices=[torch.device("cuda", 0)] * workers, **options)

    class FakeCudaStrategy(RoundPipeStrategy):
        """The strategy on the fake CUDA driver (a stand-in for this script's CI run only)."""

        def _backend(self):
            return ctx.backend, None  # "fake_cuda", the lab's (registered by asking the context for it)

    return FakeCudaStrategy(parallel_devices=[torch.device("cpu")] * workers, **options)


def trainer(ctx: Ctx, strategy, steps: int, precision: str) -> L.Trainer:
    """Lightning's default strategy on one device of ``ctx``, or ``strategy`` (its devices its own)."""
    kwargs = dict(devices=1) if strategy == "auto" else {}
    return L.Trainer(strategy=strategy, accelerator="gpu" if ctx.cuda else "cpu", max_steps=steps, precision=precision, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


class MlpModule(L.LightningModule):
    """An fp32 MLP (6 tanh blocks and a head) with SGD; keeps its first step's gradients."""

    def __init__(self, width: int):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(6)],
                                 nn.Linear(width, 8))
        self.first_grads: list[torch.Tensor] | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y.to(self.device))

    def on_after_backward(self):
        if self.first_grads is None:
            self.first_grads = [p.grad.detach().float().cpu().clone() for p in self.net.parameters()]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Qwen3Module(L.LightningModule):
    """A tiny Qwen3 with AdamW; records the loss of each step."""

    def __init__(self):
        super().__init__()
        self.model = tiny_qwen3()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def weights_of(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().cpu().clone() for p in module.parameters()]


def fp32_three_workers(ctx: Ctx) -> dict:
    width, steps = (256 if ctx.cuda else 16), 3
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(8 * steps, width, generator=g), torch.randn(8 * steps, 8, generator=g))
    runs = {}
    for name, strategy in (("default", "auto"), ("roundpipe", roundpipe_strategy(ctx, 3, microbatches=4))):
        module = MlpModule(width)
        init = weights_of(module)
        trainer(ctx, strategy, steps, "32-true").fit(module, DataLoader(data, batch_size=8))
        runs[name] = (module.first_grads, weights_of(module))
    (g_ref, w_ref), (g, w) = runs["default"], runs["roundpipe"]
    grad_err = max(relative(a, b) for a, b in zip(g, g_ref))
    weight_err = max(relative(a - i, b - i) for a, b, i in zip(w, w_ref, init))
    return dict(workers=3, shared_gpu=True, steps=steps, worst_grad_rel_error=grad_err,
                worst_update_rel_error=weight_err, ok=grad_err <= GRAD_TOL and weight_err <= WEIGHT_TOL)


def bf16_qwen3(ctx: Ctx) -> dict:
    steps = 5
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randint(0, TINY_QWEN3["vocab_size"], (4 * steps, 32), generator=g))
    runs = {}
    for name, strategy in (("default", "auto"), ("roundpipe", roundpipe_strategy(ctx, 2, microbatches=2))):
        module = Qwen3Module()
        init = weights_of(module)
        trainer(ctx, strategy, steps, "bf16-mixed").fit(module, DataLoader(data, batch_size=4))
        runs[name] = (module.losses, weights_of(module))
    (ref_losses, w_ref), (losses, w) = runs["default"], runs["roundpipe"]
    loss_errors = [abs(a / b - 1) for a, b in zip(losses, ref_losses)]
    update_err = relative(torch.cat([(a - i).flatten() for a, i in zip(w, init)]),
                          torch.cat([(b - i).flatten() for b, i in zip(w_ref, init)]))
    return dict(steps=steps, losses=losses, reference_losses=ref_losses, loss_rel_errors=loss_errors,
                update_rel_error=update_err,
                ok=len(losses) == steps and max(loss_errors) <= BF16_LOSS_TOL and update_err <= BF16_UPDATE_TOL)


def check_lightning_parity(ctx: Ctx) -> tuple[str, str, dict]:
    fp32, bf16 = fp32_three_workers(ctx), bf16_qwen3(ctx)
    jitter_verdict, jitter_summary, jitter = check_jitter_bit_identical(ctx)
    ok = fp32["ok"] and bf16["ok"] and jitter_verdict == "pass"
    summary = (f"fp32 x3 shared: grads {fp32['worst_grad_rel_error']:.1e}, weights {fp32['worst_update_rel_error']:.1e} "
               f"(bounds {GRAD_TOL:g}, {WEIGHT_TOL:g}); bf16 qwen3: worst loss {max(bf16['loss_rel_errors']):.1e}, "
               f"update {bf16['update_rel_error']:.1e} (bounds {BF16_LOSS_TOL:g}, {BF16_UPDATE_TOL:g}); "
               f"jitter: {jitter_summary}")
    return ("pass" if ok else "fail"), summary, dict(fp32_three_workers=fp32, bf16_qwen3=bf16, jitter=jitter)

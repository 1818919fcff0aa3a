"""CUDA backend: parity with the single-device run on 1 and 2 GPUs. Skipped without CUDA."""

import pytest
import torch

from _models import SeqModule, fit, grad_error, weight_error, weights
from lightning_roundpipe import RoundPipeStrategy



@pytest.mark.gpu
@pytest.mark.parametrize("gpus", [1, 2])
def test_cuda_parity_with_single_device(gpus):
    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        pytest.skip(f"needs CUDA with {gpus} GPU(s)")
    import lightning as L
    from torch.utils.data import DataLoader

    from _models import GradRecorder, make_data

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref = SeqModule(opt="adamw")
    w0 = weights(ref)
    _, g_ref = fit(ref, "auto", gradient_clip_val=0.05)  # CPU reference
    m = SeqModule(opt="adamw")
    rec = GradRecorder()
    trainer = L.Trainer(strategy=RoundPipeStrategy(microbatches=3), accelerator="gpu", devices=gpus, max_steps=5,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[rec], gradient_clip_val=0.05)
    trainer.fit(m, DataLoader(make_data(), batch_size=8))
    assert all(p.device.type == "cpu" for p in m.parameters())  # state stays on the host
    assert grad_error(rec.first, g_ref) <= 1e-5
    assert weight_error(weights(m), weights(ref), w0) <= 1e-4


def test_cuda_pool_skips_cleanly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA")
    from lightning_roundpipe.workers import make_pool

    with pytest.raises(RuntimeError, match="the CUDA backend needs CUDA: use accelerator='cpu'"):
        make_pool("cuda", 1)


def train_plain_bf16(backend: str, overlap: bool):
    """Plain PyTorch, bf16 compute: the forward runs under autocast (the weights go up in bf16, the
    inputs stay fp32: without autocast the first matmul fails on mismatched dtypes)."""
    from torch import nn

    from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)], nn.Linear(64, 8))
    runtime = RoundPipeRuntime.attach(net, backend, 1, RuntimeOptions(microbatches=2, compute_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    device_type = "cuda" if backend == "cuda" else "cpu"
    if overlap:
        runtime.overlap_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            x, y = torch.randn(4, 64, generator=g), torch.randn(4, 8, generator=g)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type, dtype=torch.bfloat16):
                out = net(x)
            torch.nn.functional.mse_loss(out.float(), y).backward()
            opt.step()
            if not overlap:
                runtime.after_optimizer_step()  # the synchronous step wrote the masters: refresh the shadows
        runtime.join()
        assert all(p.device.type == "cpu" for p in net.parameters())
        return [p.detach().clone() for p in net.parameters()]
    finally:
        runtime.detach()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["cpu", "fake_cuda", "cuda"])
def test_plain_pytorch_overlapped_optimizer_with_bf16_shadows_matches_synchronous(backend):
    """bf16 compute reads shadows refreshed per layer step; the overlapped step gives the same
    weights as the synchronous one over the same runtime (the CPU and fake-stream backends run
    the very test the CUDA run will)."""
    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for a, b in zip(train_plain_bf16(backend, False), train_plain_bf16(backend, True)):
        assert torch.equal(a, b)

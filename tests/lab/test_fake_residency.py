"""The fake driver moves tensors for real, and its residency check fails a compute that reads a host
tensor no upload moved (as CUDA fails it with a device mismatch), on the engine's own code path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.workers import make_pool
from lightning_roundpipe.workers.completions import WorkerError
from roundpipe_lab.fake_cuda.streams import FakeStreams


class Scaled(nn.Module):
    """A linear layer times a scale kept as a buffer, or (``forget``) as a plain attribute the upload never moves."""

    def __init__(self, forget: bool):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        scale = torch.rand(8) + 0.5
        if forget:
            self.scale = scale
        else:
            self.register_buffer("scale", scale)

    def forward(self, x):
        return self.lin(x) * self.scale


def run(backend: str, forget: bool):
    """Gradients of one step of 4 ``Scaled`` layers on 2 workers (2 microbatches), and the pool."""
    torch.manual_seed(0)
    net = nn.Sequential(*[Scaled(forget) for _ in range(4)])
    rt = RoundPipeRuntime.attach(net, backend, 2, RuntimeOptions(microbatches=2, partition="uniform"))
    try:
        net(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
        return [p.grad.clone() for p in net.parameters()], rt.pool
    finally:
        rt.detach()


def test_to_device_makes_a_distinct_copy_and_counts_it():
    driver = FakeStreams()
    try:
        for src, dtype in [(torch.arange(6.0), torch.float32), (torch.arange(6.0), torch.bfloat16),
                           (torch.arange(6, dtype=torch.uint8), torch.uint8)]:
            out = driver.to_device(src, torch.device("cpu"), dtype)
            assert out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
            assert torch.equal(out, src.to(dtype))
        assert driver.to_device_bytes == 24 + 24 + 6  # the source bytes of each copy
    finally:
        driver.close(5.0)


@pytest.mark.timeout(60)
def test_residency_check_fails_a_forgotten_host_tensor_and_passes_the_same_model_with_a_buffer(monkeypatch):
    from roundpipe_lab.fake_cuda import pool as cuda_backend

    real = cuda_backend.FakeCudaWorkerPool.options_from
    monkeypatch.setattr(cuda_backend.FakeCudaWorkerPool, "options_from",
                        classmethod(lambda cls, o: dict(real.__func__(cls, o), check_residency=True)))
    ref, _ = run("cpu", forget=False)
    got, pool = run("fake_cuda", forget=False)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert pool.residency.checked_ops > 0
    forgotten, _ = run("cpu", forget=True)  # CPU workers read host memory in place: the defect hides there
    assert all(g.abs().sum() > 0 for g in forgotten)
    with pytest.raises(WorkerError, match=r"residency check: aten\.mul\.Tensor read a host tensor \(shape \(8,\), "
                                          r"torch\.float32\) beside worker tensors.*Register it as a buffer") as info:
        run("fake_cuda", forget=True)
    assert info.value.label.kind == "forward" and info.value.label.stage == "F0"


def test_residency_check_is_off_by_default():
    pool = make_pool("fake_cuda", 1)
    try:
        assert pool.residency is None and pool.driver.residency is None
    finally:
        pool.shutdown()

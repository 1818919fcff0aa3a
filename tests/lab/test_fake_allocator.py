"""Issue 42, item 6: the fake driver's model of CUDA's caching allocator (``roundpipe_lab/fake_cuda/allocator.py``):
one cache per allocation stream, a capacity that excludes the CUDA context and workspaces, retries and
``torch.OutOfMemoryError`` as on CUDA; and the CUDA budget that keeps a pipelined step free of retries."""

import gc

import pytest
import torch
from torch import nn

from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions, WorkerError
from lightning_roundpipe.cost.device_overheads import device_reserved_bytes
from lightning_roundpipe.workers import TaskLabel, make_pool
from lightning_roundpipe.workers.cuda import gpu_budget_bytes, usable_bytes

MiB = 2**20
AMPERE = (8, 0)


def _fake_gpu(usable_mib: float) -> int:
    """The total memory of a fake GPU whose allocator can reserve ``usable_mib`` MiB for tensors."""
    return device_reserved_bytes() + int(usable_mib * MiB)


def _allocating(mib: float, keep: list | None = None):
    """A task that allocates ``mib`` MiB on its stream (kept in ``keep``, else freed when it returns)."""
    def task():
        t = torch.empty(int(mib * MiB) // 4)
        if keep is not None:
            keep.append(t)
    return task


def _run(pool, queue: str, fn, mb: int = 0):
    pool.workers[0].submit(queue, fn, [], TaskLabel("forward" if queue == "compute" else "act_in", "F0", mb, 0,
                                                    queue)).wait(10)
    pool.synchronize(10)


def _pools(pool) -> dict:
    return {name: p.reserved for name, p in pool.allocators[0].pools.items()}


@pytest.mark.timeout(30)
def test_a_block_freed_on_the_compute_stream_is_not_reused_by_an_upload():
    """3 MiB allocated and freed by a compute task stay cached for the compute stream: an upload of 3 MiB
    reserves 3 MiB more (6 in all), a second compute task reuses the compute cache (still 6). With one
    cache for both streams (``pool.allocators[0].pool`` answering one pool for every stream) reserved stays
    at 3 MiB and the test fails there. The fake GPU's allocator has what the GPU leaves after its context,
    cuBLAS workspaces and allocator pages: 8 MiB of ``device_reserved_bytes() + 8 MiB``."""
    pool = make_pool("fake_cuda", 1, device_memory_bytes=_fake_gpu(8)).start()
    try:
        allocator = pool.allocators[0]
        assert allocator.capacity_bytes == 8 * MiB
        _run(pool, "compute", _allocating(3))
        assert _pools(pool) == {"upload": 0, "compute": 3 * MiB} and allocator.allocated == 0
        _run(pool, "upload", _allocating(3))
        assert _pools(pool) == {"upload": 3 * MiB, "compute": 3 * MiB}  # not the compute stream's free block
        _run(pool, "compute", _allocating(3), mb=1)
        assert allocator.reserved == 6 * MiB  # the compute stream's own cache
        stats = pool.device_memory_stats()[0]
        assert stats == dict(allocated_peak_bytes=3 * MiB, reserved_peak_bytes=6 * MiB, alloc_retries=0, ooms=0,
                             reserved_peak_bytes_by_pool={"upload": 3 * MiB, "compute": 3 * MiB})
    finally:
        pool.shutdown()


@pytest.mark.timeout(30)
def test_near_the_capacity_an_allocation_retries_then_runs_out_of_memory_naming_the_task():
    """8 MiB fake GPU: 3 MiB cached by the compute stream, 6 MiB asked on the upload stream fits only once
    every cache is freed (one retry, as ``num_alloc_retries``); 9 MiB then cannot fit at all: a second
    retry, then ``torch.OutOfMemoryError`` reaching the caller as a ``WorkerError`` naming the task. The
    refused allocation is not counted, and the fake GPU still allocates afterwards."""
    pool = make_pool("fake_cuda", 1, device_memory_bytes=_fake_gpu(8)).start()
    try:
        allocator = pool.allocators[0]
        _run(pool, "compute", _allocating(3))
        kept = []
        _run(pool, "upload", _allocating(6, kept))
        assert allocator.num_alloc_retries == 1
        assert _pools(pool) == {"upload": 6 * MiB, "compute": 0}  # the compute cache went back to the device
        with pytest.raises(WorkerError) as info:
            _run(pool, "compute", _allocating(3), mb=2)  # 3 MiB left after 6: one more retry fits nothing
        err = info.value
        assert isinstance(err.original, torch.OutOfMemoryError)
        msg = str(err)
        assert "OutOfMemoryError in task [forward, stage F0, microbatch 2, worker 0, compute queue]" in msg
        assert "Tried to allocate 3.00 MiB on the compute stream" in msg
        assert "8.00 MiB for tensors" in msg and "of which 2.00 MiB is free" in msg
        stats = pool.device_memory_stats()[0]
        assert (stats["alloc_retries"], stats["ooms"]) == (2, 1)
        assert allocator.allocated == 6 * MiB  # only the kept upload
        kept.clear()
        gc.collect()
        _run(pool, "compute", _allocating(3), mb=3)  # the upload's 6 MiB are cached for uploads: one more retry
        assert (allocator.num_alloc_retries, allocator.allocated, _pools(pool)) == (3, 0, {"upload": 0, "compute": 3 * MiB})
    finally:
        pool.shutdown()


def _step_retries(usable_mib: float, budget: int, steps: int = 3):
    """Train 8 Linear(256, 256) layers on 2 fake GPUs whose allocators have ``usable_mib`` MiB each, the
    runtime planning at ``budget``: per worker the allocator's stats after ``steps`` steps (4 microbatches)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    rt = RoundPipeRuntime.attach(net, "fake_cuda", 2, RuntimeOptions(
        microbatches=4, step_metrics=False, timeout=30.0, partition={"memory_budget_bytes": budget}))
    rt.pool.model_allocator(_fake_gpu(usable_mib))
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(steps):
            net.zero_grad()
            (net(torch.randn(64, 256, generator=g)) ** 2).mean().backward()
            rt.join()
        return rt.pool.device_memory_stats()
    finally:
        rt.detach()


@pytest.mark.timeout(90)
def test_a_pipelined_step_at_the_cuda_budget_makes_no_allocator_retry():
    """On fake GPUs of 2.2 MiB usable, planned at what the CUDA backend plans for that GPU (``gpu_budget_bytes``),
    three steps make no allocator retry, with the two pools' peaks adding up to 73-83% of the capacity (3 runs).
    Planned at what the memory model lets tensors fill (``usable_bytes``, the CUDA budget before the two pools
    were counted) on GPUs of 1.8 MiB, the upload pool keeps two forward stages' weights cached through the
    backward while the compute pool holds gradients: 5 retries (both workers) in 3 steps in each of 3 runs (the pools' peaks
    adding up to 103-117% of the capacity)."""
    stats = _step_retries(2.2, gpu_budget_bytes(_fake_gpu(2.2), AMPERE))
    assert [s["alloc_retries"] for s in stats] == [0, 0] and [s["ooms"] for s in stats] == [0, 0]
    assert max(sum(s["reserved_peak_bytes_by_pool"].values()) for s in stats) > 0.6 * 2.2 * MiB  # near the capacity
    one_pool_budget = _step_retries(1.8, usable_bytes(_fake_gpu(1.8), AMPERE))
    assert sum(s["alloc_retries"] for s in one_pool_budget) > 0
    assert [s["ooms"] for s in one_pool_budget] == [0, 0]


@pytest.mark.timeout(60)
def test_a_run_planned_at_the_old_budget_runs_out_of_memory_as_cuda_naming_the_task():
    """Planned at 90% of the whole fake GPU (the CUDA budget before context and workspaces were deducted:
    one stage of all 8 layers), the first stage's weights do not fit the allocator's 1.8 MiB:
    ``torch.OutOfMemoryError`` after a retry, reaching the caller as a ``WorkerError`` naming the upload.
    Before ``_after_inputs`` the compute that depends on the failed upload ran on its ``None`` weights and
    the caller got ``TypeError: linear(): argument 'weight' ... must be Tensor, not NoneType`` instead."""
    with pytest.raises(WorkerError) as info:
        _step_retries(1.8, int(0.9 * _fake_gpu(1.8)), steps=1)
    assert isinstance(info.value.original, torch.OutOfMemoryError)
    msg = str(info.value)
    assert msg.startswith("OutOfMemoryError in task [weights, stage F0, worker 0, upload queue]: CUDA out of memory"), msg
    assert "Tried to allocate 0.25 MiB on the upload stream. fake GPU 0 has 1.80 MiB for tensors" in msg

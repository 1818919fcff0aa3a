"""The offline planner budgets a GPU as the CUDA runtime does: ``TWO_POOL_SHARE`` of the usable memory."""

from __future__ import annotations

import pytest

from lightning_roundpipe.cost.device_overheads import TWO_POOL_SHARE
from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.cost.transformer import preset_costs
from lightning_roundpipe.planning import capacity
from lightning_roundpipe.planning.capacity import best_plan, plan_training
from lightning_roundpipe.workers import cuda
from lightning_roundpipe.workers.cuda import gpu_budget_bytes

GiB = 2**30


class Partitioned(Exception):
    """Stops ``best_plan`` once the partitioner has been called."""


@pytest.mark.parametrize("profile, capability", [("rtx4090", (8, 9)), ("h100", (9, 0))])
def test_the_planner_budget_is_the_cuda_runtime_budget(monkeypatch, profile, capability):
    hw = load_hardware(profile)
    runtime = gpu_budget_bytes(hw.gpu_memory_bytes, capability)
    assert cuda.TWO_POOL_SHARE is TWO_POOL_SHARE == 4 / 7  # one definition, imported by the runtime
    assert runtime == int(4 / 7 * int(0.9 * (hw.gpu_memory_bytes - hw.reserved_gpu_bytes)))

    # the partitioner gets it, as the runtime's keeper would
    budgets = []

    def partitioner(*args, memory_budget_bytes, **kwargs):
        budgets.append(memory_budget_bytes)
        raise Partitioned

    monkeypatch.setattr(capacity, "make_plan", partitioner)
    with pytest.raises(Partitioned):
        best_plan(preset_costs("qwen3-0.6b", hw, 1024), hw, [8])
    assert budgets == [runtime]
    monkeypatch.undo()

    # the fit check and the report compare the need against it: one layer per stage needs more here
    report = plan_training("qwen3-0.6b", hw, 524288, find_max_seq_len=False)
    assert report.gpu_budget_bytes == runtime
    assert not report.fits and report.min_gpu_bytes > runtime
    line = next(line for line in report.to_text().splitlines() if line.startswith("GPU memory per worker:"))
    assert (f"needed of {runtime / GiB:.1f} GiB budget (4/7 of {report.gpu_usable_bytes / GiB:.1f} GiB usable: "
            "weights and activations sit in two allocator pools that do not share cached blocks; ") in line
    assert any(f"GiB of {runtime / GiB:.1f} GiB budget (layer " in r for r in report.reasons), report.reasons

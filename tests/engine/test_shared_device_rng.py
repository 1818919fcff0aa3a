"""Workers sharing one GPU share its one generator: a layer holds it alone from seed to last draw.

CUDA's per-device generator is stood in for by ``DeviceGenerator`` (seed, offset, state and a
draw that advances the offset, as Philox does), so the race runs on the CPU: two workers of
device 0 enter a layer at once, and without the per-device gate the second one's seed lands
between the first one's seed and its draw, so the forward draws what its recompute does not.
"""

import threading

import pytest
import torch

from benchmarks.calibration.device_rng_cost import StandInGenerator
from lightning_roundpipe.engine.rng import CallRng, abandon_generators, layer_seed
from lightning_roundpipe.workers.completions import PipelineTimeout


class DeviceGenerator(StandInGenerator):
    """CUDA's generator, reduced to what ``CallRng`` and a dropout kernel use of it (the benchmark's stand-in,
    which times ``CallRng`` against it, plus a kernel's draw)."""

    def draw(self):
        """What a dropout kernel launched now would draw (its mask depends on seed and offset)."""
        value = (self.seed, self.offset)
        self.offset += 4
        return value


@pytest.fixture
def two_gpus(monkeypatch):
    gens = (DeviceGenerator(), DeviceGenerator())
    monkeypatch.setattr(torch.cuda, "default_generators", gens)
    return gens


def _forward_and_recompute(call: CallRng, device, gen, layer, overlap_with=None):
    """The draw of ``layer`` (microbatch 0) in forward, with ``overlap_with`` (a thread's start) let in
    while it runs, and then alone in recompute."""
    other_in = threading.Event()

    def other():
        with call.layer(device, layer + 1, 0):
            other_in.set()

    with call.layer(device, layer, 0):
        thread = threading.Thread(target=other, daemon=True)
        thread.start()
        other_in.wait(0.3)  # without the gate, the other worker's seed lands here
        forward = gen.draw()
        overlapped = other_in.is_set()
    thread.join(10)
    with call.layer(device, layer, 0, recompute=True):
        recompute = gen.draw()
    return forward, recompute, overlapped


@pytest.mark.timeout(20)
def test_workers_sharing_a_gpu_draw_the_same_numbers_in_forward_and_recompute(two_gpus):
    call = CallRng(timeout_s=10)
    forward, recompute, overlapped = _forward_and_recompute(call, torch.device("cuda", 0), two_gpus[0], 0)
    assert not overlapped  # the second worker of cuda:0 waited for the first one's layer
    assert forward == recompute == (layer_seed(call.base_seed, 0, 0), 0)
    assert call.drew
    assert two_gpus[0].get_offset() == 0 and two_gpus[0].seed == 0  # the generator put back


@pytest.mark.timeout(20)
def test_workers_on_distinct_gpus_do_not_wait_for_each_other(two_gpus):
    call = CallRng(timeout_s=10)
    other_in = threading.Event()

    def other():
        with call.layer(torch.device("cuda", 1), 1, 0):
            other_in.set()

    with call.layer(torch.device("cuda", 0), 0, 0):
        thread = threading.Thread(target=other, daemon=True)
        thread.start()
        assert other_in.wait(10)  # cuda:1's generator is its own
        assert two_gpus[0].draw() == (layer_seed(call.base_seed, 0, 0), 0)
    thread.join(10)


@pytest.mark.timeout(20)
def test_a_worker_waiting_for_a_shared_gpus_generator_times_out_naming_the_holder(two_gpus):
    call = CallRng(timeout_s=0.2, owner="pool", task_of=lambda thread: f"thread {thread.name}")
    inside, leave = threading.Event(), threading.Event()

    def stuck():
        with call.layer(torch.device("cuda", 0), 3, 1):
            inside.set()
            leave.wait(10)

    holder = threading.Thread(target=stuck, name="w0-compute", daemon=True)
    holder.start()
    assert inside.wait(10)
    try:
        with pytest.raises(PipelineTimeout) as info:
            with call.layer(torch.device("cuda", 0), 5, 0):
                pass
        assert "timed out after 0.2s waiting for the generator of cuda:0, held by layer 3 (layer), microbatch 1 " \
               "(thread w0-compute)" in str(info.value)
        assert abandon_generators("pool") == ["layer 3 (layer), microbatch 1 (thread w0-compute)"]
        with call.layer(torch.device("cuda", 0), 5, 0):  # a new call need not wait for the stuck thread
            assert two_gpus[0].draw() == (layer_seed(call.base_seed, 5, 0), 0)
    finally:
        leave.set()
        holder.join(10)
    assert two_gpus[0].seed == 0 and two_gpus[0].offset == 0  # the stuck thread's exit changed nothing

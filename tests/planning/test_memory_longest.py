"""End to end: the planner's longest sequence for a capped CPU worker trains, and 10% more runs out of memory."""

import dataclasses
import math

import pytest

from _memory_cases import MemoryCase, model_shape, plan_of, run_case
from lightning_roundpipe import WorkerOutOfMemoryError
from lightning_roundpipe.cost.transformer import shape_layer_costs
from lightning_roundpipe.planning.capacity import longest_fitting_seq_len
from lightning_roundpipe.cost.hardware import load_hardware

CAP = 6 * 2**20  # a 6 MiB virtual GPU per worker
CASE = MemoryCase(family="qwen3", hidden=32, layers=2, forward="0:2 2:4", backward="0:1 1:2 2:4", fused=True,
                  workers=2, microbatches=2, batch=2)


def costs_for(seq):
    return shape_layer_costs(model_shape(CASE), load_hardware("cpu2"), seq, microbatch_size=1, dtype_bytes=4,
                             loss_chunk_tokens=1024)


def predicted_longest(cap=CAP) -> int | None:
    return longest_fitting_seq_len(costs_for, plan_of(CASE), CASE.workers, cap, link_bytes_per_second=math.inf,
                                   quantum=16, max_seq_len=1 << 16, continue_round_robin=False,
                                   microbatches=CASE.microbatches)


@pytest.mark.timeout(180)
def test_the_predicted_longest_sequence_trains_and_ten_percent_more_does_not():
    longest = predicted_longest()
    assert longest is not None and 512 <= longest <= 8192, longest

    peaks = run_case(dataclasses.replace(CASE, seq_len=longest), cap_bytes=CAP)  # trains: no error
    assert max(peaks) <= CAP
    longer = int(1.1 * longest)
    with pytest.raises(WorkerOutOfMemoryError) as info:
        run_case(dataclasses.replace(CASE, seq_len=longer), cap_bytes=CAP)
    err = info.value
    assert err.cap_bytes == CAP and err.held_bytes + err.requested_bytes > CAP
    assert f"worker {err.worker} is out of memory" in str(err) and err.stage


def test_longest_fitting_seq_len_is_the_edge_of_the_cap():
    from lightning_roundpipe.cost.memory import roundpipe_gpu_bytes

    def peak(seq):
        return max(roundpipe_gpu_bytes(plan_of(CASE), costs_for(seq), 2, continue_round_robin=False,
                                       link_bytes_per_second=math.inf, microbatches=2))

    longest = predicted_longest()
    assert longest % 16 == 0 and peak(longest) <= CAP < peak(longest + 16)
    assert predicted_longest(cap=peak(16) - 1) is None  # not even one quantum fits
    assert predicted_longest(cap=peak(16)) == 16

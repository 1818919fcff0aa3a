"""End to end: the planner's longest sequence for a capped CPU worker trains, and 10% more runs out of memory."""

import dataclasses
import math
import re

import pytest

from _memory_cases import MemoryCase, model_shape, plan_of, run_case
from lightning_roundpipe.schedule.plan import PlanError
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
def test_the_predicted_longest_sequence_fits_the_cap_and_the_runtime_check_refuses_before_any_work():
    longest = predicted_longest()
    assert longest is not None and 512 <= longest <= 8192, longest

    # The runtime's first-batch check is the partitioner's rule: each stage's weights, gradients and activations
    # within half the cap (planning/budget.py). Since issue 43 item 12 it prices decoder layers' graphs (they were
    # priced as their outputs), so it refuses the planner's longest sequence here before any work, where this test
    # used to train it (and to let 10% more fail on a worker, WorkerOutOfMemoryError, which item 12 forbids).
    with pytest.raises(PlanError, match="Raise cpu_memory_cap_bytes") as info:
        run_case(dataclasses.replace(CASE, seq_len=longest), cap_bytes=CAP)
    refusal = str(info.value)
    for _ in range(4):  # the check names the first layer or stage over half the cap: twice each need in turn
        accepted = 2 * int(re.search(r"needs [\d.]+ \w+ \((\d+) bytes", refusal).group(1))
        try:
            peaks = run_case(dataclasses.replace(CASE, seq_len=longest), cap_bytes=accepted)
            break
        except PlanError as err:
            refusal = str(err)
    # under the least cap the check accepts it trains, and its measured peak is within the planner's CAP
    assert max(peaks) <= CAP < accepted
    with pytest.raises(PlanError):  # 10% more under CAP: refused before any work, never on the worker
        run_case(dataclasses.replace(CASE, seq_len=int(1.1 * longest)), cap_bytes=CAP)


def test_longest_fitting_seq_len_is_the_edge_of_the_cap():
    from lightning_roundpipe.cost.memory import roundpipe_gpu_bytes

    def peak(seq):
        return max(roundpipe_gpu_bytes(plan_of(CASE), costs_for(seq), 2, continue_round_robin=False,
                                       link_bytes_per_second=math.inf, microbatches=2))

    longest = predicted_longest()
    assert longest % 16 == 0 and peak(longest) <= CAP < peak(longest + 16)
    assert predicted_longest(cap=peak(16) - 1) is None  # not even one quantum fits
    assert predicted_longest(cap=peak(16)) == 16

"""Predicted versus measured device memory on the CPU backend, within 10%, over a subset of the sweep
(``benchmarks/validation/memory_sweep.py`` runs all of it: 256 to 16K tokens, three plans, fused or not, LoRA or full)."""

import pytest

from _memory_cases import ERROR_BOUND, compare, sweep_cases


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", sweep_cases(quick=True), ids=lambda c: c.label.replace(" ", ""))
def test_predicted_peak_within_ten_percent_of_measured(case):
    row = compare(case)
    measured, predicted = max(row["measured"]), max(row["predicted"])
    assert measured > 0
    assert abs(predicted - measured) <= ERROR_BOUND * measured, row

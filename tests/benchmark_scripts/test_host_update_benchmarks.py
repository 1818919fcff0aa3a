"""Smoke runs of the host update rate and device RNG cost calibrations (issue 42)."""

import json
import math

import pytest


@pytest.mark.timeout(120)
def test_host_update_rate_measures_every_implementation_and_checks_fused_bit_for_bit(tmp_path):
    from benchmarks.calibration import host_update_rate

    path = tmp_path / "rate.json"
    host_update_rate.main(["--quick", "--threads", "1", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["producer"] == "benchmarks.calibration.host_update_rate"
    shapes = host_update_rate.layer_shapes(256, 768, 2, 1, 128)
    assert data["layer_params"] == sum(math.prod(s) for s in shapes)
    assert set(data["params_per_s"]) == {"for_loop", "foreach", "fused"}
    assert all(by_threads["1"] > 0 for by_threads in data["params_per_s"].values())
    assert data["bitwise_equal_to_for_loop"]["foreach"] is True  # the same per-element operations
    assert isinstance(data["bitwise_equal_to_for_loop"]["fused"], bool)


def test_the_full_layer_is_a_qwen3_1_7b_decoder_layer():
    from benchmarks.calibration.host_update_rate import layer_shapes

    # q and o 2048 x 2048, k and v 1024 x 2048, gate, up and down 2048 x 6144, q/k norms 128, 2 norms 2048
    assert sum(math.prod(s) for s in layer_shapes()) == 2 * 2048 * 2048 + 2 * 1024 * 2048 + 3 * 2048 * 6144 + 2 * 128 + 2 * 2048


@pytest.mark.timeout(120)
def test_device_rng_cost_times_the_three_ways_a_gpu_layer_runs(tmp_path):
    from benchmarks.calibration import device_rng_cost

    path = tmp_path / "rng.json"
    device_rng_cost.main(["--quick", "--json", str(path)])
    data = json.loads(path.read_text())
    assert set(data) == {"producer", "seeded_us", "shared_us", "quiet_run_us_per_layer"}
    assert all(data[k] > 0 for k in ("seeded_us", "shared_us", "quiet_run_us_per_layer"))
    # a run of 8 layers checks the generator once: cheaper per layer than a seeded layer each
    assert data["quiet_run_us_per_layer"] < data["seeded_us"]

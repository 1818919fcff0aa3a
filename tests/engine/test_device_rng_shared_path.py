"""On a GPU, layers known not to draw take the shared path of the device's generator, as on the CPU:
no seeding, several workers of one GPU inside at once, one check of the generator at the end (issue 42).

CUDA's generator is stood in for by ``DeviceGenerator`` (test_shared_device_rng.py), counting calls."""

import threading

import pytest
import torch
from torch import nn

from lightning_roundpipe.engine.rng import CallRng, UnseededDraw, layer_seed
from test_shared_device_rng import DeviceGenerator

GPU = torch.device("cuda", 0)


class CountingGenerator(DeviceGenerator):
    """A device generator that records which of its methods the engine called."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __getattribute__(self, name):
        if name in ("manual_seed", "get_offset", "get_state", "set_state"):
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)


@pytest.fixture
def gpu(monkeypatch):
    gens = (CountingGenerator(), CountingGenerator())
    monkeypatch.setattr(torch.cuda, "default_generators", gens)
    return gens[0]


def _learn_quiet(call, modules):
    """Each module's first call runs seeded (it may draw) and teaches that it drew nothing."""
    for i, m in enumerate(modules):
        with call.layer(GPU, i, 0, m):
            pass


@pytest.mark.timeout(20)
def test_a_gpu_layer_known_not_to_draw_runs_shared_unseeded_beside_another_worker(gpu):
    call, quiet = CallRng(timeout_s=10), nn.Linear(2, 2)
    _learn_quiet(call, [quiet])
    assert "manual_seed" in gpu.calls  # the first call ran seeded
    gpu.calls.clear()
    both_inside = threading.Barrier(2, timeout=5)  # breaks (and fails the call) unless both are inside at once
    errors = []

    def worker(mb):
        try:
            with call.layer(GPU, 0, mb, quiet):
                both_inside.wait()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(mb,)) for mb in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == []
    assert set(gpu.calls) == {"get_state"}  # no seed, no offset reads, no put back
    assert len(gpu.calls) == 3  # one read as the shared period began, one check per exit


@pytest.mark.timeout(20)
def test_an_unseeded_draw_in_a_shared_gpu_layer_fails_puts_the_generator_back_and_runs_seeded_after(gpu):
    call, layer = CallRng(timeout_s=10), nn.Linear(2, 2)
    _learn_quiet(call, [layer])
    before = (gpu.seed, gpu.offset)
    with pytest.raises(UnseededDraw, match="layer 0 \\(Linear\\), microbatch 1"):
        with call.layer(GPU, 0, 1, layer):
            gpu.draw()  # this time it draws
    assert (gpu.seed, gpu.offset) == before  # the draw is not kept
    with call.layer(GPU, 0, 1, layer):  # now known to draw: seeded, forward and recompute alike
        forward = gpu.draw()
    with call.layer(GPU, 0, 1, layer, recompute=True):
        recompute = gpu.draw()
    assert forward == recompute == (layer_seed(call.base_seed, 0, 1), 0)


@pytest.mark.timeout(20)
def test_a_gpu_layer_that_drew_stays_seeded(gpu):
    call, dropout = CallRng(timeout_s=10), nn.Linear(2, 2)
    with call.layer(GPU, 0, 0, dropout):
        gpu.draw()
    gpu.calls.clear()
    with call.layer(GPU, 0, 1, dropout):
        drawn = gpu.draw()
    assert drawn == (layer_seed(call.base_seed, 0, 1), 0)
    assert "manual_seed" in gpu.calls and call.drew


@pytest.mark.timeout(20)
def test_a_quiet_run_of_gpu_layers_checks_the_generator_once(gpu):
    call, layers = CallRng(timeout_s=10), [nn.Linear(2, 2) for _ in range(3)]
    _learn_quiet(call, layers)
    assert call.all_quiet(layers)
    gpu.calls.clear()
    with call.quiet_run(GPU, range(0, 3), 0, layers) as held:
        assert held
    assert gpu.calls == ["get_state", "get_state"]  # the period's start and its one check

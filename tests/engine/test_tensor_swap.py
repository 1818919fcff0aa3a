"""The eager layer call with a worker's tensors (``engine/layer_call.py``) computes what
``torch.func.functional_call`` computes, and leaves the module as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrize

from lightning_roundpipe.engine.layer_call import TensorSwap, tensor_slots
from lightning_roundpipe.params.weights import LayerTable

pytestmark = pytest.mark.timeout(60)


class _Doubled(nn.Module):
    def forward(self, w):
        return 2.0 * w


class _Layer(nn.Module):
    """Nested submodules, a buffer, a module shared under two names, a parametrized weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))
        self.shared = nn.Linear(6, 6)
        self.again = self.shared  # the same module (and tensors) under a second name
        self.head = nn.Linear(6, 3)
        parametrize.register_parametrization(self.head, "weight", _Doubled())
        self.register_buffer("offset", torch.full((3,), 0.5))

    def forward(self, carry):
        h = self.inner(carry["x"])
        h = torch.tanh(self.again(self.shared(h)))
        if carry.get("fail"):
            raise RuntimeError("inside the layer")
        return {"y": self.head(h) + self.offset}


def _worker_tensors(layer: nn.Module, requires_grad: bool) -> dict:
    """What a worker holds: a copy of every named tensor (each name of a tied tensor gets the same copy)."""
    table = LayerTable(layer)
    copies: dict[int, torch.Tensor] = {}
    out = {}
    for name, t, is_param in zip(table.names, table.tensors, table.is_param):
        if id(t) not in copies:
            c = t.detach().clone() + 0.25  # different from the module's own, so a missed swap shows
            copies[id(t)] = c.requires_grad_(requires_grad and is_param)
        out[name] = copies[id(t)]
    return out


def _own(layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(layer.named_parameters(remove_duplicate=False)) + list(layer.named_buffers(remove_duplicate=False))


def test_slots_name_every_tensor_as_the_layer_table_does():
    layer = _Layer()
    assert sorted(tensor_slots(layer)) == sorted(LayerTable(layer).names)


@pytest.mark.parametrize("training", [False, True])
def test_a_call_computes_what_functional_call_computes_and_gradients_reach_only_the_given_tensors(training):
    layer = _Layer().train(training)
    twin = copy.deepcopy(layer)  # functional_call's reference runs on a copy (see below)
    own = [(n, id(t)) for n, t in _own(layer)]
    x = torch.randn(4, 6)
    ref_tensors, tensors = _worker_tensors(twin, True), _worker_tensors(layer, True)
    # functional_call writes the module's own tensor back into its dict under the second name of a
    # tie, so it gets a copy of the dict.
    ref = functional_call(twin, dict(ref_tensors), ({"x": x},))["y"]
    got = TensorSwap().call(layer, tensors, {"x": x})["y"]
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    ref.square().sum().backward()
    got.square().sum().backward()
    for name in tensors:
        a, b = tensors[name], ref_tensors[name]
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    # functional_call also sends the shared module's gradient to that module's own parameters; the
    # swap sends nothing there: the host's .grad is the engine's to fill, in its fixed order.
    assert {n for n, t in twin.named_parameters() if t.grad is not None} == {"shared.weight", "shared.bias"}
    assert all(t.grad is None for _, t in layer.named_parameters())
    assert [(n, id(t)) for n, t in _own(layer)] == own  # its own tensors are back
    if training:  # batch norm's running statistics went to the given buffers, as with functional_call
        torch.testing.assert_close(tensors["inner.1.running_mean"], ref_tensors["inner.1.running_mean"])


def test_the_same_dict_serves_every_microbatch_of_a_stage():
    """The engine passes one dict per layer for all of a stage's microbatches (``StageWeights.params_for``):
    each call must run on the given tensors, a tied one included, and leave the dict as it was."""
    layer = _Layer()
    tensors = _worker_tensors(layer, True)
    before = dict(tensors)
    swap = TensorSwap()
    outs = [swap.call(layer, tensors, {"x": torch.ones(4, 6)})["y"] for _ in range(2)]
    assert {k: id(v) for k, v in tensors.items()} == {k: id(v) for k, v in before.items()}
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    sum(o.sum() for o in outs).backward()
    assert tensors["again.weight"].grad is not None and all(t.grad is None for _, t in layer.named_parameters())


def test_the_module_gets_its_own_tensors_back_when_the_layer_raises():
    layer = _Layer()
    own = [(n, id(t)) for n, t in _own(layer)]
    with pytest.raises(RuntimeError, match="inside the layer"):
        TensorSwap().call(layer, _worker_tensors(layer, False), {"x": torch.randn(4, 6), "fail": True})
    assert [(n, id(t)) for n, t in _own(layer)] == own


def test_a_name_the_module_does_not_hold_falls_back_to_functional_call(monkeypatch):
    layer = _Layer()
    swap = TensorSwap()
    swap.slots(layer)  # slots read before the structure changed
    layer.extra = nn.Linear(6, 6)  # a submodule added afterwards: its names are not among the slots
    tensors = _worker_tensors(layer, False)
    calls = []
    import lightning_roundpipe.engine.layer_call as module

    monkeypatch.setattr(module, "functional_call", lambda *a: calls.append(a) or functional_call(*a))
    out = swap.call(layer, tensors, {"x": torch.randn(4, 6)})
    assert len(calls) == 1 and set(out) == {"y"}


class _Twice(nn.Module):
    """One linear applied twice through two names: the same module object under ``lin`` and ``again``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.again = self.lin

    def forward(self, x):
        return torch.tanh(self.again(torch.tanh(self.lin(x))))


def test_a_layer_holding_a_module_under_two_names_trains_as_plain_pytorch():
    """With ``functional_call`` this failed on the second microbatch: the first call had written the
    module's own parameter back into the stage's dict under ``again.weight``, and the next call then
    got two different values for the tied names (ValueError)."""
    from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), _Twice(), nn.Linear(8, 4))
    ref = copy.deepcopy(net)
    x = torch.randn(8, 8)
    ref(x).square().sum().backward()
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=4, step_metrics=False))
    try:
        net(x).square().sum().backward()
    finally:
        runtime.detach()
    assert net[1].again is net[1].lin
    for (name, p), r in zip(net.named_parameters(), ref.parameters()):
        assert ((p.grad - r.grad).norm() / r.grad.norm()).item() <= 1e-5, name

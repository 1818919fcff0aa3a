"""The failed-step undo's bounded journal (``optimizer_undo_journal_bytes``): layers past it wait until the step
is known good, every failure before that leaves weights and Adam state exactly as before, and the bound holds."""

import time

import pytest
import torch
from torch import nn

from _exact_models import LAYERED, assert_same, snapshot
from lightning_roundpipe import PipelineError, RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.optim.step_undo import BeforeImages, image_tensors

FAIL_STEP = 2  # steps 0 and 1 succeed (Adam has state), step 2 fails
# One layer's before-image once AdamW has state, each tensor aligned to 64 B: the 8x8 weight and its two
# moments (3 x 256 B) and step count (64 B); the bias, its moments and step count (4 x 64 B).
PER_LAYER = (3 * 256 + 64) + 4 * 64


class Fault(torch.autograd.Function):
    """Identity whose backward raises once ``armed`` is set on the switch (a dict)."""

    @staticmethod
    def forward(ctx, x, switch):
        ctx.switch = switch
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.switch["armed"] and ctx.switch.get("where") == "backward":
            raise RuntimeError("injected backward failure")
        return g, None


class FaultLayer(nn.Module):
    def __init__(self, switch):
        super().__init__()
        self.switch = switch

    def forward(self, x):
        return Fault.apply(x, self.switch)


class GroupFailingAdamW(torch.optim.AdamW):
    """Raises for the parameter group marked ``fail`` once armed with ``where="optimizer"``."""

    roundpipe_per_layer = True
    switch: dict = {}

    def step(self, closure=None):
        if self.switch["armed"] and self.switch.get("where") == "optimizer" and any(g.get("fail") for g in self.param_groups):
            raise RuntimeError("injected optimizer failure")
        return super().step(closure)


def _net(switch):
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)]
    blocks[1] = nn.Sequential(FaultLayer(switch), *blocks[1])  # low: the top layers' gradients come home first
    return nn.Sequential(*blocks)


def _layer_image_bytes(net, opt, layer: int) -> int:
    return BeforeImages.size_of(image_tensors(opt.state, list(net[layer].parameters())))


def _train(journal_layers, *, where=None, fail_group=None, steps=FAIL_STEP + 1, early=True):
    """Train 6 tanh-linear layers with AdamW on 2 CPU workers, with a journal sized for ``journal_layers``
    layers' before-images (None: no bound); arm a failure at ``FAIL_STEP``. Returns what the test inspects."""
    switch = {"armed": False, "where": where}
    net = _net(switch)
    params = list(net.parameters())
    groups = [{"params": params[:4]}, {"params": params[4:]}]  # layers 0-1, layers 2-5
    if fail_group is not None:
        groups[fail_group]["fail"] = True
    GroupFailingAdamW.switch = switch
    opt = GroupFailingAdamW(groups, lr=1e-2)
    # Every layer's image (weight, bias, their step counts and moments) has the same size once Adam has state.
    per_layer = PER_LAYER
    journal = None if journal_layers is None else journal_layers * per_layer
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(
        microbatches=2, step_metrics=False, timeout=30.0, optimizer_undo_journal_bytes=journal, **LAYERED))
    ov = runtime.overlap_optimizer(opt, early_steps=early)
    g = torch.Generator().manual_seed(1)
    out = {"error": None, "early": [], "journaled": [], "used": [], "held": []}
    try:
        for step in range(steps):
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)

            def closure():
                opt.zero_grad()
                loss = ((net(x) - y) ** 2).mean()
                with ov.last_backward():
                    loss.backward()
                return loss

            runtime.join()
            if step == FAIL_STEP and where is not None:
                out["before"] = snapshot(net, opt)
                switch["armed"] = True
            if step == 1:
                assert _layer_image_bytes(net, opt, 0) == per_layer
            early_before = ov.early_layer_steps
            try:
                opt.step(closure)
                runtime.join()
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                out["error"] = exc
                break
            finally:
                out["early"].append(ov.early_layer_steps - early_before)
                out["journaled"].append(sorted(ov._journaled))  # noqa: SLF001 - the test reads which units
                out["used"].append(ov.journal_used_bytes)
                out["held"].append(ov.before_images.nbytes())
        out["after"] = snapshot(net, opt)
        out["unrestored"] = list(ov.unrestored)
        if out["unrestored"]:
            with pytest.raises(PipelineError, match="mark_restored"):
                opt.step(closure)
            ov.mark_restored()
    finally:
        switch["armed"] = False
        runtime.detach()
    return out


def _note(exc) -> str:
    return str(exc) + "".join(getattr(exc, "__notes__", []))


@pytest.mark.timeout(60)
def test_a_bounded_journal_trains_bit_for_bit_as_an_unbounded_one():
    runs = {n: _train(n, steps=3)["after"] for n in (None, 2, 0)}
    assert_same(runs[None], runs[2])
    assert_same(runs[None], runs[0])


@pytest.mark.timeout(60)
def test_journal_full_failure_in_backward_after_layers_waited_leaves_state_as_before():
    out = _train(2, where="backward")
    assert "injected backward failure" in _note(out["error"])
    assert "back as before the step" in _note(out["error"])
    # The journal held the two top layers (units 4 and 5, the first to step during backward) and nothing
    # more: layers 2 and 3 had complete gradients before layer 1's backward failed but waited instead.
    assert out["journaled"][1:] == [[4, 5], [4, 5]]
    assert out["early"][1] == 2 and out["early"][2] <= 2
    assert max(out["held"]) <= 2 * PER_LAYER and out["used"][2] == out["held"][2]
    assert_same(out["before"], out["after"])
    assert not out["unrestored"]


@pytest.mark.timeout(60)
def test_journal_empty_failure_in_backward_leaves_state_as_before_and_no_layer_steps_early():
    out = _train(0, where="backward")
    assert "injected backward failure" in _note(out["error"])
    assert out["journaled"] == [[]] * len(out["journaled"]) and out["early"] == [0] * len(out["early"])
    assert out["held"] == [0] * len(out["held"])
    assert_same(out["before"], out["after"])


@pytest.mark.timeout(60)
def test_journal_full_optimizer_failure_in_a_journaled_layer_puts_back_everything():
    # Layers 2-5 raise; 4 and 5 are journaled and step first (during backward): nothing past the journal ran.
    out = _train(2, where="optimizer", fail_group=1)
    assert "injected optimizer failure" in _note(out["error"])
    assert_same(out["before"], out["after"])
    assert not out["unrestored"]


@pytest.mark.timeout(60)
def test_an_update_past_the_journal_that_raises_is_named_and_refused_until_restored():
    # No early steps, journal of 2: layers 0-1 are journaled and step first; layers 2-5 step without a copy once
    # the step is known good, and their own update raises: 0-1 go back, the layer that raised is named, and the
    # runtime refuses to go on (as with optimizer_undo=False) until mark_restored.
    out = _train(2, where="optimizer", fail_group=1, early=False)
    text = _note(out["error"])
    assert "injected optimizer failure" in text
    assert "stepped without a before-image" in text and "optimizer_undo_journal_bytes" in text
    assert out["unrestored"] == ["layer 2"]  # the first update past the journal raised; the others skipped
    before, after = out["before"], out["after"]
    for n in before[0]:
        if int(n.split(".")[0]) in (0, 1, 3, 4, 5):
            assert torch.equal(before[0][n], after[0][n]), n


@pytest.mark.timeout(60)
def test_known_good_gate_runs_every_reduction_before_the_first_update_past_the_journal():
    """``before_layer_step`` (the node all-reduce wait) of every layer past the journal runs before any of
    them steps, so a reduction failing cannot leave some of them updated."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(
        microbatches=2, step_metrics=False, optimizer_undo_journal_bytes=0, **LAYERED))
    ov = runtime.overlap_optimizer(opt)
    events = []
    ov.before_layer_step = lambda params: events.append(("reduce", time.monotonic_ns(), id(params[0])))
    ov.after_layer_step = lambda params: events.append(("step", time.monotonic_ns(), id(params[0])))
    try:
        opt.zero_grad()
        net(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        runtime.join()
    finally:
        runtime.detach()
    kinds = [k for k, _, _ in events]
    assert kinds == ["reduce"] * 4 + ["step"] * 4


def test_the_set_up_says_when_the_journal_does_not_fit_the_host_with_the_figure_and_the_option(monkeypatch, caplog):
    from lightning_roundpipe.optim import undo_fit

    net = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 2,099,200 fp32 parameters: 8,396,800 B
    opt = torch.optim.AdamW(net.parameters())
    trainable = 2 * (1024 * 1024 + 1024) * 4
    # before the first step: AdamW's two moments (2 x 8.4 MB) and the gradients (8.4 MB) are still to come
    to_come = 3 * trainable
    assert undo_fit.undo_fit_message(opt, 4 << 30, to_come + 3 * trainable) is None  # the whole image fits
    text = undo_fit.undo_fit_message(opt, 4 << 30, to_come + trainable)
    assert text.startswith(f"the failed-step undo journal needs {3 * trainable / 2**30:.1f} GiB")
    assert f"optimizer_undo_journal_bytes={trainable} or less" in text and "optimizer_undo=False" in text
    assert undo_fit.undo_fit_message(opt, trainable, to_come + trainable) is None  # a journal bounded to what fits
    assert "state itself does not fit" in undo_fit.undo_fit_message(opt, 0, to_come - 1)
    # the runtime says it when the optimizer is overlapped, before any step
    monkeypatch.setattr(undo_fit, "available_host_bytes", lambda: to_come + trainable)
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False, **LAYERED))
    try:
        with caplog.at_level("WARNING", logger="lightning_roundpipe"):
            runtime.overlap_optimizer(opt)
    finally:
        runtime.detach()
    assert runtime.undo_fit_warning == text and text in caplog.text
    assert not opt.state  # nothing stepped

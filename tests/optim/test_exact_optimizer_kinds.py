"""Issue 20, item 12: a failed overlapped step is not counted, and optimizers with state outside
``state[p]`` are stepped whole (exact) instead of once per layer."""

import logging

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from _exact_models import LAYERED, WEIGHT_TOL, SeqModule, parity, weight_error, weights
from _noise_floor import ADAMW_WEIGHT_TOL
from _models import make_data
from lightning_roundpipe import RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions
from lightning_roundpipe.options import OptionError

STRATEGY = {"microbatches": 2, **LAYERED}
FAIL_ON = 2  # the third step fails


def failing(base):
    class Failing(base):
        """Raises in the third step of the group marked ``fail`` (layer 0: the last to step)."""

        roundpipe_per_layer = True  # per-parameter state: may be stepped layer by layer
        calls = 0

        def step(self, closure=None):
            if any(g.get("fail") for g in self.param_groups):
                call, type(self).calls = type(self).calls, type(self).calls + 1
                if call == FAIL_ON:
                    raise RuntimeError("injected optimizer failure")
            return super().step(closure)

    return Failing


class FailingModule(SeqModule):
    def __init__(self, opt):
        super().__init__(opt=opt, scheduler=True, scheduler_interval="step")
        self.overlapped = None

    def on_train_start(self):
        runtime = getattr(self.trainer.strategy, "runtime", None)
        self.overlapped = None if runtime is None else len(runtime.overlapped)

    def configure_optimizers(self):
        params = list(self.parameters())
        groups = [{"params": params[:2], "fail": True}, {"params": params[2:]}]
        if self.opt == "sgd":
            opt = failing(torch.optim.SGD)(groups, lr=self.lr, momentum=0.9)
        else:
            opt = failing(torch.optim.AdamW)(groups, lr=self.lr * 0.1, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _trainer(root, strategy, devices, max_steps):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=max_steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=str(root))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_failed_step_advances_neither_global_step_nor_scheduler(tmp_path, opt):
    data = DataLoader(make_data(n=40), batch_size=8)
    ref = FailingModule(opt)
    w0 = weights(ref)
    ref_trainer = _trainer(tmp_path, "auto", 1, FAIL_ON)
    ref_trainer.fit(ref, data)  # the steps before the failing one (whole steps: one call each, none fails)
    module = FailingModule(opt)
    trainer = _trainer(tmp_path, RoundPipeStrategy(**STRATEGY), 2, 5)
    with pytest.raises(RuntimeError, match="injected optimizer failure"):
        trainer.fit(module, data)
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert module.overlapped == 1  # declared roundpipe_per_layer: stepped layer by layer
    assert (trainer.global_step, sched.last_epoch) == (FAIL_ON, FAIL_ON)
    # AdamW: a multiple of the default strategy's own summation-order floor (tests/_noise_floor.py)
    assert weight_error(weights(module), weights(ref), w0) < (ADAMW_WEIGHT_TOL if opt == "adamw" else WEIGHT_TOL)
    opt_state = trainer.optimizers[0].state_dict()
    ref_state = ref_trainer.optimizers[0].state_dict()
    assert opt_state["param_groups"][0]["lr"] == ref_state["param_groups"][0]["lr"]
    trainer.save_checkpoint(tmp_path / "after_failure.ckpt")
    ckpt = torch.load(tmp_path / "after_failure.ckpt", weights_only=False)
    assert ckpt["global_step"] == FAIL_ON
    assert all(torch.equal(ckpt["state_dict"][k], v) for k, v in weights(module).items())


class CountingWarmupSGD(torch.optim.Optimizer):
    """Plain SGD with a linear warm-up counted by the optimizer itself (state outside ``state[p]``)."""

    def __init__(self, params, lr=0.1, warmup=4):
        super().__init__(params, {"lr": lr})
        self.steps, self.warmup = 0, warmup

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps += 1
        scale = min(1.0, self.steps / self.warmup)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * scale)
        return loss


class GroupCountingSGD(torch.optim.Optimizer):
    """The warm-up counted in each parameter group (as schedule-free keeps ``group["k"]``)."""

    def __init__(self, params, lr=0.1, warmup=4):
        super().__init__(params, {"lr": lr, "k": 0, "warmup": warmup})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            group["k"] += 1
            scale = min(1.0, group["k"] / group["warmup"])
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * scale)
        return loss


class Lookahead(torch.optim.Optimizer):
    """Lookahead (k steps of the inner optimizer, then the slow weights move halfway): a global step count."""

    def __init__(self, inner, k=2, alpha=0.5):
        self.inner, self.k, self.alpha, self.count = inner, k, alpha, 0
        self.param_groups, self.defaults = inner.param_groups, inner.defaults
        self.state = inner.state
        self.slow = {p: p.detach().clone() for g in inner.param_groups for p in g["params"]}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.inner.step(closure)
        self.count += 1
        if self.count % self.k == 0:
            for p, slow in self.slow.items():
                slow.add_(p - slow, alpha=self.alpha)
                p.copy_(slow)
        return loss


class StepCountingAdamW(torch.optim.AdamW):
    """A subclass replacing step() with a counter outside ``state[p]`` (halves lr every other step)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        for g in self.param_groups:
            g["lr"] = g["initial_lr"] * (0.5 if self.calls % 2 == 0 else 1.0)
        return super().step(closure)


def _module_with(make_opt):
    class Custom(SeqModule):
        def configure_optimizers(self):
            return make_opt(self.parameters())

    return Custom


def _stepwise_adamw(params):
    opt = StepCountingAdamW(params, lr=0.01)
    for g in opt.param_groups:
        g["initial_lr"] = g["lr"]
    return opt


CUSTOM = {
    "warmup_counter": lambda ps: CountingWarmupSGD(ps, lr=0.1),
    "group_counter": lambda ps: GroupCountingSGD(ps, lr=0.1),
    "lookahead": lambda ps: Lookahead(torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    "subclass_replacing_step": _stepwise_adamw,
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", list(CUSTOM))
def test_optimizer_with_state_outside_state_p_is_stepped_whole_and_exact(kind, caplog):
    with caplog.at_level(logging.INFO):
        _, w_err = parity(_module_with(CUSTOM[kind]), max_steps=5, strategy_kwargs=STRATEGY)
    tol = ADAMW_WEIGHT_TOL if "adamw" in kind else WEIGHT_TOL  # AdamW: tests/_noise_floor.py
    assert w_err < tol, f"{kind}: weights {w_err:.2e} off the default strategy's"
    assert "whole after backward, not layer by layer" in caplog.text


def test_which_optimizers_step_layer_by_layer():
    from lightning_roundpipe.optim.per_layer_support import why_not_per_layer

    p = [torch.nn.Parameter(torch.ones(2))]
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad):
        assert why_not_per_layer(cls(p, lr=0.1)) is None, cls
    assert why_not_per_layer(type("Plain", (torch.optim.AdamW,), {})(p)) is None  # a subclass keeping step()
    assert "LBFGS couples all parameters" in why_not_per_layer(torch.optim.LBFGS(p))
    assert "replaces step()" in why_not_per_layer(_stepwise_adamw(p))
    assert "not one of the torch.optim optimizers" in why_not_per_layer(CountingWarmupSGD(p))
    declared = type("Declared", (CountingWarmupSGD,), {"roundpipe_per_layer": True})
    assert why_not_per_layer(declared(p)) is None
    hooked = torch.optim.SGD(p, lr=0.1)
    handle = hooked.register_step_post_hook(lambda *a: None)
    assert "step hooks" in why_not_per_layer(hooked)
    handle.remove()
    assert why_not_per_layer(hooked) is None


@pytest.mark.timeout(60)
def test_refused_for_layer_by_layer_where_only_that_is_possible(tmp_path):
    net = SeqModule().net
    w0 = {n: p.detach().clone() for n, p in net.named_parameters()}
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    try:
        with pytest.raises(ValueError, match=r"not be exact for CountingWarmupSGD: .*overlap_optimizer=False.*"
                                             r"CountingWarmupSGD.roundpipe_per_layer = True"):
            runtime.overlap_optimizer(CountingWarmupSGD(net.parameters()))
    finally:
        runtime.detach()
    assert all(torch.equal(p, w0[n]) for n, p in net.named_parameters())
    assert "step" not in vars(net) and "forward" not in vars(net)
    module = _module_with(CUSTOM["warmup_counter"])()
    before = weights(module)
    with pytest.raises(OptionError, match=r"staleness=1\) steps the optimizer layer by layer.*CountingWarmupSGD"):
        _trainer(tmp_path, RoundPipeStrategy(staleness=1, microbatches=2), 2, 2).fit(
            module, DataLoader(make_data(n=16), batch_size=8))
    assert all(torch.equal(p, before[n]) for n, p in weights(module).items())
    assert "forward" not in vars(module.net)

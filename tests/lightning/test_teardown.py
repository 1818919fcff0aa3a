"""After any failure in fit: no thread of ours left, the module exactly as before, and a second fit trains correctly."""

import copy
import threading
import time

import pytest
import torch
from torch import nn

from _models import SeqModule, fit, weight_error, weights
from lightning_roundpipe import OptionError, PipelineTimeout, RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions, WorkerError
from lightning_roundpipe.runtime import run_all


def our_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("roundpipe-") and t.is_alive())


def seconds_until_no_threads(limit=5.0):
    t0 = time.monotonic()
    while our_threads() and time.monotonic() - t0 < limit:
        time.sleep(0.02)
    return time.monotonic() - t0


class FailingSGD(torch.optim.SGD):
    """Raises on every update while ``fail`` is set."""

    roundpipe_per_layer = True  # its state is per parameter: it may be stepped layer by layer

    fail = False

    def step(self, closure=None):
        if FailingSGD.fail:
            raise RuntimeError("optimizer refused this update")
        return super().step(closure)


class Sleepy(nn.Module):
    delay = 0.0

    def forward(self, x):
        if Sleepy.delay:
            time.sleep(Sleepy.delay)
        return x


class Explode(nn.Module):
    armed = False

    def forward(self, x):
        if Explode.armed:
            raise ValueError("worker exploded")
        return x


class Module(SeqModule):
    def __init__(self, optimizer="sgd"):
        super().__init__(opt="sgd")
        self.net = nn.Sequential(*self.net[:2], Sleepy(), Explode(), *self.net[2:])
        self.optimizer = optimizer

    def configure_optimizers(self):
        if self.optimizer == "failing":
            return FailingSGD(self.parameters(), lr=0.1)
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(autouse=True)
def _reset():
    yield
    FailingSGD.fail, Sleepy.delay, Explode.armed = False, 0.0, False


def _state_as_before(m, attrs_before, x, out_before):
    assert not {"parameters", "named_parameters", "state_dict", "forward"} & set(vars(m))
    assert set(vars(m.net)) == attrs_before  # no instance-level forward left
    assert m.net(x).shape == out_before.shape  # calling the module works again, without the pipeline


def _second_fit_trains_correctly(m):
    ref = copy.deepcopy(m)
    w0 = weights(m)
    fit(ref, "auto", max_steps=3)
    fit(m, RoundPipeStrategy(microbatches=2), devices=2, max_steps=3)
    assert weight_error(weights(m), weights(ref), w0) <= 1e-4
    assert not our_threads()


def _run_failure(module, strategy, error, match, **fit_kw):
    x = torch.randn(3, 8)
    attrs, out = set(vars(module.net)), module.net(x)
    with pytest.raises(error, match=match):
        fit(module, strategy, devices=2, max_steps=4, **fit_kw)
    gone = seconds_until_no_threads()
    assert not our_threads(), our_threads()
    FailingSGD.fail, Sleepy.delay, Explode.armed = False, 0.0, False
    _state_as_before(module, attrs, x, out)
    return gone


def test_optimizer_failure_tears_everything_down():
    import lightning as L

    class Arm(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            FailingSGD.fail = trainer.global_step == 2

    m = Module(optimizer="failing")
    gone = _run_failure(m, RoundPipeStrategy(microbatches=2), Exception, "optimizer refused this update", callbacks=[Arm()])
    print(f"optimizer failure: threads gone after {gone:.2f}s")
    FailingSGD.fail = False
    m.optimizer = "sgd"
    _second_fit_trains_correctly(m)


def test_unwritable_trace_dir_is_refused_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    m = Module()
    before = weights(m)
    gone = _run_failure(m, RoundPipeStrategy(microbatches=2, trace_steps=1, trace_dir=str(blocker / "trace")),
                        OptionError, r"RoundPipeStrategy\(trace_dir\)=.*cannot write there")
    print(f"unwritable trace_dir: threads gone after {gone:.2f}s")
    assert all(torch.equal(v, before[k]) for k, v in weights(m).items())  # refused before any weight changed
    _second_fit_trains_correctly(m)


def test_worker_error_tears_everything_down():
    import lightning as L

    class Arm(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            Explode.armed = trainer.global_step == 2

    m = Module()
    gone = _run_failure(m, RoundPipeStrategy(microbatches=2), WorkerError, "worker exploded", callbacks=[Arm()])
    print(f"worker error: threads gone after {gone:.2f}s")
    Explode.armed = False
    _second_fit_trains_correctly(m)


def test_timeout_tears_everything_down():
    import lightning as L

    class Stall(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            Sleepy.delay = 2.0 if trainer.global_step == 1 else 0.0

    m = Module()
    gone = _run_failure(m, RoundPipeStrategy(microbatches=2, timeout=0.5), PipelineTimeout, r"timed out after 0\.5s",
                        callbacks=[Stall()])
    print(f"timeout: threads gone after {gone:.2f}s")
    Sleepy.delay = 0.0
    _second_fit_trains_correctly(m)


def test_detach_runs_every_step_when_one_raises():
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    opt = runtime.overlap_optimizer(FailingSGD(net.parameters(), lr=0.1))
    FailingSGD.fail = True
    net(torch.randn(4, 4)).sum().backward()
    opt.step()  # the layer steps fail on the host thread
    with pytest.raises(Exception, match="optimizer refused this update"):
        runtime.detach()
    assert seconds_until_no_threads() < 5 and not our_threads()
    assert "forward" not in vars(net) and "step" not in vars(opt.optimizer)
    assert net(torch.randn(2, 4)).shape == (2, 1)


def test_run_all_runs_every_step_and_raises_the_first_error():
    ran = []

    def fail(msg):
        ran.append(msg)
        raise ValueError(msg)

    with pytest.raises(ValueError, match="first"):
        run_all([lambda: fail("first"), lambda: ran.append("middle"), lambda: fail("second")])
    assert ran == ["first", "middle", "second"]

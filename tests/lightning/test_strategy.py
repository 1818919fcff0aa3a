"""The Lightning side: options, module discovery, evaluation loops, precision, failures."""

import time
import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from _models import SeqModule, fit, make_data, weights
from lightning_roundpipe import RoundPipeStrategy, WorkerError
from lightning_roundpipe.adapters.target import PipelineTargetError


def trainer(strategy, devices=2, **kw):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **kw)


def test_string_registration_gives_virtual_cpu_workers():
    t = trainer("roundpipe", devices=3)
    assert isinstance(t.strategy, RoundPipeStrategy)
    assert t.strategy.num_workers == 3


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"microbatches": 0}, "microbatches=0"),
        ({"recompute": "sometimes"}, "recompute='sometimes'"),
        ({"timeout": 0}, "timeout=0"),
        ({"partition": "clever"}, "partition policy must be"),
        ({"partition": {"policy": "params", "stages": 3}}, "unknown key(s) ['stages']"),
        ({"transfer": {"queue": "lifo"}}, "transfer queue must be 'priority' or 'fifo'"),
        ({"transfer": {"priorities": {"activation": 0}}}, "priorities must give a number for ['gradients', 'weights']"),
        ({"transfer": 3}, "transfer=...) takes a TransferConfig, a dict or None"),
    ],
)
def test_bad_options_name_the_option(kwargs, message):
    with pytest.raises(ValueError) as err:
        RoundPipeStrategy(**kwargs)
    assert message in str(err.value)


def test_workers_must_match_devices():
    with pytest.raises(ValueError, match=r"workers=3\) does not match Trainer\(devices=2\)"):
        fit(SeqModule(), RoundPipeStrategy(workers=3), devices=2, max_steps=1)


def test_wrong_accelerator_is_refused():
    s = RoundPipeStrategy()
    s.parallel_devices = [torch.device("meta")]
    with pytest.raises(ValueError, match="accelerator='cpu'.*or accelerator='gpu'"):
        s._backend()


class TwoNets(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8))
        self.b = nn.Sequential(nn.Linear(8, 1))

    def training_step(self, batch, i):
        x, y = batch
        return ((self.b(self.a(x)) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NoSeq(TwoNets):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)


def test_ambiguous_module_asks_for_a_name():
    with pytest.raises(PipelineTargetError, match=r"several modules.*a \(Sequential\), b \(Sequential\).*module='...'"):
        fit(TwoNets(), RoundPipeStrategy(), devices=2, max_steps=1)
    # naming one works
    fit(TwoNets(), RoundPipeStrategy(module="a"), devices=2, max_steps=1)


def test_no_module_to_pipeline_says_what_to_do():
    with pytest.raises(PipelineTargetError, match="found no module to pipeline in NoSeq.*nn.Sequential"):
        fit(NoSeq(), RoundPipeStrategy(), devices=2, max_steps=1)
    with pytest.raises(PipelineTargetError, match="names a Linear, which RoundPipe cannot split"):
        fit(NoSeq(), RoundPipeStrategy(module="a"), devices=2, max_steps=1)
    with pytest.raises(PipelineTargetError, match="has no attribute 'c'"):
        fit(NoSeq(), RoundPipeStrategy(module="c"), devices=2, max_steps=1)


def test_validate_and_predict_match_default_strategy():
    data = DataLoader(make_data(n=20), batch_size=6)
    m = SeqModule()
    ref_val = trainer("auto", devices=1).validate(m, data, verbose=False)
    ref_pred = trainer("auto", devices=1).predict(m, data)
    # The last batch holds 2 samples: said once per process and batch shape (no other test uses this
    # one). Recorded rather than pytest.warns, which would re-emit third-party warnings the config filters.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        val = trainer(RoundPipeStrategy(microbatches=3)).validate(m, data, verbose=False)
        pred = trainer(RoundPipeStrategy(microbatches=3)).predict(m, data)
    ours = [str(w.message) for w in caught if "lightning_roundpipe" in w.filename]
    assert ours == ["batch of 2 is smaller than microbatches=3; running 2 microbatches of one sample for this batch "
                    "(results are unchanged)"]
    assert val[0]["val_loss"] == pytest.approx(ref_val[0]["val_loss"], rel=1e-6)
    assert len(pred) == len(ref_pred)
    for p, r in zip(pred, ref_pred):
        assert torch.allclose(p, r, atol=1e-6)


class AutocastProbe(nn.Module):
    seen = []

    def forward(self, x):
        AutocastProbe.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return x


class ProbeModule(SeqModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), AutocastProbe(), nn.Linear(8, 1))


def test_autocast_is_reentered_on_workers_and_in_recompute():
    AutocastProbe.seen.clear()
    m = ProbeModule()
    # split_check=False: the check's own host calls of the probe (3, once) are not the workers' calls counted here
    fit(m, RoundPipeStrategy(microbatches=2, recompute="always", split_check=False), devices=2, max_steps=2,
        precision="bf16-mixed")
    # forward and recompute, 2 microbatches, 2 steps
    assert len(AutocastProbe.seen) == 8
    assert all(s == (True, torch.bfloat16) for s in AutocastProbe.seen)


def test_bf16_mixed_tracks_default_strategy():
    m_ref, m = SeqModule(opt="adamw"), SeqModule(opt="adamw")
    fit(m_ref, "auto", precision="bf16-mixed")
    fit(m, RoundPipeStrategy(microbatches=2), devices=2, precision="bf16-mixed")
    w_ref, w = weights(m_ref), weights(m)
    # bf16 matmuls on different microbatch shapes round differently; the weights stay close.
    assert max(((w[k] - w_ref[k]).norm() / w_ref[k].norm()).item() for k in w) < 1e-2


class Explode(nn.Module):
    armed = False

    def forward(self, x):
        if Explode.armed:
            raise RuntimeError("worker exploded")
        return x


class ArmAtStep(L.Callback):
    def __init__(self, step):
        self.step, self.before = step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.before = weights(pl_module)
            Explode.armed = True


class ExplodingModule(SeqModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), Explode(), nn.Linear(8, 1))


def test_worker_exception_fails_fit_fast_and_leaves_weights():
    Explode.armed = False
    m = ExplodingModule()
    arm = ArmAtStep(2)
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError, match="worker exploded") as err:
            fit(m, RoundPipeStrategy(microbatches=2), devices=2, max_steps=5, callbacks=[arm])
    finally:
        Explode.armed = False
    assert time.monotonic() - t0 < 20
    assert "original traceback on the worker" in str(err.value)
    after = weights(m)
    assert all(torch.equal(after[k], arm.before[k]) for k in after)
    assert "forward" not in vars(m.net)  # teardown ran


def test_transfer_and_partition_dicts_as_hydra_gives_them():
    from _models import grad_error

    ref = SeqModule()
    _, g_ref = fit(ref, "auto", max_steps=2)
    m = SeqModule()
    strategy = RoundPipeStrategy(
        microbatches=2,
        partition={"policy": "manual", "manual_forward": [[0, 3], [3, 6]], "manual_backward": [[0, 2], [2, 4], [4, 6]]},
        transfer={"queue": "fifo", "chunk_bytes": 256, "prefetch_depth": 1, "bandwidth_bytes_per_s": 1e8, "latency_s": 1e-4,
                  "priorities": {"activation": 0, "weights": 0, "gradients": 0}},
        testing={"jitter_s": 0.001}, seed=3,
    )
    _, g = fit(m, strategy, devices=2, max_steps=2)
    assert grad_error(g, g_ref) <= 1e-5

"""staleness=1 resumes exactly: the delayed update's previous weights travel with the checkpoint."""

import pytest
import torch
from torch import nn

from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions

STEPS = 4


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 2, generator=g)) for _ in range(STEPS)]


def _train(net, opt_state=None, extra=None, steps=range(STEPS), opt_name="sgd"):
    opt = (torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9) if opt_name == "sgd"
           else torch.optim.AdamW(net.parameters(), lr=1e-2))
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False, staleness=1))
    ov = runtime.overlap_optimizer(opt)
    if extra is not None:
        ov.load_state_dict(extra)
    data = _data()
    try:
        for t in steps:
            x, y = data[t]
            opt.zero_grad()
            ((net(x) - y) ** 2).mean().backward()
            opt.step()
        runtime.join()
        saved = (opt.state_dict(), ov.state_dict())
    finally:
        runtime.detach()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, saved


def _net():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)], nn.Linear(8, 2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_staleness_one_resume_equals_straight_run(opt_name):
    straight, _ = _train(_net(), opt_name=opt_name)
    half = _net()
    _, (opt_state, extra) = _train(half, steps=range(STEPS // 2), opt_name=opt_name)
    assert set(extra) == {"staleness", "previous_weights"} and extra["previous_weights"]
    model_state = {k: v.clone() for k, v in half.state_dict().items()}

    def resumed(with_extra):
        net = _net()
        net.load_state_dict(model_state)
        return _train(net, opt_state, extra if with_extra else None, steps=range(STEPS // 2, STEPS),
                      opt_name=opt_name)[0]

    exact = resumed(True)
    for k in straight:
        assert torch.equal(exact[k], straight[k]), k
    # without the previous weights the first resumed gradient is taken at the wrong weights
    assert any(not torch.equal(resumed(False)[k], straight[k]) for k in straight)


def test_state_dict_refuses_another_staleness():
    net = _net()
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    try:
        ov = runtime.overlap_optimizer(torch.optim.SGD(net.parameters(), lr=0.1))
        assert ov.state_dict() == {"staleness": 0}
        with pytest.raises(ValueError, match="resume with the same staleness"):
            ov.load_state_dict({"staleness": 1, "previous_weights": {}})
    finally:
        runtime.detach()

"""``recompute_early_stop=True``: a backward stage's last layer recomputes and back-propagates as one compiled
``torch.func.vjp`` graph (``engine/early_stop.py``), exact against Lightning's default strategy.

As in ``test_compiled_layers.py``, the default run keeps to one block shape whose compiled graphs every test
of the module reuses; the Hugging Face family is marked slow.
"""

import copy

import pytest
import torch
from torch import nn

from _family_configs import tiny_model
from _exact_models import GRAD_TOL, WEIGHT_TOL, SeqModule, fit, grad_error, parity, weight_error, weights
from lightning_roundpipe import OptionError, RoundPipeStrategy
from lightning_roundpipe.engine.early_stop import EARLY_STOP
from lightning_roundpipe.workers.completions import PipelineError
from tests.engine.test_compiled_layers import quick_inductor, train_causal_lm  # noqa: F401 (an autouse fixture)

WIDTH, INNER = 8, 12


class MlpBlock(nn.Module):
    """A residual MLP block: its down projection's output is only the block's output, the work the early stop
    leaves out. ``unused``: a weight the forward never reads (autograd leaves its gradient None)."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(WIDTH, INNER), nn.Linear(INNER, WIDTH), nn.Dropout(dropout)
        self.unused = nn.Linear(WIDTH, 1)

    def forward(self, x):
        return x + self.down(self.drop(torch.tanh(self.up(x))))


class BlocksModule(SeqModule):
    def __init__(self, opt="sgd", dropout=0.0, depth=4):
        super().__init__(opt=opt)
        torch.manual_seed(0)
        self.net = nn.Sequential(*[MlpBlock(dropout) for _ in range(depth)])


# Forward stages of two blocks; backward stages of one and of two blocks (a vjp alone, and after a recompute).
MANUAL = {"policy": "manual", "manual_forward": [[0, 2], [2, 4]], "manual_backward": [[0, 1], [1, 3], [3, 4]]}


def early(**kwargs):
    return dict({"microbatches": 2, "recompute": "always", "compile_layers": True, "recompute_early_stop": True,
                 "partition": MANUAL}, **kwargs)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_early_stop_matches_lightnings_default_strategy(opt):
    """SGD without clipping and AdamW: gradients of step 1 and weights after 3 steps equal the default
    strategy's; the unused weight keeps a None gradient (AdamW would decay it on a zero one)."""
    g_err, w_err = parity(lambda: BlocksModule(opt), strategy_kwargs=early(), max_steps=3)
    assert g_err <= GRAD_TOL and w_err <= WEIGHT_TOL
    assert any(what == "MlpBlock vjp on cpu" for what, _ in EARLY_STOP.compiles)


@pytest.mark.timeout(900)
def test_the_unused_weight_gets_no_gradient_and_adamw_leaves_it_alone():
    m = BlocksModule("adamw")
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    _, grads = fit(m, RoundPipeStrategy(**early()), devices=2, max_steps=2)
    for i in range(4):
        assert grads.get(f"net.{i}.unused.weight") is None  # recorded only when not None
        assert torch.equal(m.net[i].unused.weight, before[f"net.{i}.unused.weight"])
        assert grads[f"net.{i}.up.weight"] is not None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dropout_under_the_early_stop_replays_the_forwards_masks():
    """With dropout, the early-stopping pipeline's steps equal the compiled pipeline's without it (same per-layer
    seeds: the vjp's recompute drew the forward's masks), and dropout really dropped."""
    runs = {}
    for stop in (False, True):
        m = BlocksModule(dropout=0.3)
        w0 = weights(m)
        _, g = fit(m, RoundPipeStrategy(**early(recompute_early_stop=stop)), devices=2, max_steps=2)
        runs[stop] = (g, weights(m))
    assert grad_error(runs[True][0], runs[False][0]) <= GRAD_TOL
    assert weight_error(runs[True][1], runs[False][1], w0) <= WEIGHT_TOL
    _, g_plain = fit(BlocksModule(dropout=0.0), RoundPipeStrategy(**early()), devices=2, max_steps=1)
    assert grad_error(runs[True][0], g_plain) > 0.01


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_early_stop_at_layer_grain_matches_the_default_strategy():
    g_err, w_err = parity(lambda: BlocksModule("adamw"), strategy_kwargs=early(recompute="layer"), max_steps=3)
    assert g_err <= GRAD_TOL and w_err <= WEIGHT_TOL


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_early_stop_under_bf16_stays_at_bf16_rounding_of_the_default_strategy(precision):
    """The vjp's forward runs under the precision plugin's autocast (bf16-mixed) or on bf16 weights (bf16-true):
    step 1's gradients differ from the default strategy's by bf16 rounding (measured 0.5-0.7% relative; the
    compiled pipeline without early stop 0.4-0.6%), not by a wrong scale or a missing term (50-100%)."""
    _, g_ref = fit(BlocksModule("adamw"), "auto", max_steps=1, precision=precision)
    _, g = fit(BlocksModule("adamw"), RoundPipeStrategy(**early()), devices=2, max_steps=1, precision=precision)
    assert grad_error(g, g_ref) <= 0.02


def test_early_stop_needs_compiled_layers():
    with pytest.raises(OptionError, match=r"recompute_early_stop=True\): the early-stopping recompute is a compiled "
                                          r"graph: it needs compiled layers"):
        RoundPipeStrategy(recompute_early_stop=True, compile_layers=False)
    with pytest.raises(OptionError, match="must be True or False"):
        RoundPipeStrategy(recompute_early_stop="yes")


@pytest.mark.timeout(300)
def test_on_the_cpu_backend_the_default_eager_layers_refuse_early_stop_before_training():
    m = BlocksModule()
    start = weights(m)
    with pytest.raises(OptionError, match="needs compiled layers"):
        fit(m, RoundPipeStrategy(microbatches=2, recompute_early_stop=True), devices=2, max_steps=1)
    assert all(torch.equal(w, start[n]) for n, w in weights(m).items())


class PicksRows(nn.Module):
    """A layer with a data-dependent shape (rows picked with ``nonzero``, as Hugging Face's MoE expert loop)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        rows = (x[:, 0] > 0).nonzero().squeeze(1)
        return x.index_add(0, rows, self.lin(x[rows]))


class PickingModule(SeqModule):
    def __init__(self):
        super().__init__(opt="sgd")
        torch.manual_seed(0)
        self.net = nn.Sequential(PicksRows(), PicksRows())


class MixedModule(SeqModule):
    """Blocks that stop early and a ``PicksRows`` that cannot (layer 2, the last of the backward stage [1, 3])."""

    def __init__(self):
        super().__init__(opt="sgd")
        torch.manual_seed(0)
        self.net = nn.Sequential(MlpBlock(), MlpBlock(), PicksRows(), MlpBlock())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("recompute", ["always", pytest.param("layer", marks=pytest.mark.slow)])
def test_by_default_a_layer_that_cannot_stop_early_recomputes_whole_and_stays_exact(recompute):
    """``recompute_early_stop`` left at None with compiled layers: the blocks stop early (the vjp of stage [0, 1]),
    the ``PicksRows`` ending stage [1, 3] recomputes whole after the block before it (at layer grain every layer
    goes through the vjp or, for ``PicksRows``, its eager stand-in), and the steps equal Lightning's default
    strategy's (SGD without clipping)."""
    g_err, w_err = parity(MixedModule, strategy_kwargs={"microbatches": 2, "recompute": recompute,
                                                        "compile_layers": True, "partition": MANUAL}, max_steps=2)
    assert g_err <= GRAD_TOL and w_err <= WEIGHT_TOL
    compiled = [what for what, _ in EARLY_STOP.compiles]
    assert "MlpBlock vjp on cpu" in compiled and not any(what.startswith("PicksRows") for what in compiled)


@pytest.mark.timeout(60)
def test_a_layer_that_cannot_stop_early_gets_none_when_not_required_traced_once_and_logged_once(caplog):
    """``EarlyStopBackward.grads(required=False)`` on ``PicksRows`` (its ``nonzero``): None, what the first meta
    trace found kept for the next call (no second trace), the class logged once; ``required=True`` (the default)
    raises ``EarlyStopUnsupported`` instead."""
    from lightning_roundpipe.engine.early_stop import EarlyStopBackward, EarlyStopUnsupported

    backward = EarlyStopBackward()
    x, g = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    picks, cpu = PicksRows(), ("cpu", False, None)
    params = dict(picks.named_parameters())
    caplog.set_level("INFO", logger="lightning_roundpipe")
    traced = []
    picks.register_forward_pre_hook(lambda module, args: traced.append(1))
    for _ in range(2):
        assert backward.grads(picks, params, x, (0,), [g], cpu, required=False) is None
    assert len(traced) == 1  # the second answer came from what the first trace found
    assert backward.grads(PicksRows(), params, x, (0,), [g], cpu, required=False) is None  # another module
    with pytest.raises(EarlyStopUnsupported, match="recompute_early_stop cannot check which weights layer PicksRows"):
        backward.grads(picks, params, x, (0,), [g], cpu)
    assert picks.lin.weight.grad is None
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("recompute_early_stop")]
    assert len(told) == 1 and told[0].startswith("recompute_early_stop: PicksRows layers recompute whole (their "
                                                 "forward does not run on meta tensors")


@pytest.mark.timeout(300)
def test_a_layer_the_meta_trace_cannot_run_fails_the_step_naming_the_way_back_and_changes_no_weight():
    m = PickingModule()
    start = weights(m)
    with pytest.raises(PipelineError, match=r"recompute_early_stop cannot check which weights layer PicksRows uses.*"
                                            r"Set recompute_early_stop=False"):
        fit(m, RoundPipeStrategy(microbatches=2, recompute="always", compile_layers=True, recompute_early_stop=True),
            devices=2, max_steps=1)
    assert all(torch.equal(w, start[n]) for n, w in weights(m).items())


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_early_stop_on_llama_decoder_layers_matches_the_default_strategy():
    """Llama's decoder layers (rotary tables and mask in the carry) back-propagated through the compiled vjp,
    3 SGD steps equal to Lightning's default strategy."""
    model = tiny_model("llama")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference = train_causal_lm(copy.deepcopy(model), "auto", 1)
    # prefix + 3 decoder layers + postfix: backward stages of the first decoder layer with the prefix (a recompute
    # then the vjp) and of one decoder layer (the vjp alone); the fused last stage as it always runs.
    cuts = {"policy": "manual", "manual_forward": [[0, 3], [3, 5]], "manual_backward": [[0, 2], [2, 3], [3, 5]]}
    pipelined = train_causal_lm(model, RoundPipeStrategy(microbatches=3, compile_layers=True, recompute="always",
                                                         recompute_early_stop=True, partition=cuts), 2)
    assert any(what.endswith(" vjp on cpu") and what.startswith("DecoderStep") for what, _ in EARLY_STOP.compiles)
    for name, ref in reference.items():
        update = (ref - start[name]).norm()
        assert update > 0, name
        assert (pipelined[name] - ref).norm() / update <= WEIGHT_TOL, name

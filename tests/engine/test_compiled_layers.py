"""``compile_layers=True``: layers run through ``torch.compile`` (inductor's CPU code) on the workers, exact.

Inductor's first compile of a graph takes tens of seconds on two cores, so the default run keeps to
one layer shape (two identical blocks) whose compiled graphs every test of the module reuses (the
compiled forwards are process-wide); the Hugging Face families and the other recompute grains are
marked slow.
"""

import copy
import time

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _family_configs import family_batch, tiny_model
from _exact_models import GRAD_TOL, WEIGHT_TOL, SeqModule, fit, grad_error, our_threads, parity, weight_error, weights
from lightning_roundpipe import OptionError, RoundPipeStrategy
from lightning_roundpipe.engine.compiled_layers import COMPILED_LAYERS
from tests.adapters.test_family_options import CausalLMModule

WIDTH = 8


def blocks(depth=2, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(dropout)) for _ in range(depth)]


class BlocksModule(SeqModule):
    """Identical blocks only (one compiled graph serves them all); the loss on the host."""

    def __init__(self, opt="sgd", dropout=0.0, depth=2):
        super().__init__(opt=opt)
        self.net = nn.Sequential(*blocks(depth, dropout))


@pytest.fixture(autouse=True, scope="module")
def quick_inductor():
    """Inductor's plainest CPU code for these tests: scalar loops (no vector headers to compile) and no
    compile subprocesses; about half the cold compile time on two cores, and the same numbers to check."""
    import torch._inductor.config as inductor

    with inductor.patch({"cpp.vec_isa_ok": False, "compile_threads": 1}):
        yield


def compiled(**kwargs):
    return dict({"microbatches": 2, "recompute": "always", "compile_layers": True}, **kwargs)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_compiled_layers_match_lightnings_default_strategy(opt):
    before = len(COMPILED_LAYERS.compiles)
    g_err, w_err = parity(lambda: BlocksModule(opt), strategy_kwargs=compiled(), max_steps=3)
    assert g_err <= GRAD_TOL and w_err <= WEIGHT_TOL
    # The blocks ran compiled: their first calls compiled here, or in the case before (reused, none new).
    assert any(what.startswith("Sequential") for what, _ in COMPILED_LAYERS.compiles)
    assert all(what.startswith("Sequential") for what, _ in COMPILED_LAYERS.compiles[before:])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dropout_under_compile_draws_the_eager_numbers_and_recompute_replays_them():
    """The compiled pipeline's steps equal the eager pipeline's (same per-layer seeds): dropout drew the same
    masks in forward and in the recompute of backward, or the gradients would differ."""
    runs = {}
    for compile_layers in (False, True):
        m = BlocksModule(dropout=0.3)
        w0 = weights(m)
        _, g = fit(m, RoundPipeStrategy(**compiled(compile_layers=compile_layers)), devices=2, max_steps=2)
        runs[compile_layers] = (g, weights(m))
    assert grad_error(runs[True][0], runs[False][0]) <= GRAD_TOL
    assert weight_error(runs[True][1], runs[False][1], w0) <= WEIGHT_TOL
    m = BlocksModule(dropout=0.0)
    _, g_plain = fit(m, RoundPipeStrategy(**compiled(compile_layers=False)), devices=2, max_steps=1)
    assert grad_error(runs[True][0], g_plain) > 0.01  # dropout really dropped


def test_compile_layers_must_be_a_flag():
    with pytest.raises(OptionError, match=r"RoundPipeStrategy\(compile_layers='yes'\): must be True or False"):
        RoundPipeStrategy(compile_layers="yes")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("recompute", ["layer", "never"])
def test_compiled_layers_parity_in_every_recompute_grain(recompute):
    g_err, w_err = parity(lambda: BlocksModule("adamw", depth=3), devices=3, max_steps=3,
                          strategy_kwargs=compiled(recompute=recompute, microbatches=3))
    assert g_err <= GRAD_TOL and w_err <= WEIGHT_TOL


def train_causal_lm(model, strategy, devices):
    """3 SGD steps on the family batch; the trained weights."""
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(CausalLMModule(model, lr=0.1), DataLoader(TensorDataset(*family_batch("left")), batch_size=6))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("recompute", ["always", "layer"])
def test_compiled_decoder_layers_of_a_softcapping_family_with_the_fused_chunked_loss(recompute):
    """Gemma2 (attention and final-logit soft-capping, alternating sliding layers): the decoder layers
    compiled, the fused last stage's chunked loss eager, 3 SGD steps equal to Lightning's default strategy."""
    model = tiny_model("gemma2")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference = train_causal_lm(copy.deepcopy(model), "auto", 1)
    pipelined = train_causal_lm(model, RoundPipeStrategy(microbatches=3, recompute=recompute, compile_layers=True), 2)
    assert any(what.startswith("DecoderStep") for what, _ in COMPILED_LAYERS.compiles)
    assert not any(what.startswith(("CausalLMPrefix", "CausalLMPostfix")) for what, _ in COMPILED_LAYERS.compiles)
    for name, ref in reference.items():
        update = (ref - start[name]).norm()
        assert update > 0, name
        assert (pipelined[name] - ref).norm() / update <= WEIGHT_TOL, name


def test_compile_layers_defaults_to_the_backends_rule_eager_on_cpu():
    """``compile_layers=None`` (the default) asks the backend: the CPU backend keeps eager layers, so
    nothing compiles; ``compile_layers=True`` still compiles there (the tests above)."""
    from lightning_roundpipe.options import RuntimeOptions
    from lightning_roundpipe.workers import backend_class

    assert RuntimeOptions().compile_layers is None
    assert RuntimeOptions().compiles_layers(True) is True and RuntimeOptions().compiles_layers(False) is False
    assert RuntimeOptions(compile_layers=False).compiles_layers(True) is False
    assert RuntimeOptions(compile_layers=True).compiles_layers(False) is True
    for backend in ("cpu", "fake_cuda", "emulated"):
        assert backend_class(backend).default_compile_layers() is False, backend
    class EngineOptionsSeen(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            self.compile_layers = trainer.strategy.runtime.engine.options.compile_layers

    seen = EngineOptionsSeen()
    before = len(COMPILED_LAYERS.compiles)
    fit(BlocksModule(), RoundPipeStrategy(microbatches=2), devices=2, max_steps=1, callbacks=[seen])
    assert seen.compile_layers is False
    assert len(COMPILED_LAYERS.compiles) == before


@pytest.mark.parametrize("cuda, triton, capabilities, expected", [
    (True, True, [(8, 9), (8, 9)], True),   # two RTX 4090s
    (True, True, [(9, 0)], True),           # H100 / H200
    (True, True, [(8, 9), (6, 1)], False),  # one Pascal GPU among them: Triton does not run there
    (True, False, [(8, 9)], False),         # no triton package: inductor cannot generate GPU code
    (False, True, [], False),               # no CUDA
])
def test_the_cuda_backend_compiles_by_default_where_inductor_generates_gpu_code(monkeypatch, cuda, triton,
                                                                                 capabilities, expected):
    import importlib.util

    from lightning_roundpipe.workers import cuda as cuda_backend

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capabilities[i])
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if triton else None) if name == "triton" else real_find_spec(name, *a))
    indices = list(range(len(capabilities))) or None
    assert cuda_backend.inductor_generates_gpu_code(indices) is expected
    assert cuda_backend.CudaWorkerPool.default_compile_layers(indices) is expected


@pytest.mark.timeout(600)
def test_a_third_shape_reuses_the_dynamic_graph_the_second_compiled():
    """torch's automatic dynamic shapes (``dynamic=None``): the first microbatch shape compiles a static
    graph, the second one a graph with that dimension dynamic, and every later shape runs that graph:
    two graphs for four sequence lengths, not four (dynamic padding does not compile every step)."""
    from torch._dynamo.utils import counters  # dynamo's own count of the graphs it compiled

    from lightning_roundpipe.engine.compiled_layers import CompiledLayers

    class ShapeProbe(nn.Sequential):
        """A class of its own: dynamo remembers dynamic dimensions per code name, and the other tests'
        Sequential blocks already ran at several shapes."""

    torch.manual_seed(0)
    layer = ShapeProbe(nn.Linear(WIDTH, WIDTH), nn.Tanh())
    params = dict(layer.named_parameters())
    layers = CompiledLayers()
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for length in (5, 7, 9, 11):
            x = torch.randn(2, length, WIDTH)
            torch.testing.assert_close(layers.call(layer, params, x), layer(x), rtol=1e-6, atol=1e-6)
    assert counters["stats"]["unique_graphs"] - before == 2


@pytest.mark.timeout(120)
def test_a_compiler_failure_fails_the_step_naming_the_way_back_and_changes_no_weight(monkeypatch):
    """A compiler that raises (here a dynamo backend that always fails) fails the first step with
    ``LayerCompileError``: its message names ``compile_layers=False`` and the compiler's own error,
    the weights are as before the fit, no worker thread is left, and the eager run then trains."""
    from lightning_roundpipe.engine import compiled_layers, task_work
    from lightning_roundpipe.engine.compiled_layers import LayerCompileError

    real_compile = torch.compile

    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("injected compiler failure")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(fn, backend=failing_backend))
    monkeypatch.setattr(task_work, "COMPILED_LAYERS", compiled_layers.CompiledLayers())  # nothing cached
    m = BlocksModule("adamw")
    w0 = weights(m)
    with pytest.raises(Exception) as info:
        fit(m, RoundPipeStrategy(**compiled()), devices=2, max_steps=1)
    chain, exc = [], info.value
    while exc is not None and len(chain) < 10:
        chain.append(exc)
        exc = getattr(exc, "original", None) or exc.__cause__
    assert any(isinstance(e, LayerCompileError) for e in chain), [type(e).__name__ for e in chain]
    first_line = str(info.value).splitlines()[0]
    assert "set compile_layers=False" in first_line
    assert "recompute_early_stop=False leaves that graph out and keeps the layers compiled" in first_line
    assert "BackendCompilerFailed, from RuntimeError: injected compiler failure" in first_line
    assert all(torch.equal(a, b) for a, b in zip(weights(m).values(), w0.values()))
    assert our_threads() == []
    fit(m, RoundPipeStrategy(**compiled(compile_layers=False)), devices=2, max_steps=1)
    assert any(not torch.equal(a, b) for a, b in zip(weights(m).values(), w0.values()))


def test_only_the_compilers_own_exceptions_count_as_compile_failures():
    from torch._dynamo.exc import BackendCompilerFailed
    from lightning_roundpipe.engine.compiled_layers import (LayerCompileError, is_compile_failure,
                                                            naming_compile_failures)

    class FromDynamo(Exception):
        pass

    FromDynamo.__module__ = "torch._dynamo.exc"
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = FromDynamo("inner")
    assert is_compile_failure(wrapped) and is_compile_failure(FromDynamo("x"))
    assert not is_compile_failure(ValueError("a layer's own error")) and not is_compile_failure(None)
    assert issubclass(BackendCompilerFailed, Exception) and BackendCompilerFailed.__module__.startswith("torch._dynamo")

    def layer_error():
        raise ValueError("a layer's own error")

    with pytest.raises(ValueError, match="a layer's own error"):
        naming_compile_failures(layer_error)()

    def compiler_error():
        raise wrapped

    with pytest.raises(LayerCompileError, match="set compile_layers=False") as info:
        naming_compile_failures(compiler_error)()
    assert info.value.__cause__ is wrapped


class DeviceIndexProbe(nn.Module):
    """A layer as a worker of GPU ``device_index`` runs it. On CUDA dynamo guards each graph on its tensors'
    device index; on the CPU every tensor is on ``cpu``, so the probe carries the index as an int attribute,
    which dynamo guards by value in the same way (a graph per index)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.device_index = 0

    def forward(self, x):
        return torch.tanh(self.lin(x)) + self.device_index


def counting_compile(monkeypatch):
    """``torch.compile`` with dynamo's real guards and caches, and a backend that runs the traced graph as is
    (no inductor: milliseconds per graph) and counts the graphs it got and the calls that ran one of them."""
    from collections import Counter

    real_compile = torch.compile
    seen = Counter()

    def backend(graph_module, example_inputs):
        seen["graphs"] += 1

        def run(*args):
            seen["compiled calls"] += 1
            return graph_module.forward(*args)

        return run

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(fn, backend=backend))
    return seen


@pytest.mark.timeout(120)
def test_eight_gpus_in_both_grad_modes_keep_a_graph_each_and_no_call_runs_eagerly(monkeypatch):
    """8 devices x 2 grad modes = 16 graphs of one layer class, twice dynamo's recompile limit of 8: each
    (class, device, grad mode) has a compiled callable, so every call runs a compiled graph and each device
    holds one graph, none recompiled. (One callable per class for every device ran the calls past its 8th
    graph eagerly, with nothing but a log line.)"""
    from torch._dynamo import config

    from lightning_roundpipe.engine.compiled_layers import CompiledLayers

    seen = counting_compile(monkeypatch)
    assert config.recompile_limit == 8
    layers, layer = CompiledLayers(), DeviceIndexProbe()
    params = dict(layer.named_parameters())
    x = torch.randn(2, 3, WIDTH)
    calls = 0
    for _ in range(2):  # the second round runs the graphs the first compiled
        for grad in (False, True):
            for index in range(8):
                layer.device_index = index
                with torch.set_grad_enabled(grad):
                    out = layers.call(layer, params, x, device=f"cuda:{index}")
                torch.testing.assert_close(out, layer(x), rtol=0, atol=0)
                calls += 1
    assert seen["graphs"] == 16 and seen["compiled calls"] == calls == 32
    graphs = layers.graphs()
    assert len(graphs) == 16 and set(graphs.values()) == {1} and layers.recompiles() == 0
    assert "compiled_DeviceIndexProbe_cuda_7_grad" in graphs and "compiled_DeviceIndexProbe_cuda_0_nograd" in graphs
    # compile seconds are counted per device: 16 first calls, each named with its device
    assert sorted(what for what, _ in layers.compiles)[:2] == ["DeviceIndexProbe grad=False on cuda:0",
                                                               "DeviceIndexProbe grad=False on cuda:1"]
    assert len(layers.compiles) == 16


@pytest.mark.timeout(120)
def test_reaching_the_recompile_limit_fails_naming_the_layer_device_and_remedy_instead_of_running_eagerly(monkeypatch):
    """More variants of one key than dynamo's limit (here 2: the probe's guarded attribute takes a third
    value on one device): the third call raises ``RecompileLimitError`` naming the compiled function, the
    limit, the graphs held and what to change, where dynamo alone would run it eagerly."""
    from torch._dynamo import config

    from lightning_roundpipe.engine.compile_keys import RecompileLimitError
    from lightning_roundpipe.engine.compiled_layers import CompiledLayers

    seen = counting_compile(monkeypatch)
    layers, layer = CompiledLayers(), DeviceIndexProbe()
    params = dict(layer.named_parameters())
    x = torch.randn(2, 3, WIDTH)
    with config.patch(recompile_limit=2), torch.no_grad():
        for value in (0, 1):
            layer.device_index = value
            layers.call(layer, params, x, device="cuda:0")
        layer.device_index = 2
        with pytest.raises(RecompileLimitError) as info:
            layers.call(layer, params, x, device="cuda:0")
    message = str(info.value)
    assert message.startswith("compiled_DeviceIndexProbe_cuda_0_nograd reached torch._dynamo's recompile limit "
                              "(torch._dynamo.config.recompile_limit = 2, graphs held: 2)")
    assert "Raise torch._dynamo.config.recompile_limit before fit" in message
    assert "set compile_layers=False" in message
    assert seen["graphs"] == 2 and seen["compiled calls"] == 2
    assert layers.graphs() == {"compiled_DeviceIndexProbe_cuda_0_nograd": 2} and layers.recompiles() == 1
    assert config.fail_on_recompile_limit_hit is False  # set only while our calls run


@pytest.mark.timeout(120)
def test_the_step_metrics_report_the_graphs_recompiles_and_compile_seconds(monkeypatch):
    """Under the strategy with compiled layers (dynamo's real caches, the counting backend), each step logs
    ``roundpipe/compile/*``. One stage of 2 identical blocks each way: the forward runs without grad, the
    backward stage recomputes its first block with grad and takes the early-stop vjp of its last: one graph
    for each of the three compiled callables on the CPU device, nothing recompiled over 2 steps of one shape."""
    from lightning_roundpipe.engine import compiled_layers, early_stop, task_work

    counting_compile(monkeypatch)
    fresh_layers, fresh_vjps = compiled_layers.CompiledLayers(), early_stop.EarlyStopBackward()
    for module, name, value in ((task_work, "COMPILED_LAYERS", fresh_layers), (compiled_layers, "COMPILED_LAYERS",
                                fresh_layers), (task_work, "EARLY_STOP", fresh_vjps),
                                (early_stop, "EARLY_STOP", fresh_vjps)):
        monkeypatch.setattr(module, name, value)
    trainer, _ = fit(BlocksModule(), RoundPipeStrategy(**compiled()), devices=2, max_steps=2)
    logged = {k: float(v) for k, v in trainer.logged_metrics.items() if k.startswith("roundpipe/compile/")}
    assert fresh_layers.graphs() == {"compiled_Sequential_cpu_nograd": 1, "compiled_Sequential_cpu_grad": 1}
    assert fresh_vjps.graphs() == {"early_stop_Sequential_cpu_grad": 1}
    assert logged["roundpipe/compile/graphs"] == 3
    assert logged["roundpipe/compile/recompiles"] == 0
    assert logged["roundpipe/compile/compile_seconds"] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_inductor_compiles_a_graph_per_device_key_that_matches_eager():
    """The same as the eight-GPU test with inductor itself (no counting backend) on three device keys: one graph
    per key, none recompiled, each output equal to the eager layer's within fp32 rounding."""
    from lightning_roundpipe.engine.compiled_layers import CompiledLayers

    layers, layer = CompiledLayers(), DeviceIndexProbe()
    params = dict(layer.named_parameters())
    x = torch.randn(2, 3, WIDTH)
    with torch.no_grad():
        for index in range(3):
            layer.device_index = index
            torch.testing.assert_close(layers.call(layer, params, x, device=f"cuda:{index}"), layer(x),
                                       rtol=1e-6, atol=1e-6)
    assert layers.graphs() == {f"compiled_DeviceIndexProbe_cuda_{i}_nograd": 1 for i in range(3)}
    assert layers.recompiles() == 0


class StepMetricsSeen(L.Callback):
    """The runtime's metrics of each step, as the step-metrics callback logs them."""

    def __init__(self):
        self.steps, self.measured = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(dict(trainer.strategy.runtime.last_metrics))
        self.measured.append(len(trainer.strategy.runtime.engine.measurements))


@pytest.mark.slow  # a real compile past a short timeout, about 13 s
@pytest.mark.timeout(120)
def test_compiles_longer_than_the_timeout_count_against_no_wait_nor_the_steps_time(monkeypatch):
    """Each graph's compile takes 4 s (a dynamo backend that sleeps, then runs the graph as is) under a 2 s
    ``timeout`` (not 1 s: on this shared 2-core machine a loaded second is not unheard of): the first step compiles 3 graphs (forward without grad, recompute with grad, the early-stop
    vjp), each inside a task the host and the next tasks wait for. The fit completes with the weights of the
    eager run, bit for bit, and the first step reports the compile seconds apart from its time and gives the
    planner no stage times. (Before the
    compile clock, the first step failed with a PipelineTimeout after 2 s.)"""
    from lightning_roundpipe.engine import compiled_layers, early_stop, task_work

    real_compile = torch.compile
    compiles = []

    def slow_backend(graph_module, example_inputs):
        compiles.append(graph_module)
        time.sleep(4.0)
        return graph_module.forward

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(fn, backend=slow_backend))
    fresh_layers, fresh_vjps = compiled_layers.CompiledLayers(), early_stop.EarlyStopBackward()
    for module, name, value in ((task_work, "COMPILED_LAYERS", fresh_layers), (compiled_layers, "COMPILED_LAYERS",
                                fresh_layers), (task_work, "EARLY_STOP", fresh_vjps),
                                (early_stop, "EARLY_STOP", fresh_vjps)):
        monkeypatch.setattr(module, name, value)
    eager = BlocksModule("adamw")
    fit(eager, RoundPipeStrategy(**compiled(compile_layers=False)), devices=2, max_steps=2)
    m, seen = BlocksModule("adamw"), StepMetricsSeen()
    fit(m, RoundPipeStrategy(**compiled(timeout=2.0)), devices=2, max_steps=2, callbacks=[seen])
    assert len(compiles) == 3
    assert all(torch.equal(a, b) for a, b in zip(weights(m).values(), weights(eager).values()))
    first, second = seen.steps
    assert first["compile_s"] >= 3 * 4.0 and second["compile_s"] == 0.0
    assert first["step_s"] < 4.0  # one compile's length: with the compiles in it, the step took over 12 s
    assert seen.measured[0] == 0 and seen.measured[1] > 0  # the planner learns no stage time from compiles

"""Issue 43 items 3 and 4: the split-invariance check refuses, before anything runs and naming the layer,
a pipelined layer that computes something else on microbatches than on the whole batch (batch-coupled
layers of any kind, inputs whose batch is not dim 0, state written in forward), and leaves the module,
its state and the random stream as they were; it does not fire on layers that split exactly."""

import time

import pytest
import torch
from torch import nn

from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.engine.split_invariance import (FLOOR_MULTIPLE, MEASURED_FLOOR, SplitInvarianceError,
                                                         tolerance)


class MeanMix(nn.Module):
    """Batch-coupled by arithmetic: each sample minus the batch mean."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class Normalizer(nn.Module):
    """A BatchNorm by another name: normalised with the batch's statistics, running mean kept."""

    def __init__(self, width):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(width))

    def forward(self, x):
        mean = x.mean(0)
        self.running_mean.mul_(0.9).add_(0.1 * mean)
        return (x - mean) / (x.std(0) + 1e-5)


class CallCounter(nn.Module):
    """Counts its calls in a buffer, and every second call changes nothing else: a buffer not written on
    the output path."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return x


class SeqFirstAttention(nn.Module):
    """Takes (sequence, batch, hidden): torch's default MultiheadAttention layout, batch in dim 1."""

    def __init__(self, width):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 2)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _refused(net, x, microbatches=2, **options):
    """Attach, call once, and return the refusal; asserts state and random stream untouched."""
    before, rng = _state(net), torch.get_rng_state()
    rt = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=microbatches, step_metrics=False,
                                                                **options))
    try:
        with pytest.raises(SplitInvarianceError) as err:
            net(x)
    finally:
        rt.detach()
    after = _state(net)
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    assert torch.equal(rng, torch.get_rng_state())
    assert "forward" not in vars(net)
    return str(err.value)


def _runs(net, x, microbatches=2, **options):
    rt = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=microbatches, step_metrics=False,
                                                                **options))
    try:
        return net(x)
    finally:
        rt.detach()


def test_batch_mean_layer_is_refused_naming_it():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), MeanMix(), nn.Linear(4, 1))
    msg = _refused(net, torch.randn(8, 4))
    assert msg.startswith("RuntimeOptions(split_check=True): pipelined layer 1 (`1`, MeanMix) computes a different output "
                          "on the 2 microbatches the batch is cut into (along dim 0) than on the whole batch")
    assert "use microbatches=1" in msg and "put the batch in dim 0" in msg and "module='...'" in msg
    assert "split_check=False runs it anyway (NOT exact)" in msg and msg.endswith("the weights are as they were.")


def test_a_batch_norm_by_another_name_is_refused():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), Normalizer(4), nn.Linear(4, 1))
    msg = _refused(net, torch.randn(8, 4))
    assert "pipelined layer 1 (`1`, Normalizer) computes a different output" in msg
    assert "batch_statistics='per_microbatch'" in msg


def test_input_with_the_batch_in_dim_1_is_refused():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), SeqFirstAttention(8), nn.Linear(8, 1))
    msg = _refused(net, torch.randn(6, 4, 8))  # (sequence, batch, hidden): dim 0 is the sequence
    assert "pipelined layer 1 (`1`, SeqFirstAttention) computes a different output" in msg
    assert "dim 0 of its input is not the batch" in msg


def test_a_call_counter_buffer_is_refused_and_left_as_it_was():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), CallCounter(), nn.Linear(4, 1))
    msg = _refused(net, torch.randn(8, 4), microbatches=4)
    assert "pipelined layer 1 (`1`, CallCounter) changes its state in forward (1.calls) differently when called once per " \
           "microbatch (2 calls) than once on their rows whole" in msg
    assert int(net[1].calls) == 0


def test_a_call_counter_with_one_microbatch_is_exact_and_counts_once():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), CallCounter(), nn.Linear(4, 1))
    _runs(net, torch.randn(8, 4), microbatches=1)
    assert int(net[1].calls) == 1  # the check's own calls were put back


def test_spectral_norm_power_iteration_is_refused():
    torch.manual_seed(0)
    net = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 1))
    msg = _refused(net, torch.randn(8, 4))
    assert msg.startswith("RuntimeOptions(split_check=True): pipelined layer 0 (`0`, ParametrizedLinear)") or \
        msg.startswith("RuntimeOptions(split_check=True): pipelined layer 0 (ParametrizedLinear)")
    assert "computes a different output" in msg  # its weight is divided by a norm estimate iterated per call
    assert "it also changes its state in forward (0.parametrizations.weight.0._u, 0.parametrizations.weight.0._v)" in msg


def test_split_check_false_runs_a_coupled_layer_anyway():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), MeanMix(), nn.Linear(4, 1))
    x = torch.randn(8, 4)
    whole = net(x)
    split = _runs(net, x, split_check=False)
    assert (split - whole).norm() / whole.norm() > 0.01  # what the check is for: silently different


def test_exact_layers_pass_dropout_included_and_the_random_stream_is_unchanged():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 1))
    x = torch.randn(8, 4)
    rt = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=4, step_metrics=False))
    try:
        net(x)
        report = rt.split_check.last
        assert report.rows == 4 and report.random_layers == [1]  # rows of two microbatches; dropout not compared
    finally:
        rt.detach()


def test_batch_norm_accepted_per_microbatch_is_not_refused_by_the_check():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    _runs(net, torch.randn(8, 4), batch_statistics="per_microbatch")
    assert int(net[1].num_batches_tracked) == 2  # the pipeline's own two updates, not the check's


def test_linear_stack_floor_and_the_stated_tolerance():
    """The floor the tolerance is a multiple of: whole against split of a plain Linear stack."""
    torch.manual_seed(0)
    worst = 0.0
    for width in (256, 1024):
        net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(8)])
        x = torch.randn(32, width)
        with torch.no_grad():
            whole, parts = x, list(x.tensor_split(4))
            for layer in net:
                whole, parts = layer(whole), [layer(p) for p in parts]
                worst = max(worst, float((torch.cat(parts) - whole).norm() / whole.norm()))
    assert worst <= MEASURED_FLOOR * 1.5, worst  # the floor the constant states (5.7e-7 measured)
    assert tolerance(torch.float32) == pytest.approx(FLOOR_MULTIPLE * MEASURED_FLOOR)


@pytest.mark.timeout(60)
def test_the_check_costs_about_two_forwards_of_the_checked_rows():
    """Measured cost on CPU: the first step (forward and backward) with and without the check, medians of 3
    (printed; docs/measurements.md section 16)."""
    torch.manual_seed(0)
    x = torch.randn(64, 512)

    def first_call(check):
        net = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(8)])
        rt = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=4, step_metrics=False,
                                                                    split_check=check))
        try:
            start = time.perf_counter()
            net(x).sum().backward()
            return time.perf_counter() - start, rt.split_check.last if check else None
        finally:
            rt.detach()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host check on one thread, as each CPU worker computes: stable on a loaded host
    try:
        first_call(False)  # warm-up
        without = sorted(first_call(False)[0] for _ in range(3))[1]
        with_check, report = sorted((first_call(True) for _ in range(3)), key=lambda r: r[0])[1]
    finally:
        torch.set_num_threads(threads)
    print(f"first step without the check {without * 1e3:.1f} ms, with {with_check * 1e3:.1f} ms, "
          f"the check itself {report.seconds * 1e3:.1f} ms on {report.rows} of 64 rows")
    assert report.rows == 32
    assert report.seconds < with_check


_TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=8, pad_token_id=0)


def _dynamic_rope_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**_TINY, max_position_embeddings=8,
                                        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}))


@pytest.mark.timeout(60)
def test_dynamic_rope_past_max_positions_is_refused_and_within_them_runs():
    model = _dynamic_rope_llama()
    ids = torch.randint(3, 64, (4, 12))  # 12 > max_position_embeddings=8: forward rescales inv_freq
    rotary = model.model.rotary_emb
    inv_freq, before = rotary.inv_freq, _state(model)
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2))
    try:
        # before: it trained with the host inv_freq unscaled after fit (error 0.069), no warning
        with pytest.raises(SplitInvarianceError) as err:
            model(input_ids=ids, labels=ids)
        assert rotary.inv_freq is inv_freq and rotary.max_seq_len_cached == 8  # the check put everything back
        short = model(input_ids=ids[:, :8], labels=ids[:, :8]).loss  # within the cached length: nothing changes
    finally:
        runtime.detach()
    msg = str(err.value)
    assert msg.startswith("RuntimeOptions(split_check=True): pipelined layer 0 (`model.embed_tokens`, Embedding) "
                          "replaces its buffer model.rotary_emb.inv_freq in forward with new tensors")
    assert "dynamic RoPE scaling (rope_type 'dynamic')" in msg and "max_position_embeddings (8 tokens)" in msg
    assert all(torch.equal(v, _state(model)[k]) for k, v in before.items())
    assert short.item() == pytest.approx(_dynamic_rope_llama()(input_ids=ids[:, :8], labels=ids[:, :8]).loss.item(),
                                         rel=1e-6)


@pytest.mark.timeout(60)
def test_longrope_is_exact_and_no_longer_warned_about():
    """LongRoPE writes inv_freq in place, the same value for every microbatch: exact, so no warning."""
    import warnings

    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(**_TINY, max_position_embeddings=32, original_max_position_embeddings=8,
                                       rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                        "short_factor": [1.0, 1.1, 1.2, 1.3],
                                                        "long_factor": [2.0, 3.0, 4.0, 5.0],
                                                        "original_max_position_embeddings": 8}))
    ids = torch.randint(3, 64, (4, 12))  # longer than 8: the long factors
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # before: "pipelined layer 0 (CausalLMPrefix) updates its buffers ..."
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    finally:
        runtime.detach()
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)
    for n, p in model.named_parameters():
        assert (p.grad - want[n]).norm() <= 1e-5 * want[n].norm(), n


class DeviceOnly(nn.Module):
    """Stands for a layer whose kernel exists only on the device: it fails unless a worker lane calls it (the
    split-invariance check calls it on the host, in a thread of its own since it has a timeout)."""

    def forward(self, x):
        import re
        import threading

        if not re.fullmatch(r"roundpipe-w\d+-.+", threading.current_thread().name):
            raise RuntimeError("no host kernel")
        return x * 2


def test_a_layer_that_cannot_run_on_the_host_skips_the_check_with_a_warning():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), DeviceOnly(), nn.Linear(4, 1))
    x = torch.randn(8, 4)
    with pytest.warns(UserWarning, match=r"RuntimeOptions\(split_check=True\): pipelined layer 1 \(`1`, DeviceOnly\) "
                                         r"cannot run on the host \(RuntimeError: no host kernel\), so the "
                                         r"split-invariance check was skipped"):
        out = _runs(net, x)
    assert torch.allclose(out, net[2](net[0](x) * 2), rtol=1e-6, atol=1e-7)


class MaskWhenFlagged(nn.Module):
    """Builds a bool mask only when some row is flagged (its first feature negative), else None: as HF builds
    no attention mask for rows without padding."""

    def forward(self, x):
        flagged = x[:, :1] < 0
        return x, (flagged.expand_as(x).clone() if bool(flagged.any()) else None)


class ApplyMask(nn.Module):
    """Zeroes the masked entries; ``coupled`` also subtracts the batch mean (batch-coupled)."""

    def __init__(self, coupled=False):
        super().__init__()
        self.coupled = coupled

    def forward(self, carry):
        x, mask = carry
        x = x if mask is None else x.masked_fill(mask, 0.0)
        return x - x.mean(0, keepdim=True) if self.coupled else x


def _flagged_rows_in_the_first_microbatch_only():
    torch.manual_seed(0)
    x = torch.randn(8, 4).abs()
    x[1, 0] = -1.0  # rows 0-3 (microbatch 1) hold a flagged row, rows 4-7 (microbatch 2) none
    return x


def test_a_mask_built_for_some_microbatches_only_is_not_a_difference():
    """Regression (JetMoE with router logits refused at embed_tokens, 'relative difference inf, tolerance 0'):
    the whole rows get a bool mask, the unflagged microbatch None; the layers reading the mask are compared."""
    x = _flagged_rows_in_the_first_microbatch_only()
    net = nn.Sequential(MaskWhenFlagged(), ApplyMask(), nn.Linear(4, 1))
    with torch.no_grad():
        expected = net(x)
        assert torch.equal(_runs(net, x), expected)
    msg = _refused(nn.Sequential(MaskWhenFlagged(), ApplyMask(coupled=True), nn.Linear(4, 1)), x)
    assert "pipelined layer 1 (`1`, ApplyMask) computes a different output" in msg


class ScaledByBuffer(nn.Module):
    """Multiplies by a scalar buffer that autograd saves for backward (Gemma's ``embed_scale``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_a_graph_recorded_before_the_check_still_backpropagates():
    """Regression (gemma2's reference loss.backward() failed after a pipelined call: 'modified by an inplace
    operation'): the check puts back only the buffers the forward wrote, so a buffer it only read keeps its
    version."""
    torch.manual_seed(0)
    net = nn.Sequential(ScaledByBuffer(), nn.Linear(4, 1))
    x = torch.randn(8, 4)
    ref = net(x).sum()
    _runs(net, x)
    ref.backward()
    assert net[0].lin.weight.grad is not None
    counter = CallCounter()
    msg = _refused(nn.Sequential(nn.Linear(4, 4), counter), x)  # a written buffer is still put back
    assert "changes its state in forward" in msg and counter.calls.item() == 0

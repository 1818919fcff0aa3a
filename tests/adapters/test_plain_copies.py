"""Issue 43 items 7 and 8: the module after fit, deep copies during fit, and forward hooks on pipelined layers.

- peft ``target_parameters`` on a MoE's expert tensors: the frozen expert weights are parameters again
  after detach (a worker's swap had left them in ``_buffers``).
- ``copy.deepcopy`` of the pipelined module (a KL reference in ``on_fit_start``) or of the whole
  LightningModule (an EMA callback) works and gives a plain, unpipelined copy; training stays exact.
- A forward hook that keeps a pipelined layer's output is refused at its first call, before any
  weight changes, with a message saying what to do.
"""

import copy

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from _family_configs import family_batch, tiny_model
from _models import SeqModule, fit, weight_error, weights
from lightning_roundpipe import RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions
from lightning_roundpipe.errors import ForwardHookError


@pytest.mark.timeout(90)
def test_expert_tensors_targeted_by_peft_are_parameters_again_after_detach():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("qwen3_moe"), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                               target_parameters=["mlp.experts.gate_up_proj"]))
    before = dict(model.named_parameters())
    ids, mask, labels = family_batch("left")
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=3))
    try:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        moved = [n for n, p in before.items() if not any(p is q for q in dict(model.named_parameters()).values())]
        assert moved, "the case this test is for: the worker's swap leaves expert tensors in _buffers during fit"
    finally:
        runtime.detach()
    after = dict(model.named_parameters())
    assert list(after) == list(before)  # same names, same order (was 37 -> 33 in the model)
    assert all(after[n] is p for n, p in before.items())
    assert not any(n.endswith("gate_up_proj") for n, _ in model.named_buffers())


class CopyingModule(SeqModule):
    """Deep-copies its pipelined net in on_fit_start (a frozen KL reference) and uses it in the loss."""

    def on_fit_start(self):
        self.reference = [copy.deepcopy(self.net)]  # in a list: not a submodule, not trained

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            target = self.reference[0](x)
        loss = ((self.net(x) - y) ** 2).mean() + 0.1 * ((self.net(x) - target) ** 2).mean()
        return loss


class EmaCopy(L.Callback):
    """Deep-copies the whole LightningModule after every batch."""

    def __init__(self):
        self.copies = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.copies.append(copy.deepcopy(pl_module))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.timeout(120)
def test_deep_copies_during_fit_are_plain_and_training_stays_exact(opt):
    torch.manual_seed(0)
    ref, got = CopyingModule(opt=opt), CopyingModule(opt=opt)
    got.load_state_dict(ref.state_dict())
    w0 = weights(ref)
    ref_ema, got_ema = EmaCopy(), EmaCopy()
    fit(ref, "auto", max_steps=3, callbacks=[ref_ema], record_grads=False)
    # before: TypeError: cannot pickle '_thread.lock' object (HF model), or a copy still pipelined (nn.Sequential)
    fit(got, RoundPipeStrategy(microbatches=2, overlap_optimizer=True), devices=2, max_steps=3, callbacks=[got_ema],
        record_grads=False)
    assert weight_error(weights(got), weights(ref), w0) <= 1e-4
    assert "forward" not in vars(got.reference[0]) and "__deepcopy__" not in vars(got.reference[0])
    for mine, theirs in zip(got_ema.copies, ref_ema.copies):
        assert "forward" not in vars(mine.net)  # plain: runs on the host, no pool
        assert not any(a is b for a in mine.parameters() for b in got.parameters())  # its own tensors
        for (n, a), (_, b) in zip(mine.named_parameters(), theirs.named_parameters()):
            assert (a - b).norm() <= 1e-4 * max(b.norm(), 1e-6), n  # the weights of that step, after its update
    x = torch.randn(4, 8)
    assert torch.equal(got_ema.copies[-1].net(x), got.net(x))  # the last copy is the trained net


@pytest.mark.timeout(90)
def test_deep_copy_of_a_pipelined_causal_lm_is_a_plain_model():
    model = tiny_model("llama")
    ids, mask, labels = family_batch("right")
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2))
    try:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        twin = copy.deepcopy(model)  # before: TypeError: cannot pickle '_thread.lock' object
        assert "forward" in vars(model) and "forward" not in vars(twin)
        assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), model.parameters()))
    finally:
        runtime.detach()
    with torch.no_grad():
        assert torch.equal(twin(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids, attention_mask=mask).logits)


class KeptActivation(SeqModule):
    """Keeps a pipelined layer's output through a forward hook and adds a penalty on it to the loss."""

    def __init__(self):
        super().__init__()
        self.kept = []
        self.net[1].register_forward_hook(lambda module, args, out: self.kept.append(out))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.kept.clear()
        out = self.net(x)
        return ((out - y) ** 2).mean() + 0.01 * sum((k ** 2).mean() for k in self.kept)


@pytest.mark.timeout(60)
def test_a_forward_hook_that_keeps_an_output_is_refused_before_any_weight_changes():
    m = KeptActivation()
    before = weights(m)
    # before: RuntimeError: Trying to backward through the graph a second time
    with pytest.raises(ForwardHookError) as err:
        fit(m, RoundPipeStrategy(microbatches=2), devices=2, max_steps=2, record_grads=False)
    msg = str(err.value)
    assert "a forward hook (KeptActivation.__init__.<locals>.<lambda>) on pipelined layer 1 (Sequential) keeps the " \
           "layer's output" in msg
    assert "Return what you need from the model's forward instead" in msg and msg.endswith("as they were.")
    assert all(torch.equal(v, weights(m)[k]) for k, v in before.items())
    assert not any("GuardedHook" in type(h).__name__ for h in m.net[1]._forward_hooks.values())  # given back


@pytest.mark.parametrize("hook", ["replaces", "edits in place", "keeps a detached copy"])
def test_a_forward_hook_that_does_not_keep_the_output_is_run_and_kept_as_registered(hook):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    seen = []
    hooks = {"replaces": lambda module, args, out: out * 2,
             "edits in place": lambda module, args, out: out.mul_(2),  # returns the output itself
             "keeps a detached copy": lambda module, args, out: seen.append(out.detach() * 2) or out.mul_(2)}
    handle = net[0].register_forward_hook(hooks[hook])
    x = torch.randn(8, 4)
    want = net(x)
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    try:
        assert torch.allclose(net(x), want, rtol=1e-6, atol=1e-7)
    finally:
        runtime.detach()
    assert list(net[0]._forward_hooks.values())[0].__name__ == "<lambda>"
    handle.remove()
    assert not net[0]._forward_hooks

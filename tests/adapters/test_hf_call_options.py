"""Call options of a Hugging Face model through the pipeline, each against the model's own forward.

Packed ``position_ids`` (masks as the forward builds them for its ``use_cache``), ``num_items_in_batch``,
the last hidden state under a value head, ``logits_to_keep``, sequence and token classifiers; and the
options that cannot come back (``output_attentions``, hidden states other than the last) refused
before the call, with nothing changed.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification,
                          LlamaConfig, Qwen3Config)

from _exact_models import GRAD_TOL, WEIGHT_TOL, parity
from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.adapters.hf_outputs import HiddenStatesNotReturnedError

VOCAB, PAD, ROWS, SEQ = 64, 0, 6, 12


def config(arch: str, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=64, pad_token_id=PAD,
                  tie_word_embeddings=False, attn_implementation="sdpa", **extra)
    return Qwen3Config(**common) if arch == "qwen3" else LlamaConfig(**common)


def tiny(arch: str = "qwen3", auto=AutoModelForCausalLM, seed: int = 0, **extra):
    torch.manual_seed(seed)
    return auto.from_config(config(arch, **extra))


def padded_batch(seed: int = 1, padding: str = "right"):
    """ids with the pad token where the mask is 0 (so a sequence classifier finds each row's last token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    mask = torch.ones_like(ids)
    if padding == "right":
        mask[1, 8:] = 0
        mask[3, 5:] = 0
    else:
        mask[1, :4] = 0
        mask[4, :6] = 0
    ids[mask == 0] = PAD
    labels = ids.clone()
    labels[0, :3] = -100
    labels[mask == 0] = -100
    return ids, mask, labels


PACKED_POSITIONS = torch.cat([torch.arange(5), torch.arange(7)]).expand(ROWS, -1)  # two sequences per row


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def worst(g: dict, g_ref: dict) -> float:
    assert g.keys() == g_ref.keys() and g_ref
    return max(((g[k] - g_ref[k]).norm() / g_ref[k].norm()).item() for k in g_ref)


def pipelined_and_reference(model, call, microbatches: int = 2):
    """(output, grads) of ``call(model)`` pipelined and unpipelined; ``call`` returns (output, objective)."""
    out_ref, objective = call(model)
    objective.backward()
    g_ref = grads(model)
    model.zero_grad(set_to_none=True)
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=microbatches))
    try:
        out, objective = call(model)
        objective.backward()
        runtime.join()
    finally:
        runtime.detach()
    g = grads(model)
    model.zero_grad(set_to_none=True)
    return (out, g), (out_ref, g_ref)


def weights_after_sgd(make_model, call, pipelined: bool, steps: int = 3) -> tuple[dict, dict]:
    """(initial, final) weights of ``steps`` SGD steps on ``call(model)[1]``, pipelined or not."""
    model = make_model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2)) if pipelined else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for _ in range(steps):
            optimizer.zero_grad()
            call(model)[1].backward()
            if runtime is not None:
                runtime.join()
            optimizer.step()
    finally:
        if runtime is not None:
            runtime.detach()
    return start, {n: p.detach().clone() for n, p in model.named_parameters()}


def sgd_weight_error(make_model, call) -> float:
    """Worst ||w - w_ref|| / ||w_ref - w0|| after 3 SGD steps, pipelined against the model itself."""
    start, reference = weights_after_sgd(make_model, call, pipelined=False)
    _, pipelined = weights_after_sgd(make_model, call, pipelined=True)
    moved = [k for k in reference if (reference[k] - start[k]).norm() > 0]
    assert moved
    return max(((pipelined[k] - reference[k]).norm() / (reference[k] - start[k]).norm()).item() for k in moved)


# item 4: packed sequences -------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_cache", ["absent", False, True, "checkpointing"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_packed_position_ids_get_the_models_own_masks(arch, use_cache):
    """No attention_mask and positions restarting mid-row: the model's forward detects the packing only
    without a cache (use_cache=False, or gradient checkpointing in training); the pipeline does the same."""
    model = tiny(arch)
    model.train()
    if use_cache == "checkpointing":
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    ids, _, labels = padded_batch()
    ids = ids.clamp_min(1)
    kwargs = {} if use_cache in ("absent", "checkpointing") else {"use_cache": use_cache}

    def call(m):
        out = m(input_ids=ids, position_ids=PACKED_POSITIONS, labels=labels, **kwargs)
        return out, out.loss

    (out, g), (ref, g_ref) = pipelined_and_reference(model, call)
    assert abs(out.loss.item() / ref.loss.item() - 1) <= 1e-6
    assert worst(g, g_ref) <= GRAD_TOL
    if use_cache in ("absent", False):  # the calls whose masks the pipeline builds (use_cache=True runs on the host)
        assert sgd_weight_error(lambda: tiny(arch), call) <= WEIGHT_TOL
    # the two mask kinds really differ on this batch, so the test would see the wrong one
    with torch.no_grad():
        packed = tiny(arch)(input_ids=ids, position_ids=PACKED_POSITIONS, labels=labels, use_cache=False).loss
        plain = tiny(arch)(input_ids=ids, position_ids=PACKED_POSITIONS, labels=labels, use_cache=True).loss
    assert abs(packed.item() / plain.item() - 1) > 1e-4


# item 5: num_items_in_batch -----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_num_items_in_batch_divides_the_fused_loss(arch, as_tensor):
    model = tiny(arch)
    ids, mask, labels = padded_batch()
    items = 2 * int((labels[:, 1:] != -100).sum())  # as over two accumulated batches
    items = torch.tensor(items) if as_tensor else items

    def call(m):
        out = m(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=items)
        return out, out.loss

    (out, g), (ref, g_ref) = pipelined_and_reference(model, call)
    assert abs(out.loss.item() / ref.loss.item() - 1) <= 1e-6
    assert worst(g, g_ref) <= GRAD_TOL
    assert sgd_weight_error(lambda: tiny(arch), call) <= WEIGHT_TOL


# item 9: the last hidden state, logits_to_keep ----------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("selection", [True, -1, [3]])
@pytest.mark.parametrize("with_labels", [False, True])
def test_value_head_on_the_last_hidden_state_gets_exact_gradients(with_labels, selection):
    model = tiny("qwen3")
    torch.manual_seed(5)
    value_head = nn.Linear(16, 1)
    ids, mask, labels = padded_batch()
    returns = torch.randn(ROWS, SEQ)

    def call(m):
        kwargs = {"labels": labels} if with_labels else {}
        out = m(input_ids=ids, attention_mask=mask, output_hidden_states=selection, **kwargs)
        values = value_head(out.hidden_states[-1]).squeeze(-1)
        objective = ((values - returns) ** 2 * mask).mean()
        objective = objective + (out.loss if with_labels else out.logits.float().logsumexp(-1).mean())
        return out, objective

    (out, g), (ref, g_ref) = pipelined_and_reference(model, call)
    assert len(out.hidden_states) == len(ref.hidden_states) == 4
    assert torch.allclose(out.hidden_states[-1], ref.hidden_states[-1], atol=1e-6)
    if selection is not True:  # a selection returns what transformers returns: None where not selected
        assert out.hidden_states[:-1] == ref.hidden_states[:-1] == (None, None, None)
    assert worst(g, g_ref) <= GRAD_TOL
    value_head.zero_grad()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keep", [4, "positions", "mask"])
def test_logits_to_keep_returns_the_kept_positions(keep):
    model = tiny("llama")
    ids, mask, _ = padded_batch()
    keep = {"positions": torch.tensor([0, 5, 11]), "mask": mask.bool()}.get(keep, keep)

    def call(m):
        out = m(input_ids=ids, attention_mask=mask, logits_to_keep=keep)
        return out, out.logits.float().pow(2).mean()

    (out, g), (ref, g_ref) = pipelined_and_reference(model, call)
    assert out.logits.shape == ref.logits.shape != (ROWS, SEQ, VOCAB)
    assert torch.allclose(out.logits, ref.logits, atol=1e-6)
    assert worst(g, g_ref) <= GRAD_TOL


# item 9: sequence and token classifiers -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("head", ["sequence", "token"])
def test_classifier_heads_match_the_model(head, padding):
    auto = AutoModelForSequenceClassification if head == "sequence" else AutoModelForTokenClassification
    model = tiny("qwen3", auto, num_labels=3, classifier_dropout=0.0)
    ids, mask, token_labels = padded_batch(padding=padding)
    labels = (torch.tensor([0, 2, 1, 1, 0, 2]) if head == "sequence"
              else torch.where(token_labels < 0, token_labels, token_labels % 3))

    def call(m):
        out = m(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=-1)
        return out, out.loss

    (out, g), (ref, g_ref) = pipelined_and_reference(model, call)
    assert out.logits.shape == ref.logits.shape
    assert torch.allclose(out.logits, ref.logits, atol=1e-6)
    assert abs(out.loss.item() / ref.loss.item() - 1) <= 1e-6
    assert torch.allclose(out.hidden_states[-1], ref.hidden_states[-1], atol=1e-6)
    assert worst(g, g_ref) <= GRAD_TOL


# item 9: under the Lightning Trainer, against the default strategy --------------------------------------------------


class ValueHeadModule(L.LightningModule):
    """The RLHF pattern: the LM loss plus a value head on ``hidden_states[-1]``."""

    def __init__(self, opt: str):
        super().__init__()
        self.model = tiny("qwen3")
        torch.manual_seed(3)
        self.value_head = nn.Linear(16, 1)
        self.opt = opt

    def training_step(self, batch, batch_idx):
        ids, mask, labels, returns = batch
        out = self.model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
        values = self.value_head(out.hidden_states[-1]).squeeze(-1)
        return out.loss + ((values - returns) ** 2 * mask).mean()

    def configure_optimizers(self):
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)


class ClassifierModule(L.LightningModule):
    """A reward model (sequence classifier) or a token classifier trained on its own loss."""

    def __init__(self, head: str, opt: str):
        super().__init__()
        auto = AutoModelForSequenceClassification if head == "sequence" else AutoModelForTokenClassification
        self.model = tiny("llama", auto, num_labels=1 if head == "sequence" else 3, classifier_dropout=0.0)
        self.opt = opt

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss

    configure_optimizers = ValueHeadModule.configure_optimizers


def _data(case: str):
    ids, mask, labels = padded_batch(padding="left" if case == "sequence" else "right")
    if case == "value":
        return TensorDataset(ids, mask, labels, torch.randn(ROWS, SEQ, generator=torch.Generator().manual_seed(2)))
    if case == "sequence":  # a reward model: one score per row, MSE (num_labels=1)
        return TensorDataset(ids, mask, torch.randn(ROWS, generator=torch.Generator().manual_seed(2)))
    return TensorDataset(ids, mask, torch.where(labels < 0, labels, labels % 3))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("case", ["value", "sequence", "token"])
def test_heads_train_like_the_default_strategy(case, opt):
    def make():
        return ValueHeadModule(opt) if case == "value" else ClassifierModule(case, opt)

    grad_error, weight_error = parity(make, max_steps=3, data=_data(case), batch_size=ROWS)
    assert grad_error <= GRAD_TOL
    assert weight_error <= WEIGHT_TOL


# refusals -----------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs, message", [
    ({"output_attentions": True}, r"cannot return output_attentions=True: the attention weights of every layer stay"),
    ({"output_hidden_states": [0, -1]}, r"cannot return output_hidden_states=\[0, -1\]: only the last hidden state"),
    ({"output_hidden_states": 1}, r"cannot return output_hidden_states=1: only the last hidden state"),
    ({"logits_to_keep": 4, "labels": "labels"}, r"takes logits_to_keep without labels only"),
])
def test_what_cannot_come_back_is_refused_before_the_call(kwargs, message):
    model = tiny("qwen3")
    ids, mask, labels = padded_batch()
    kwargs = {k: labels if v == "labels" else v for k, v in kwargs.items()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2))
    try:
        with pytest.raises(ValueError, match=message):
            model(input_ids=ids, attention_mask=mask, **kwargs)
        assert runtime.engine.last_run is None  # nothing was run
    finally:
        runtime.detach()
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())


@pytest.mark.timeout(60)
def test_reading_another_hidden_state_names_the_option():
    model = tiny("qwen3")
    ids, mask, _ = padded_batch()
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2))
    try:
        with torch.no_grad():
            hidden_states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    finally:
        runtime.detach()
    assert len(hidden_states) == 4 and hidden_states[-1].shape == (ROWS, SEQ, 16)
    message = (r"hidden_states\[0\] is not returned by the RoundPipe pipeline: only the last hidden state .* Pass "
               r"output_hidden_states=-1")
    with pytest.raises(HiddenStatesNotReturnedError, match=message):
        hidden_states[0]
    with pytest.raises(HiddenStatesNotReturnedError, match=r"hidden_states\[0\]"):
        list(hidden_states)


@pytest.mark.timeout(60)
def test_a_classifier_with_its_own_forward_is_refused_by_name():
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from lightning_roundpipe.adapters.hf_causal_lm import UnsupportedModelError

    model = GPT2ForSequenceClassification(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=VOCAB, pad_token_id=PAD,
                                                     bos_token_id=1, eos_token_id=2))
    with pytest.raises(UnsupportedModelError, match=r"GPT2ForSequenceClassification is a classifier with its own "
                                                    r"forward, which RoundPipe does not pipeline"):
        RoundPipeRuntime.attach(model, "cpu", 2)
    assert "forward" not in vars(model)  # left as it was

"""Layer 0 builds HF's masks without reading a tensor value (a device sync per mask on a GPU).

The facts HF's builders read (does a row pad, do positions restart) come from the host as
``HostRows``; the masks must be HF's own, bit for bit, microbatch by microbatch. A read is a
call of ``Tensor.__bool__``/``item``/``__int__``/``__float__``/``tolist`` during the prefix's
forward: on a GPU each would wait for the device.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from _family_configs import family_batch, tiny_model
from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.adapters.hf_causal_lm import CausalLMLayers
from lightning_roundpipe.adapters.hf_layers import MASK_KEY_BY_ATTENTION, CausalLMPrefix
from lightning_roundpipe.adapters.mask_facts import FACT_KEYS, host_facts
from lightning_roundpipe.engine.microbatch import HostRows, split_microbatches

READS = ("__bool__", "item", "__int__", "__float__", "tolist")


@contextlib.contextmanager
def counted_reads(monkeypatch, only: threading.local | None = None):
    """Count the calls that read a tensor's value into Python (``only``: on threads where ``only.on``)."""
    counts = {"n": 0}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            if only is None or getattr(only, "on", False):
                counts["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    try:
        yield counts
    finally:
        monkeypatch.undo()


def _batches():
    ids, mask, _ = family_batch("right")  # rows 1 and 3 padded: microbatches 0 and 1 pad, 2 does not
    plain = torch.arange(ids.shape[1]).expand(ids.shape[0], -1).clone()
    packed = plain.clone()
    packed[2, 6:] = torch.arange(ids.shape[1] - 6)  # row 2 holds two sequences
    return {
        "padded mask": {"input_ids": ids, "attention_mask": mask},
        "all-ones mask": {"input_ids": ids, "attention_mask": torch.ones_like(mask)},
        "no mask": {"input_ids": ids},
        "plain positions": {"input_ids": ids, "position_ids": plain},
        "packed positions": {"input_ids": ids, "position_ids": packed},
        "padded mask and packed positions": {"input_ids": ids, "attention_mask": mask, "position_ids": packed},
    }


def _masks(out: dict):
    return {k: out.get(k) for k in MASK_KEY_BY_ATTENTION.values()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family,attn", [("qwen3", "sdpa"), ("mistral", "sdpa"), ("gemma2", "eager"), ("qwen3", "eager")])
def test_layer0_masks_equal_hfs_without_reading_a_tensor_value(monkeypatch, family, attn):
    prefix = CausalLMLayers.from_model(tiny_model(family, attn=attn)).layers[0]
    for name, batch in _batches().items():
        for with_cache in (False, True):
            batch = dict(batch, **({"with_cache": True} if with_cache else {}))
            facts = host_facts(batch.get("attention_mask"), batch.get("position_ids"))
            for mb, fact_mb in zip(split_microbatches(batch, 3), split_microbatches(dict(batch, **facts), 3)):
                expected = prefix(mb)  # HF's builders as the model's forward calls them
                with counted_reads(monkeypatch) as reads:
                    got = prefix(fact_mb)
                where = f"{name}, with_cache={with_cache}, rows {fact_mb.get(FACT_KEYS[0], fact_mb.get(FACT_KEYS[1]))}"
                for key, want in _masks(expected).items():
                    have = _masks(got)[key]
                    assert (want is None) == (have is None), where
                    if want is not None:
                        assert torch.equal(want, have), where
                assert torch.equal(got["hidden"], expected["hidden"]), where
                packed_read = (name == "packed positions" and not with_cache
                               and not all(fact_mb[FACT_KEYS[1]].rows))
                if not packed_read:  # packed rows keep HF's path (its packed test reads the positions)
                    assert reads["n"] == 0, where


@pytest.mark.timeout(60)
def test_without_host_facts_hfs_builders_read_the_mask(monkeypatch):
    """What the facts remove: HF's sdpa builder reads the mask once per mask kind (a sync per microbatch)."""
    prefix = CausalLMLayers.from_model(tiny_model("qwen3", attn="sdpa")).layers[0]
    ids, mask, _ = family_batch("right")
    with counted_reads(monkeypatch) as reads:
        prefix({"input_ids": ids, "attention_mask": mask})
    assert reads["n"] >= 2  # full and sliding masks: each reads whether every token is kept


def test_host_rows_split_with_the_batch_and_count_as_its_rows():
    batch = {"x": torch.arange(5).unsqueeze(1), "facts": HostRows([True, False, True, True, False])}
    parts = split_microbatches(batch, 2)
    assert [p["facts"].rows for p in parts] == [[True, False, True], [True, False]]
    assert [p["x"].flatten().tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="disagree on dim 0"):
        split_microbatches({"x": torch.zeros(4, 1), "facts": HostRows([True] * 5)}, 2)


def test_facts_are_not_taken_from_tensors_on_a_device():
    meta = torch.ones(2, 3, device="meta")
    assert host_facts(meta, None) == {}
    assert host_facts(None, torch.zeros(2, 3, dtype=torch.long, device="meta")) == {}


@pytest.mark.timeout(60)
def test_the_pipelines_layer0_reads_no_tensor_value_and_its_loss_is_the_models(monkeypatch):
    """End to end: the runtime hands layer 0 the host facts of each microbatch (padded or not)."""
    model = tiny_model("qwen3", attn="sdpa")
    ids, mask, labels = family_batch("right")
    ref = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    inside, calls = threading.local(), []
    forward = CausalLMPrefix.forward

    def watched(self, carry):
        calls.append(sorted(k for k in FACT_KEYS if k in carry))
        inside.on = True
        try:
            return forward(self, carry)
        finally:
            inside.on = False

    monkeypatch.setattr(CausalLMPrefix, "forward", watched)
    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=3))
    try:
        with counted_reads(monkeypatch, inside) as reads:
            with torch.no_grad():
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    finally:
        rt.detach()
    # the split check (split_check, on by default, b598225) first calls layer 0 on the host three times (the
    # first two microbatches' rows whole, then each), then the pipeline once per microbatch: all six read
    # the host facts, and none reads a tensor value (reads below counts them all)
    assert calls == [[FACT_KEYS[0]]] * (3 + 3)
    assert reads["n"] == 0
    assert abs(loss.item() / ref.item() - 1) <= 1e-6

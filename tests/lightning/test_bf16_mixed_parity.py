"""Issue 43, item 5: RoundPipe's bf16-mixed is Lightning's bf16-mixed.

Parameters that autocast keeps in fp32 (the embedding table, norm weights) are uploaded in fp32,
so the first layer's output stays fp32 as under autocast; trainable parameters uploaded in bf16
become fp32 leaves on the worker, so microbatch gradients add up in fp32. The bound is twice the
floor measured here: Lightning's bf16-mixed against itself, the loss summed from three
microbatches against one batch. Measured on this machine (tiny Llama, 3 microbatches, 2 workers;
``lm_floor`` and ``lm_error`` of tests/_lm_parity.py):

| optimizer, steps | floor | 2x floor | RoundPipe before | after | bf16 downloads |
|---|---|---|---|---|---|
| SGD, 1 | 2.60e-3 | 5.21e-3 | 1.68e-2 | 2.60e-3 | 3.46e-3 |
| SGD, 3 | 1.22e-2 | 2.45e-2 | 2.03e-2 | 1.22e-2 | 1.02e-2 |
| AdamW, 1 | 8.82e-2 | 1.76e-1 | 1.98e-1 | 8.82e-2 | 8.82e-2 |
| AdamW, 3 | 4.22e-2 | 8.44e-2 | 9.66e-2 | 4.22e-2 | 4.22e-2 |

(before: bf16 embedding table, norms, first-layer output and gradient sums. bf16 downloads: each
stage's fp32 sum of a bf16 upload's gradient rounded to bf16 once before its download, as each
backward call of Lightning's bf16-mixed adds one bf16 gradient; tests/engine/test_bf16_gradient_downloads.py.)
"""

import pytest
import torch

from _family_configs import tiny_model
from _lm_parity import STEPS, lm_error, lm_floor
from lightning_roundpipe.params.shadows import ShadowStore, autocast_cast_parameters


def _case(opt, steps):
    make = lambda: tiny_model("llama")  # noqa: E731
    floor = lm_floor(make, opt, steps=steps, precision="bf16-mixed")
    assert floor > 0
    err = lm_error(make, opt, steps=steps, precision="bf16-mixed")
    assert err <= 2 * floor, f"bf16-mixed error {err:.3g} against Lightning's, floor {floor:.3g}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_bf16_mixed_matches_lightnings_within_twice_the_floor(opt):
    _case(opt, steps=1)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_bf16_mixed_matches_lightnings_over_three_steps(opt):
    _case(opt, steps=STEPS)


def test_only_what_autocast_casts_is_uploaded_in_bf16():
    model = tiny_model("gemma")  # tied head: the embedding table is also lm_head's weight
    cast = autocast_cast_parameters([model])
    names = {n for n, p in model.named_parameters() if id(p) in cast}
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.mlp.down_proj.weight" in names
    assert not any("norm" in n or "embed" in n for n in names)  # norms, the (tied) embedding stay fp32
    store = ShadowStore.for_uploads(list(model.parameters()), [model], torch.bfloat16, staleness=0)
    assert {id(s) for s in map(store.get, model.parameters()) if s.dtype == torch.bfloat16} == {
        id(store.get(p)) for p in model.parameters() if id(p) in cast}
    embed = model.model.embed_tokens.weight
    assert store.get(embed) is embed  # uploaded as the fp32 master

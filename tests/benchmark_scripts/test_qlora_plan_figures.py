"""Smoke test of benchmarks/figures/qlora_plan.py --quick: the upload table of a Qwen3-8B shape (bf16 LoRA
against QLoRA on one plan) and the Qwen3-235B-A22B QLoRA verdict on 256 GB."""

import re

import pytest

from benchmarks.figures import qlora_plan
from lightning_roundpipe.cost.quantization import nf4_bytes_per_param, packed_params_per_layer
from lightning_roundpipe.cost.transformer import get_model_shape


@pytest.mark.timeout(100)
def test_quick_run_prints_the_upload_saving_of_the_formula_and_the_235b_verdict():
    text = qlora_plan.main(["--quick"])
    rows = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in
            re.finditer(r"^\| (bf16 LoRA r16|QLoRA r16 \(NF4\), the same plan) \| \d+F/\d+B \| ([0-9.]+) GB \| "
                        r"([0-9.]+) GB \| [0-9,]+ \|$", text, re.MULTILINE)}
    (bf16_weights, bf16_acts), (nf4_weights, nf4_acts) = rows["bf16 LoRA r16"], rows["QLoRA r16 (NF4), the same plan"]
    packed = packed_params_per_layer(get_model_shape("qwen3-8b"))
    # each of the 36 decoder layers goes up twice a step (forward, backward), packed instead of bf16
    saving = 2 * 36 * (2 * packed - round(packed * nf4_bytes_per_param())) / 1e9
    assert bf16_weights - nf4_weights == pytest.approx(saving, abs=0.1)
    assert nf4_acts == bf16_acts  # the same plan moves the same activations
    verdict = re.search(r"^qwen3-235b-a22b-qlora r16 at 8192 tokens, 8 microbatches, 256 GB host: fits "
                        r"\(least-memory plan: host ([0-9.]+) of 214.6 GiB usable, worker ([0-9.]+) GiB\)$", text, re.MULTILINE)
    assert verdict and 150 < float(verdict.group(1)) < 214.6  # 256 GB less max(10%, 8 GiB) = 214.6 GiB usable

"""Parity of block-stack models under strategy="roundpipe" against Lightning's default strategy, as a table.

The models and the runner are the tests' (tests/adapters/test_block_stack*.py); this prints the numbers they assert:
worst per-tensor gradient error after one step, worst update-relative weight error after 3 steps.

    PYTHONPATH=src python benchmarks/validation/block_stack_parity.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "..", "tests", d) for d in ("adapters", "")]  # the tests' models
warnings.filterwarnings("ignore")

from test_block_stack import AdamWTransformer, OfflineTransformer, parity  # noqa: E402
from test_block_stack_models import VOCAB, EncoderLM, LitGPT, LMModule, NanoGPT, no_dropout, token_data  # noqa: E402

CASES = [
    ("nanoGPT, tied head", "sgd", 2, lambda: LMModule(NanoGPT(), "sgd"), {}),
    ("nanoGPT, tied head", "adamw", 3, lambda: LMModule(NanoGPT(), "adamw"), {}),
    ("demo LightningTransformer (module=model.transformer.decoder)", "sgd", 2,
     lambda: no_dropout(OfflineTransformer(vocab_size=VOCAB)), {"module": "model.transformer.decoder"}),
    ("demo LightningTransformer (module=model.transformer.encoder.layers)", "adamw", 2,
     lambda: no_dropout(AdamWTransformer(vocab_size=VOCAB)), {"module": "model.transformer.encoder.layers"}),
    ("litgpt-style (rope, mask, padding)", "sgd", 2, lambda: LMModule(LitGPT(), "sgd"), {"data": token_data(pad=True)}),
    ("litgpt-style (rope, mask, padding)", "adamw", 2, lambda: LMModule(LitGPT(), "adamw"), {"data": token_data(pad=True)}),
    ("nn.TransformerEncoder LM", "adamw", 3, lambda: LMModule(EncoderLM(), "adamw"), {"microbatches": 2}),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=None, help="only the first CASES models (default: all)")
    args = parser.parse_args(argv)
    print("| model | optimizer | workers | gradient error | weight error (3 steps) | wall s |\n|---|---|---|---|---|---|")
    for name, opt, workers, make, kw in CASES[:args.cases]:
        t0 = time.perf_counter()
        g, w, _ = parity(make, workers, **kw)
        print(f"| {name} | {opt} | {workers} | {g:.1e} | {w:.1e} | {time.perf_counter() - t0:.1f} |", flush=True)


if __name__ == "__main__":
    main()

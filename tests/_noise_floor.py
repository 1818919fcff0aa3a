"""The summation-order noise floor of AdamW weights, which every AdamW weight bound is a multiple of.

Adam divides each update by the root of its second moment, so a gradient's last-bit rounding
(the order its sums run in) moves near-cancelling updates by much more than it moves the gradient.
Measured the way the bound is used: Lightning's default strategy against itself with another
summation order (a batch of 4 against 2 accumulated microbatches of 2, as the pipeline splits it),
3 AdamW steps, ``weight_error`` (worst per-tensor ||w - w_ref|| / ||w_ref - w_init||):

    python -m tests._noise_floor     # from the repository root; prints each model's floor

On the 2-core AMD EPYC development machine (no AVX-512, torch 2.13): tiny Llama 1.42e-5, tiny
Qwen3 1.71e-5 (1 against 2 threads: 0, these tensors are too small to be split). Against the same
run in float64, each fp32 order lands 4.8e-5 to 6.4e-5 from the exact weights (about 3 floors), so
two independent orders may differ by about 6 floors; RoundPipe measured 7.0 (Llama; 8.9 in issue 42's
run) and 2.5 floors (Qwen3), and is no farther from the float64 weights than the default strategy
(Llama 5.1e-5 against 4.8e-5, Qwen3 0.8e-5 against 5.0e-5): Adam's amplification, not a difference.
"""

from __future__ import annotations

ADAMW_FLOOR = 1.7e-5  # the larger of the two models' floors above (python -m tests._noise_floor)
ADAMW_FLOOR_MULTIPLE = 10  # two independent fp32 orders: up to ~6 floors measured (module doc), plus margin
ADAMW_WEIGHT_TOL = ADAMW_FLOOR_MULTIPLE * ADAMW_FLOOR


def adamw_floor(make_module, data, steps: int = 3, batch_size: int = 4) -> float:
    """Weight error of Lightning's default strategy against itself: one batch of ``batch_size`` per
    step against 2 accumulated microbatches of half that, ``steps`` optimizer steps."""
    from _models import fit, weight_error, weights

    ref = make_module()
    w0 = weights(ref)
    fit(ref, "auto", max_steps=steps, batch_size=batch_size, data=data, record_grads=False)
    split = make_module()
    fit(split, "auto", max_steps=steps, batch_size=batch_size // 2, data=data, record_grads=False,
        accumulate_grad_batches=2)
    return weight_error(weights(split), weights(ref), w0)


def main() -> dict[str, float]:
    """Each tiny Hugging Face model's floor, as ``test_hugging_face_matches_default_strategy`` trains it."""
    import sys
    import tempfile
    from pathlib import Path

    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here / "engine")]
    from test_layer_recompute import adamw_causal_lm, causal_lm_data

    floors = {}
    for arch in ("llama", "qwen3"):
        with tempfile.TemporaryDirectory() as tmp:
            floors[arch] = adamw_floor(lambda: adamw_causal_lm(arch, Path(tmp) / "model"), causal_lm_data())
        print(f"{arch}: AdamW weight floor {floors[arch]:.3g}")
    return floors


if __name__ == "__main__":
    main()

"""Achievable matmul and attention rates of a GPU, fitted to measured per-layer times.

    python -m benchmarks.calibration.kernel_rates

The reference RoundPipe artifact publishes per-layer forward and backward times measured on one
RTX 4090 with its benchmark's software (PyTorch 2.7, CUDA 12.6, flash-attention 2.8.3, fp16
with fp16 accumulation, Hugging Face eager layers, chunked compiled loss), 4 sequences of 2048
tokens per microbatch (``pp-simulate/run.sh`` and ``roundpipe-timing/run.sh`` of
github.com/ITcarrot/RoundPipe-artifact). Each time is modelled as this project's cost model
prices it (:func:`lightning_roundpipe.cost.transformer.decoder_layer_work`, ``head_work``):

    matmul FLOPs / R_matmul + attention FLOPs / R_attention + element-wise bytes / bandwidth

with the bandwidth from the datasheet, and the two rates fitted by least squares on relative
error over the 12 times (3 dense models x decoder layer and LM head x forward and backward).
Two constants per GPU, the same for every model: no per-model factor. The script prints the
rates and each time's residual; the results are recorded in ``conf/hardware/rtx4090.yaml``
and used by ``src/lightning_roundpipe/cost/profiles/rtx4090.yaml``.
"""

from __future__ import annotations

import numpy as np

from lightning_roundpipe.cost.transformer import decoder_layer_work, get_model_shape, head_work

from benchmarks.harness import cli, write_json

TOKENS = 4 * 2048  # 480 / 12 calls / 10 microbatches = 4 sequences of 2048 tokens per microbatch
# Milliseconds per microbatch, RTX 4090: FWD/BWD_TIME_PER_LAYER and LMHEAD_FWD/BWD_TIME of
# ITcarrot/RoundPipe-artifact pp-simulate/run.sh (backward excludes the recompute).
MEASURED_MS = {
    "qwen3-1.7b": dict(layer_fwd=7.429, layer_bwd=15.831, head_fwd=22.0655, head_bwd=43.707),
    "llama-3.1-8b": dict(layer_fwd=18.50370313, layer_bwd=41.20659375, head_fwd=37.2255, head_bwd=74.501),
    "qwen3-32b": dict(layer_fwd=40.5610625, layer_bwd=91.17429688, head_fwd=54.928, head_bwd=108.294),
}
# The same measurement for the two MoE models (not fitted: a check of the MoE cost model). The
# 235B run is LoRA rank 32 on all linear layers (roundpipe-timing/train_lora.py).
MEASURED_MOE_MS = {
    ("gpt-oss-20b", None): dict(layer_fwd=21.6445625, layer_bwd=81.780875, head_fwd=44.2925, head_bwd=86.264),
    ("qwen3-235b-a22b", 32): dict(layer_fwd=43.016, layer_bwd=58.376, head_fwd=42.444, head_bwd=43.294),
}
DATASHEET_BANDWIDTH = 1008e9  # RTX 4090: 384-bit GDDR6X at 21 Gbps (Ada whitepaper v1.01)


def rows(seq_len: int = 2048, measured: dict | None = None):
    """(model, kind, matmul FLOPs, attention FLOPs, bytes, measured seconds) per published time.

    ``measured``: ``{(model, lora_rank): times}`` (default: the dense models, full fine-tuning).
    """
    out = []
    for (model, rank), times in (measured or {(m, None): t for m, t in MEASURED_MS.items()}).items():
        shape = get_model_shape(model)
        layer_fwd, layer_bwd = decoder_layer_work(shape, seq_len, rank)
        head_fwd, head_bwd = head_work(shape, rank, chunked_loss=True)
        for kind, work in (("layer_fwd", layer_fwd), ("layer_bwd", layer_bwd), ("head_fwd", head_fwd),
                           ("head_bwd", head_bwd)):
            out.append((model, kind, work.matmul_flops * TOKENS, work.attention_flops * TOKENS,
                        work.memory_bytes * TOKENS, times[kind] / 1e3))
    return out


def fit(bandwidth: float = DATASHEET_BANDWIDTH):
    """Least-squares (relative error) matmul and attention rates in TFLOP/s, and the residuals."""
    data = rows()
    a = np.array([[mm / t, at / t] for _, _, mm, at, _, t in data])
    b = np.array([1.0 - (nbytes / bandwidth) / t for _, _, _, _, nbytes, t in data])
    (inv_mm, inv_attn), *_ = np.linalg.lstsq(a, b, rcond=None)
    rate_mm, rate_attn = 1 / inv_mm / 1e12, 1 / inv_attn / 1e12
    residuals = []
    for model, kind, mm, at, nbytes, t in data:
        predicted = mm * inv_mm + at * inv_attn + nbytes / bandwidth
        residuals.append((model, kind, t, predicted))
    return rate_mm, rate_attn, residuals


def check(rate_mm: float, rate_attn: float, measured: dict, bandwidth: float = DATASHEET_BANDWIDTH):
    """(model, kind, measured, modelled) seconds of ``measured`` times at the given rates."""
    return [(model, kind, t, mm / (rate_mm * 1e12) + at / (rate_attn * 1e12) + nbytes / bandwidth)
            for model, kind, mm, at, nbytes, t in rows(measured=measured)]


def main(argv: list[str] | None = None) -> None:
    parser = cli(__doc__.splitlines()[0], json_help="also write the fitted rates and residuals to this JSON file")
    parser.add_argument("--bandwidth", type=float, default=DATASHEET_BANDWIDTH, help="GPU memory bytes/s")
    args = parser.parse_args(argv)
    rate_mm, rate_attn, residuals = fit(args.bandwidth)
    print(f"achievable fp16-accumulate matmul: {rate_mm:.0f} TFLOP/s; flash attention: {rate_attn:.0f} TFLOP/s "
          f"(element-wise at {args.bandwidth / 1e9:.0f} GB/s)")
    print("| model | time | measured (ms) | modelled (ms) | error |")
    print("|---|---|---:|---:|---:|")
    for model, kind, t, p in residuals:
        print(f"| {model} | {kind} | {t * 1e3:.2f} | {p * 1e3:.2f} | {p / t - 1:+.1%} |")
    if args.json:
        write_json(args.json, {"matmul_tflops": rate_mm, "attention_tflops": rate_attn, "bandwidth_bytes_per_s": args.bandwidth,
                               "residuals": [dict(model=m, kind=k, measured_s=t, modelled_s=p) for m, k, t, p in residuals]})
    print("\nMoE layers at the same rates (not fitted):\n")
    print("| model | time | measured (ms) | modelled (ms) | error |")
    print("|---|---|---:|---:|---:|")
    for model, kind, t, p in check(rate_mm, rate_attn, MEASURED_MOE_MS, args.bandwidth):
        print(f"| {model} | {kind} | {t * 1e3:.2f} | {p * 1e3:.2f} | {p / t - 1:+.1%} |")


if __name__ == "__main__":
    main()

"""Predicted tokens/s against the GPU count, beside the reference's measured curve, as a PNG.

    python -m benchmarks.figures.scaling_plot [--hardware rtx4090] [--max-gpus 8] [--out docs/img/scaling_rtx4090.png]

Simulates the published RoundPipe workloads of Qwen3-1.7B, Llama-3.1-8B and Qwen3-32B on 1..N
GPUs (:func:`roundpipe_lab.analysis.scaling.scaling_rows`), prints the table, and draws each
model's speedup over one GPU (solid: simulated; dots: measured by the reference on RTX 4090,
where published) with the linear ideal dashed.
"""

from __future__ import annotations

import argparse

from roundpipe_lab.analysis.scaling import scaling_markdown, scaling_rows

MODELS = ("qwen3-1.7b", "llama-3.1-8b", "qwen3-32b")


def plot(rows, path: str, hardware: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.0, 3.4), dpi=90)
    counts = sorted({r.num_gpus for r in rows})
    ax.plot(counts, counts, "k--", linewidth=0.8, label="linear")
    for model, color in zip(MODELS, ("tab:blue", "tab:orange", "tab:green")):
        mine = [r for r in rows if r.model == model]
        if not mine:
            continue
        ax.plot([r.num_gpus for r in mine], [r.speedup for r in mine], "-", color=color, label=f"{model} (simulated)")
        base = mine[0].measured
        measured = [(r.num_gpus, r.measured / base) for r in mine if r.measured and base]
        if measured:
            ax.plot(*zip(*measured), "o", color=color, markersize=3.5, label=f"{model} (measured)")
    ax.set_xlabel(f"GPUs ({hardware})")
    ax.set_ylabel("speedup over 1 GPU")
    ax.set_xticks(counts)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="rtx4090")
    parser.add_argument("--max-gpus", type=int, default=8)
    parser.add_argument("--out", default="docs/img/scaling_rtx4090.png")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    args = parser.parse_args(argv)
    rows = scaling_rows(tuple(args.models), args.hardware, tuple(range(1, args.max_gpus + 1)))
    print(scaling_markdown(rows, args.hardware))
    plot(rows, args.out, args.hardware)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

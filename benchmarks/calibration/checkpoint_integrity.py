"""What checking a checkpoint's CRC-32s (``verify_checkpoints``) adds to its load time.

    python -m benchmarks.calibration.checkpoint_integrity [--gib 1.0] [--rounds 3] [--dir /tmp] [--quick]

Writes a checkpoint of ``--gib`` GiB of fp32 weights (tensors of 16 MiB, about an LLM layer's
projection) through ``AtomicCheckpointIO``, then loads it ``--rounds`` times alternately without
and with ``verify_archive`` (the page cache holds the file after the first read, so both read
from memory, as a load right after a save or of a recently copied file does) and reports the
best of each and their ratio. The issue's bar: on by default if it costs under 5% at 1 GiB.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch

from benchmarks.harness import cli, write_json
from lightning_roundpipe.lightning.checkpoint_integrity import verify_archive
from lightning_roundpipe.lightning.checkpoint_io import AtomicCheckpointIO

TENSOR_ELEMENTS = 4 << 20  # 16 MiB of fp32 per tensor


def write_checkpoint(path: str, gib: float) -> int:
    """A Lightning-like checkpoint of ``gib`` GiB of random fp32 weights at ``path``; its size in bytes."""
    count = max(1, round(gib * (1 << 30) / (TENSOR_ELEMENTS * 4)))
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(TENSOR_ELEMENTS, generator=g) for i in range(count)}
    AtomicCheckpointIO().save_checkpoint({"state_dict": state, "epoch": 0, "global_step": 1}, path)
    return os.path.getsize(path)


def measure(path: str, rounds: int) -> dict[str, float]:
    """Best seconds of a plain load, of the check alone, and of the check then the load."""
    io = AtomicCheckpointIO()
    plain, checked, check = [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        loaded = io.load_checkpoint(path)
        plain.append(time.perf_counter() - start)
        del loaded
        start = time.perf_counter()
        verify_archive(path)
        check.append(time.perf_counter() - start)
        loaded = io.load_checkpoint(path)
        checked.append(time.perf_counter() - start)
        del loaded
    return {"load_s": min(plain), "check_s": min(check), "checked_load_s": min(checked)}


def main(argv: list[str] | None = None) -> dict:
    parser = cli(__doc__.splitlines()[0], quick="a 32 MiB checkpoint, one round (a smoke test)")
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary folder)")
    args = parser.parse_args(argv)
    gib, rounds = (1 / 32, 1) if args.quick else (args.gib, args.rounds)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = os.path.join(folder, "integrity.ckpt")
        size = write_checkpoint(path, gib)
        t = measure(path, rounds)
    extra = t["checked_load_s"] / t["load_s"] - 1
    result = {"bytes": size, "rounds": rounds, "threads": torch.get_num_threads(), "loadavg": list(os.getloadavg()),
              **t, "extra_share": extra}
    print(f"checkpoint {size / 2**30:.3f} GiB: load {t['load_s']:.3f} s, CRC-32 check {t['check_s']:.3f} s, "
          f"check + load {t['checked_load_s']:.3f} s: +{extra:.1%} (best of {rounds}; load average "
          f"{result['loadavg'][0]:.2f})")
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()

"""Issue-6 figures: bytes all-reduced per step against trainable bytes, and the share of all-reduce
time overlapped with backward, from two "nodes" (two processes, 2 CPU workers each, gloo on localhost).

    python -m benchmarks.figures.multinode_overlap [--mode big|seq|lora]

The share is read from the timeline: all-reduce intervals (launch to completion, recorded by the
watcher thread) overlapped by any worker's compute, over total all-reduce time.
"""

import argparse
import tempfile
from pathlib import Path

from tests.distributed.test_multinode import run_two_nodes  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="big", choices=["big", "seq", "lora"])
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        info = run_two_nodes(args.mode, Path(d), timeout=600)
    print(f"# python -m benchmarks.figures.multinode_overlap --mode {args.mode}")
    print("| rank | trainable bytes | total bytes | bytes all-reduced per step | all-reduces | share overlapped with compute |")
    print("|---:|---:|---:|---|---:|---:|")
    for i in info:
        share = i["allreduce_hidden_share"]
        print(f"| {i['global_rank']} | {i['trainable_bytes']} | {i['total_bytes']} | {i['bytes_reduced']} | "
              f"{i['allreduce_count']} | {'n/a' if share is None else f'{100 * share:.0f}%'} |")


if __name__ == "__main__":
    main()

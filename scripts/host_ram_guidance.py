"""Write the host-RAM guidance of the configs and docs from the simulator, so it cannot disagree with it.

Every figure is what ``python -m lightning_roundpipe.plan`` prints as "Host memory: X GiB
needed" for the command written next to it (8x RTX 4090, the experiments' 4096-token sequences
and 16 microbatches). Generated text: the ``# Host RAM`` line of each ``conf/model`` and
``conf/experiment`` file named below, and the table between the ``host-ram`` markers of
``docs/finetune.md``.

    python scripts/host_ram_guidance.py          # rewrite them
    python scripts/host_ram_guidance.py --check  # exit 1 and name the stale ones (the test runs this)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARDWARE = "rtx4090"
SETTINGS = ("--seq-len", "4096", "--microbatches", "16", "--no-max-seq")
LORA_ON_RANK = 8  # conf/lora/on.yaml's r
HOST_LINE = re.compile(r"^# Host RAM.*$", re.MULTILINE)
DOC = REPO / "docs" / "finetune.md"
DOC_BEGIN, DOC_END = "<!-- host-ram begin: scripts/host_ram_guidance.py writes this table -->", "<!-- host-ram end -->"


@dataclass(frozen=True)
class ModelConf:
    """A conf/model file: its preset, and what the docs table says of it besides RAM."""

    conf: str
    preset: str
    params: str
    gpus: str


MODELS = (
    ModelConf("qwen3_0_6b", "qwen3-0.6b", "0.6B", "1+ of 8 GB"),
    ModelConf("qwen3_1_7b", "qwen3-1.7b", "1.7B", "1-8 of 16-24 GB"),
    ModelConf("qwen3_8b", "qwen3-8b", "8.2B", "8 of 24 GB"),
    ModelConf("llama3_1_8b", "llama-3.1-8b", "8.0B", "8 of 24 GB"),
)
EXPERIMENTS = {"qwen3_8b_lora_8gpu": ("qwen3-8b", 16), "llama3_1_8b_full_8gpu": ("llama-3.1-8b", None)}


def plan_command(preset: str, lora_rank: int | None) -> list[str]:
    """The ``sim plan`` arguments a figure comes from."""
    lora = ["--lora-rank", str(lora_rank)] if lora_rank else []
    return ["--model", preset, "--hardware", HARDWARE, *SETTINGS, *lora]


def shown(argv: list[str]) -> str:
    return "python -m lightning_roundpipe.plan " + " ".join(argv)


@lru_cache(maxsize=None)
def host_gib(preset: str, lora_rank: int | None) -> str:
    """The "Host memory: X GiB needed" figure ``sim plan`` prints, as printed."""
    from lightning_roundpipe.planning.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(plan_command(preset, lora_rank))
    match = re.search(r"^Host memory: ([0-9.]+ GiB) needed", out.getvalue(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no host memory line in the output of {shown(plan_command(preset, lora_rank))}")
    return match.group(1)


def model_line(m: ModelConf) -> str:
    return (f"# Host RAM (sim plan, 8x RTX 4090, 4096 tokens, 16 microbatches): {host_gib(m.preset, None)} for full "
            f"fine-tuning, {host_gib(m.preset, LORA_ON_RANK)} with lora=on (r={LORA_ON_RANK}); yours: "
            f"{shown(plan_command(m.preset, None))} [--lora-rank {LORA_ON_RANK}]")


def experiment_line(preset: str, rank: int | None) -> str:
    return f"# Host RAM: {host_gib(preset, rank)}, as printed by {shown(plan_command(preset, rank))}"


def doc_table() -> str:
    rows = ["| config | parameters | GPUs | host RAM, full / LoRA r=8 (`sim plan`, 4096 tokens, 16 microbatches) |",
            "|---|---|---|---|"]
    rows += [f"| `{m.conf}` | {m.params} | {m.gpus} | {host_gib(m.preset, None)} / {host_gib(m.preset, LORA_ON_RANK)} |"
             for m in MODELS]
    return "\n".join([DOC_BEGIN, *rows, DOC_END])


def expected_files() -> dict[Path, str]:
    """Every generated file with its text as it should be."""
    files: dict[Path, str] = {}

    def with_line(path: Path, line: str) -> None:
        text = path.read_text()
        if not HOST_LINE.search(text):
            raise RuntimeError(f"{path} has no '# Host RAM' line to write")
        files[path] = HOST_LINE.sub(lambda _: line, text, count=1)

    for m in MODELS:
        with_line(REPO / "conf" / "model" / f"{m.conf}.yaml", model_line(m))
    for name, (preset, rank) in EXPERIMENTS.items():
        with_line(REPO / "conf" / "experiment" / f"{name}.yaml", experiment_line(preset, rank))
    doc = DOC.read_text()
    start, end = doc.index(DOC_BEGIN), doc.index(DOC_END) + len(DOC_END)
    files[DOC] = doc[:start] + doc_table() + doc[end:]
    return files


def stale_files() -> list[Path]:
    return [path for path, text in expected_files().items() if path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which files differ from the simulator")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"stale host-RAM guidance: {path.relative_to(REPO)} (run python scripts/host_ram_guidance.py)")
        return 1 if stale else 0
    for path, text in expected_files().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

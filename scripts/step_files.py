"""Which package files execute during one steady training step (issue 45's readability bar).

    PYTHONPATH=src python scripts/step_files.py            # files, folders and call counts

Trains a plain ``nn.Sequential`` with ``Trainer(strategy="roundpipe")`` on the CPU backend and
records, on every thread, the ``lightning_roundpipe`` files whose functions are called between the
start and the end of one training step after a few warm-up steps. A profile hook is installed on
all threads before any is started (``threading.setprofile``), and only counts while recording.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
from pathlib import Path

import torch
from torch import nn

PACKAGE = "lightning_roundpipe"


class StepFiles:
    """Counts the package's function calls per file while ``recording``."""

    def __init__(self) -> None:
        self.recording = False
        self.calls: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def profile(self, frame, event, arg):
        if not self.recording or event != "call":
            return
        name = frame.f_code.co_filename
        marker = f"/{PACKAGE}/"
        at = name.rfind(marker)
        if at < 0:
            return
        with self.lock:
            self.calls[name[at + len(marker):]] += 1


def measure(layers: int = 8, width: int = 64, steps: int = 6, recorded_step: int = 4) -> dict:
    """Train ``steps`` steps; return the files (with call counts) that ran during ``recorded_step``."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_roundpipe  # noqa: F401  (registers the strategy)

    files = StepFiles()
    threading.setprofile(files.profile)
    sys.setprofile(files.profile)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, *_):
            files.recording = trainer.global_step == recorded_step

        def on_train_batch_end(self, trainer, *_):
            files.recording = False

    data = TensorDataset(torch.randn(steps * 16, width), torch.randn(steps * 16, width))
    trainer = pl.Trainer(strategy="roundpipe", devices=2, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()])
    try:
        trainer.fit(Module(), DataLoader(data, batch_size=16))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    folders = sorted({str(Path(f).parent) for f in files.calls})
    return {"files": dict(sorted(files.calls.items())), "file_count": len(files.calls),
            "folders": folders, "folder_count": len(folders)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    result = measure()
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for name, count in result["files"].items():
        print(f"{count:6d}  {name}")
    print(f"{result['file_count']} package files in {result['folder_count']} folders ran during one steady step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

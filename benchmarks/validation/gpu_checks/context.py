"""What every check shares: the context of a run (GPU or fake streams), thread and error helpers."""

from __future__ import annotations

import threading
import time

import torch


VERDICTS = ("pass", "fail", "skip")
TINY_QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256)

class Ctx:
    """What differs between a GPU run and the fake-stream run on the CPU, and what checks share."""

    def __init__(self, device: str, quick: bool, gpus: int | None, compile_layers: bool | None = None):
        self.cuda = device == "cuda"
        self.compile_layers = compile_layers  # for every runtime of the run (None: the backend's rule)
        self.device_assert = False  # the failures check also runs a device-side assert (its own process only)
        self.device_type = "cuda" if self.cuda else "cpu"
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.quick = quick
        visible = torch.cuda.device_count() if self.cuda and torch.cuda.is_available() else 0
        self.gpus = (min(gpus, visible) if gpus else visible) if self.cuda else (gpus or 2)
        self.cache: dict = {}  # results one check measures and a later one reads (the throughput runs)

    @property
    def backend(self) -> str:
        """The worker backend by name: "cuda", or off a GPU the lab's "fake_cuda" (imported when first asked
        for, which registers it: the environment check stays free of the library)."""
        if self.cuda:
            return "cuda"
        import roundpipe_lab  # noqa: F401

        return "fake_cuda"

    def indices(self, workers: int, shared: bool = False):
        """Device indices of ``workers`` workers: one GPU each (round-robin over the GPUs), or all on GPU 0."""
        if not self.cuda:
            return None
        return [0] * workers if shared else [i % self.gpus for i in range(workers)]

    def runtime(self, module, workers: int, shared: bool = False, **options):
        """``module`` pipelined over ``workers`` workers of this context's backend."""
        from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions

        if self.compile_layers is not None:
            options.setdefault("compile_layers", self.compile_layers)
        return RoundPipeRuntime.attach(module, self.backend, workers, RuntimeOptions(**options),
                                       device_indices=self.indices(workers, shared))

    def jitter(self, runtime, amount_s: float) -> None:
        """The race amplifier: random delays in the streams (GPU cycles on CUDA, seconds on the fake)."""
        driver = runtime.pool.driver
        if self.cuda:
            driver.jitter_cycles = int(amount_s * 1.5e9)  # about ``amount_s`` at ~1.5 GHz
        else:
            driver.jitter_s = amount_s

    def sync(self) -> None:
        """Wait for every GPU (nothing on the CPU)."""
        if self.cuda:
            for i in range(self.gpus):
                torch.cuda.synchronize(i)


def ours() -> list[str]:
    """The names of this package's threads still alive."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("roundpipe-"))


def wait_threads_gone(limit_s: float) -> list[str]:
    """Wait up to ``limit_s`` for our threads to end; the names of those left."""
    deadline = time.monotonic() + limit_s
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    return ours()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are 0)."""
    d, n = (a.float() - b.float()).norm().item(), b.float().norm().item()
    return d / n if n else d

"""fp16 matmuls accumulating in fp16 on CUDA, for one run (``fp16_accumulation=True``).

cuBLAS multiplies fp16 matrices with fp32 accumulation by default. A GeForce card (RTX 4090) runs
fp16 tensor-core matmuls with fp16 accumulation at twice that rate; the RoundPipe reference trains
that way. PyTorch exposes it as ``torch.backends.cuda.matmul.allow_fp16_accumulation``, a flag of
the process (every thread, every device), not of a stream: it is turned on when the first run that
asks for it starts and put back to what it was when the last such run ends, so code outside the
run (another model, the user's evaluation after ``fit``) computes as it did before. The flag reads
and writes without a GPU; on the CPU backend it changes no result.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_holders = 0
_before: bool | None = None


def _flag_owner():
    return torch.backends.cuda.matmul


class Fp16Accumulation:
    """One run's hold on the flag: ``release`` (idempotent) ends it."""

    def __init__(self) -> None:
        global _holders, _before
        with _lock:
            if _holders == 0:
                _before = bool(_flag_owner().allow_fp16_accumulation)
                _flag_owner().allow_fp16_accumulation = True
            _holders += 1
        self._held = True

    def release(self) -> None:
        """End this run's hold; the last one puts the flag back to what it was before the first."""
        global _holders
        with _lock:
            if not self._held:
                return
            self._held = False
            _holders -= 1
            if _holders == 0:
                _flag_owner().allow_fp16_accumulation = bool(_before)

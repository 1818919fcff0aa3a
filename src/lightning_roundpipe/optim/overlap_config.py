"""``OverlapConfig``: how an overlapped optimizer steps, resolved once from the user's options.

``RuntimeOptions.overlap_config`` builds it; ``OverlappedOptimizer`` takes it whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..cost.memory import DEFAULT_UNDO_JOURNAL_BYTES


@dataclass(frozen=True)
class OverlapConfig:
    """How an overlapped optimizer steps (``OverlappedOptimizer``).

    staleness: 0 (exact) or 1 (RoundPipe's one-step-delayed update; the uploads read shadows).
    delay_per_layer_s: sleep this long before each layer's step (``testing.optimizer_delay_s``).
    early_steps: layers may step during the step's last backward, as soon as their gradients are complete.
    timeout_s: the longest any wait of the optimizer may take (the runtime's ``timeout``).
    undo: keep each step's before-images so a failed step is put back (``optimizer_undo``).
    journal_bytes: the most bytes of before-images one step keeps (``optimizer_undo_journal_bytes``;
        None: every layer's).
    """

    staleness: int = 0
    delay_per_layer_s: float = 0.0
    early_steps: bool = True
    timeout_s: float = 300.0
    undo: bool = True
    journal_bytes: Optional[int] = DEFAULT_UNDO_JOURNAL_BYTES

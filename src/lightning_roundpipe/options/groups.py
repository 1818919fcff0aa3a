"""The nested option groups a user sets: ``partition``, ``transfer`` and ``testing``.

Each is a frozen dataclass whose docstring describes its fields; ``validate`` checks them with
the errors naming the option as the caller spelled it (``RoundPipeStrategy(transfer.latency_s=-1)``).
The top-level options validate their groups when they are constructed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..schedule.graph_task import DEFAULT_PRIORITIES
from ..schedule.step_options import check_priorities
from ..option_checks import fail, seconds, whole_number

PARTITION_POLICIES = ("compute", "params", "uniform", "auto", "manual")


@dataclass(frozen=True)
class PartitionConfig:
    """How layers are cut into stages (Hydra group ``partition``).

    policy: "compute" (default: the plan the timing model predicts fastest from the estimated
        compute and transfer costs, an embedding priced as a gather and an LM head as a matmul,
        planned once at set-up, never re-planned: deterministic), "auto" (the same search, then
        re-planned from measured costs), "params" (equal weight bytes), "uniform" (equal layer
        counts) or "manual".
    forward_stages / backward_stages: stage counts for "uniform" and "params" (None: one forward
        stage per worker, two backward stages per worker).
    manual_forward / manual_backward: lists of [start, end) layer ranges for "manual"
        (manual_backward None: the forward ranges).
    replan_threshold: "auto" re-plans when measured costs move by more than this fraction.
    memory_budget_bytes: per-worker memory budget the stages are planned in (None: on CUDA, 4/7 of
        what the memory model lets tensors fill, 90% of the GPU's memory less its CUDA context,
        cuBLAS workspaces and allocator pages, as the upload and compute streams' allocator pools
        do not share cached memory; elsewhere ``cpu_memory_cap_bytes``, unlimited without one).
    """

    policy: str = "compute"
    forward_stages: Optional[int] = None
    backward_stages: Optional[int] = None
    manual_forward: Optional[list] = None
    manual_backward: Optional[list] = None
    replan_threshold: float = 0.2
    memory_budget_bytes: Optional[int] = None

    def validate(self, owner: str = "PartitionConfig", prefix: str = "") -> "PartitionConfig":
        """Check every field; errors name the option as ``owner`` and ``prefix`` spell it."""
        if self.policy not in PARTITION_POLICIES:
            fail(owner, prefix + "policy", self.policy, "partition policy must be " + ", ".join(map(repr, PARTITION_POLICIES)))
        if self.policy == "manual" and not self.manual_forward:
            fail(owner, prefix + "manual_forward", self.manual_forward,
                  "partition policy 'manual' needs manual_forward (and manual_backward) layer ranges")
        for name in ("forward_stages", "backward_stages"):
            whole_number(owner, prefix + name, getattr(self, name), 1, allow_none=True)
        seconds(owner, prefix + "replan_threshold", self.replan_threshold)
        whole_number(owner, prefix + "memory_budget_bytes", self.memory_budget_bytes, 1, allow_none=True)
        return self


@dataclass(frozen=True)
class TransferConfig:
    """Transfer priorities and the optional link model of the CPU backend (Hydra group ``transfer``).

    priorities: rank of each kind (lower first). Uploads are ordered by stage first, then by
        this rank: the running stage's inputs, then its weights, then the next stage's prefetch
        (which fills the gaps while inputs are not ready). Downloads by rank first: activations
        and input gradients other workers wait for before weight gradients.
    chunk_bytes: weight uploads and weight-gradient downloads are cut into chunks of about this size.
    prefetch_depth: stages a worker uploads ahead of the one it runs (1 keeps two resident).
    bandwidth_bytes_per_s / latency_s: CPU backend only: each transfer costs latency + bytes/bandwidth
        (25e9 models PCIe 4.0 x16); None means copies cost only the memory copy.
    queue: "priority" (each transfer queue picks the most urgent ready transfer) or "fifo" (one
        first-in-first-out queue per direction, like a bare CUDA stream: the baseline priorities beat).
    """

    priorities: dict = field(default_factory=lambda: dict(DEFAULT_PRIORITIES))
    chunk_bytes: int = 32 << 20
    prefetch_depth: int = 1
    bandwidth_bytes_per_s: Optional[float] = None
    latency_s: float = 0.0
    queue: str = "priority"

    def validate(self, owner: str = "TransferConfig", prefix: str = "") -> "TransferConfig":
        """Check every field; errors name the option as ``owner`` and ``prefix`` spell it."""
        if self.queue not in ("priority", "fifo"):
            fail(owner, prefix + "queue", self.queue, "transfer queue must be 'priority' or 'fifo'")
        check_priorities(owner, prefix + "priorities", self.priorities)
        whole_number(owner, prefix + "chunk_bytes", self.chunk_bytes, 1)
        whole_number(owner, prefix + "prefetch_depth", self.prefetch_depth, 0)
        seconds(owner, prefix + "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, positive=True, allow_none=True)
        seconds(owner, prefix + "latency_s", self.latency_s)
        return self


@dataclass(frozen=True)
class TestingOptions:
    """Delays injected on purpose, for tests and measurements: not for training (``testing=...``).

    They make a run slower or noisier so that tests see orderings a fast machine rarely shows,
    and so that measurements have a known compute time; the results stay exact and deterministic.

    compute_delay_s: CPU backend: sleep this long before each compute task.
    jitter_s: sleep a random time in [0, jitter_s) before each task of the CPU backend (compute
        and transfers) and before the stream work of the ``fake_cuda`` backend; its seed is ``seed``.
    optimizer_delay_s: sleep this long before each layer's overlapped optimizer step.
    """

    __test__ = False  # a name pytest would otherwise collect as a test class

    compute_delay_s: float = 0.0
    jitter_s: float = 0.0
    optimizer_delay_s: float = 0.0

    def validate(self, owner: str = "TestingOptions", prefix: str = "") -> "TestingOptions":
        """Check every delay is a finite number of seconds >= 0."""
        for name in ("compute_delay_s", "jitter_s", "optimizer_delay_s"):
            seconds(owner, prefix + name, getattr(self, name))
        return self


# The flat names the testing knobs had before they moved into ``testing``: a call with one of
# them is refused with the new spelling.
MOVED_TO_TESTING = {"cpu_compute_delay_s": "compute_delay_s", "cpu_jitter_s": "jitter_s",
                    "optimizer_delay_s": "optimizer_delay_s"}

"""Configuration dataclasses of the strategy; Hydra groups ``conf/partition`` and ``conf/transfer`` map onto them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping


def _from_mapping(cls, value: Any, option: str):
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and cls is PartitionConfig:
        return cls(policy=value)
    if isinstance(value, Mapping):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"RoundPipeStrategy({option}=...): unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**{k: (dict(v) if isinstance(v, Mapping) else (list(v) if isinstance(v, (list, tuple)) or type(v).__name__ == "ListConfig" else v)) for k, v in value.items()})
    raise ValueError(f"RoundPipeStrategy({option}=...) takes a {cls.__name__}, a dict or None, got {type(value).__name__}")


@dataclass
class PartitionConfig:
    """How layers are cut into stages.

    policy: "params" (equal weight bytes, default), "uniform" (equal layer counts), "auto"
        (profiled costs, asymmetric forward/backward stages, memory budget) or "manual".
    forward_stages / backward_stages: stage counts for "uniform" and "params" (None: one forward
        stage per worker, two backward stages per worker).
    manual_forward / manual_backward: lists of [start, end) layer ranges for "manual".
    replan_threshold: "auto" re-plans when measured costs move by more than this fraction.
    memory_budget_bytes: per-worker budget for "auto" (None: the device's memory, or unlimited on CPU).
    """

    policy: str = "params"
    forward_stages: int | None = None
    backward_stages: int | None = None
    manual_forward: list | None = None
    manual_backward: list | None = None
    replan_threshold: float = 0.2
    memory_budget_bytes: int | None = None

    def validate(self) -> "PartitionConfig":
        if self.policy not in ("auto", "uniform", "params", "manual"):
            raise ValueError(f"partition policy must be 'auto', 'uniform', 'params' or 'manual', got {self.policy!r}")
        if self.policy == "manual" and not self.manual_forward:
            raise ValueError("partition policy 'manual' needs manual_forward (and manual_backward) layer ranges")
        for name in ("forward_stages", "backward_stages"):
            v = getattr(self, name)
            if v is not None and int(v) < 1:
                raise ValueError(f"partition {name} must be >= 1, got {v}")
        return self


@dataclass
class TransferConfig:
    """Transfer priorities and the optional link model of the CPU backend.

    priorities: rank of each kind (lower first). Uploads are ordered by stage first, then by
        this rank: the running stage's inputs, then its weights, then the next stage's prefetch
        (which fills the gaps while inputs are not ready). Downloads by rank first: activations
        and input gradients other workers wait for before weight gradients.
    chunk_bytes: weight uploads are cut into chunks of about this size.
    prefetch_depth: stages a worker uploads ahead of the one it runs (1 keeps two resident).
    bandwidth_bytes_per_s / latency_s: CPU backend only: each transfer costs latency + bytes/bandwidth
        (25e9 models PCIe 4.0 x16); None means copies cost only the memory copy.
    queue: "priority" (each transfer queue picks the most urgent ready transfer) or "fifo" (one
        first-in-first-out queue per direction, like a bare CUDA stream: the baseline priorities beat).
    """

    priorities: dict = field(default_factory=lambda: {"activation": 0, "weights": 1, "gradients": 2})
    chunk_bytes: int = 32 << 20
    prefetch_depth: int = 1
    bandwidth_bytes_per_s: float | None = None
    latency_s: float = 0.0
    queue: str = "priority"

    def validate(self) -> "TransferConfig":
        if self.queue not in ("priority", "fifo"):
            raise ValueError(f"transfer queue must be 'priority' or 'fifo', got {self.queue!r}")
        missing = {"activation", "weights", "gradients"} - set(self.priorities or {})
        if missing:
            raise ValueError(f"transfer priorities must give a number for {sorted(missing)}")
        if int(self.chunk_bytes) < 1 or int(self.prefetch_depth) < 0:
            raise ValueError("transfer chunk_bytes must be >= 1 and prefetch_depth >= 0")
        return self


def partition_config(value: Any) -> PartitionConfig:
    return _from_mapping(PartitionConfig, value, "partition").validate()


def transfer_config(value: Any) -> TransferConfig:
    return _from_mapping(TransferConfig, value, "transfer").validate()

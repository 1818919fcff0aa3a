"""Hardware profiles: the few numbers of a machine that decide how fast a pipeline step runs.

A profile is a plain dataclass loaded from ``<name>.yaml`` in ``lightning_roundpipe/cost/profiles/``
(keys are field names, sizes may carry units, every file says where its numbers come from). The
simulator reads compute rates, the host link, the host optimizer's rate and memory bandwidth from
it; the same fields describe the CPU backend's virtual workers (``profiles/cpu2.yaml``), so a
simulated step can be checked against a measured CPU run. Which field feeds what:
docs/design.md, design notes, ``cost/hardware.py``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from importlib import resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..schedule.graph_task import TaskKind

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_QUANTITY = re.compile(r"^\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*(/\s*s)?\s*$")


def parse_quantity(value: Any) -> float:
    """Turn ``24``, ``"24e9"``, ``"24 GiB"`` or ``"25 GB/s"`` into a plain number (bytes or bytes/s).

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers of
    1024, as vendors and operating systems use them. A trailing ``/s`` is accepted and ignored:
    the field name already says it is a rate.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a number or a size such as '24 GiB', got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    match = _QUANTITY.match(str(value))
    if not match:
        raise ValueError(f"cannot read {value!r} as a size: write a number or e.g. '24 GiB', '25 GB/s'")
    number, unit = match.group(1), match.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"unknown unit {match.group(2)!r} in {value!r}; use one of B, kB, MB, GB, TB, KiB, MiB, GiB, TiB")
    try:
        return float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"cannot read the number in {value!r}") from None


@dataclass(frozen=True)
class HardwareProfile:
    """One machine: ``num_gpus`` identical workers, each with its own link to host memory."""

    name: str
    num_gpus: int
    tflops: float  # achievable dense bf16 (compute dtype) TFLOP/s of one worker on transformer layers
    gpu_memory_bytes: int  # memory of one worker
    host_device_bytes_per_s: float  # one direction of one worker's host link
    host_memory_bytes: int  # host RAM for model state, optimizer state and saved activations
    cpu_optimizer_params_per_s: float  # parameters per second the host optimizer updates (Adam, fp32)
    duplex: bool = True  # uploads and downloads run at full speed at the same time (PCIe is full duplex)
    latency_s: float = 0.0  # fixed cost of every transfer (launch, synchronisation)
    # Optional physical rates (cost/physical.py): when a profile gives them, estimated layer times
    # are matmul FLOPs at the tensor rate of the accumulation used, attention at the fp32-accumulate
    # rate and element-wise traffic at the memory bandwidth, instead of everything at ``tflops``.
    tensor_tflops_fp32_acc: float | None = None  # dense fp16/bf16 tensor rate, fp32 accumulate
    tensor_tflops_fp16_acc: float | None = None  # dense fp16 tensor rate, fp16 accumulate
    memory_bytes_per_s: float | None = None  # one worker's memory bandwidth
    # Achievable (sustained) rates, measured on whole layers rather than read off a datasheet:
    # when given, projections run at ``matmul_tflops_fp16_acc`` / ``matmul_tflops_fp32_acc`` and
    # flash attention at ``attention_tflops`` instead of the tensor peaks above.
    matmul_tflops_fp16_acc: float | None = None
    matmul_tflops_fp32_acc: float | None = None
    attention_tflops: float | None = None
    # Host memory bandwidth the host optimizer gets, and the host traffic of one parameter's update:
    # with it, the optimizer updates ``min(cpu_optimizer_params_per_s, host_memory_bytes_per_s /
    # optimizer_bytes_per_param)`` parameters per second (a multithreaded CPU Adam is memory bound).
    # 40 bytes: fp32 Adam reads param, grad, m, v and writes param, m, v (28), the fp16 gradient
    # read into the fp32 one (2 + 4) and the updated fp32 weight written back as the fp16 copy the
    # workers upload (4 + 2).
    host_memory_bytes_per_s: float | None = None
    optimizer_bytes_per_param: float = 40.0
    dispatch_s: float = 0.0  # host time to submit one task (one Python process drives all workers)
    # Memory of one GPU the model's tensors cannot use: CUDA context, cuBLAS workspaces, allocator
    # pages (cost/device_overheads.py). The planner takes it off before its memory_fraction.
    reserved_gpu_bytes: float = 0.0
    # Kernel launches of decoder-layer compute tasks, issued by the host (one process, one GIL):
    # per decoder layer per microbatch, a forward task launches ``forward_launches_per_layer``
    # kernels and a backward or fused task (forward with grad + backward) ``backward_launches_per_layer``;
    # each costs the host ``launch_s``. Charged with ``dispatch_s`` on the task's submission.
    launch_s: float = 0.0
    forward_launches_per_layer: int = 0
    backward_launches_per_layer: int = 0
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        problems = []
        if self.num_gpus < 1:
            problems.append(f"num_gpus must be at least 1, got {self.num_gpus}")
        for name in ("tflops", "gpu_memory_bytes", "host_device_bytes_per_s", "host_memory_bytes", "cpu_optimizer_params_per_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.latency_s < 0:
            problems.append(f"latency_s must not be negative, got {self.latency_s}")
        for name in ("dispatch_s", "launch_s", "forward_launches_per_layer", "backward_launches_per_layer",
                     "reserved_gpu_bytes"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must not be negative, got {getattr(self, name)}")
        if not self.optimizer_bytes_per_param > 0:
            problems.append(f"optimizer_bytes_per_param must be positive, got {self.optimizer_bytes_per_param}")
        for name in ("tensor_tflops_fp32_acc", "tensor_tflops_fp16_acc", "memory_bytes_per_s", "matmul_tflops_fp16_acc",
                     "matmul_tflops_fp32_acc", "attention_tflops", "host_memory_bytes_per_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                problems.append(f"{name} must be positive when given, got {getattr(self, name)}")
        if problems:
            raise ValueError(f"hardware profile {self.name!r}: " + "; ".join(problems))

    @property
    def flops_per_s(self) -> float:
        """Achievable FLOP/s of one worker."""
        return self.tflops * 1e12

    @property
    def optimizer_params_per_s(self) -> float:
        """Parameters per second the host optimizer updates: its compute rate, or the host memory
        bandwidth over the bytes one update moves when that is lower."""
        if self.host_memory_bytes_per_s is None:
            return self.cpu_optimizer_params_per_s
        return min(self.cpu_optimizer_params_per_s, self.host_memory_bytes_per_s / self.optimizer_bytes_per_param)

    def launch_seconds(self, kind: str, decoder_layers: int) -> float:
        """Host time to issue the kernels of a compute task of ``kind`` ("forward", "backward",
        "fused") over ``decoder_layers`` decoder layers, one microbatch."""
        per_layer = self.forward_launches_per_layer if kind == TaskKind.FORWARD else self.backward_launches_per_layer
        return decoder_layers * per_layer * self.launch_s

    def replace(self, **changes: Any) -> "HardwareProfile":
        """A copy with some fields changed, e.g. ``profile.replace(num_gpus=4)``."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], name: str | None = None) -> "HardwareProfile":
        """Build from a mapping with the field names as keys; sizes may carry units."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown hardware profile key(s) {unknown}; known keys are {sorted(known)}")
        values = dict(data)
        if name is not None:
            values.setdefault("name", name)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in values and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"hardware profile {values.get('name', '?')!r} lacks key(s) {missing}")
        for key in ("gpu_memory_bytes", "host_memory_bytes"):
            values[key] = int(parse_quantity(values[key]))
        for key in ("host_device_bytes_per_s", "cpu_optimizer_params_per_s", "tflops", "latency_s",
                    "tensor_tflops_fp32_acc", "tensor_tflops_fp16_acc", "memory_bytes_per_s", "dispatch_s", "launch_s",
                    "matmul_tflops_fp16_acc", "matmul_tflops_fp32_acc", "attention_tflops", "host_memory_bytes_per_s",
                    "optimizer_bytes_per_param", "reserved_gpu_bytes"):
            if key in values:
                values[key] = parse_quantity(values[key])
        values["num_gpus"] = int(values["num_gpus"])
        for key in ("forward_launches_per_layer", "backward_launches_per_layer"):
            if key in values:
                values[key] = int(values[key])
        if "duplex" in values:
            values["duplex"] = bool(values["duplex"])
        return cls(**values)


def hardware_dir():
    """Folder of the profiles: ``$LIGHTNING_ROUNDPIPE_HARDWARE_DIR``, or the package's ``cost/profiles``
    (an ``importlib.resources`` Traversable: a real folder or inside an archive)."""
    env = os.environ.get("LIGHTNING_ROUNDPIPE_HARDWARE_DIR")
    if env:
        return Path(env)
    return resources.files("lightning_roundpipe.cost.profiles")


def available_hardware() -> list[str]:
    """Names of the available profiles (file names without ``.yaml``)."""
    folder = hardware_dir()
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_hardware(name_or_path: str | os.PathLike | HardwareProfile) -> HardwareProfile:
    """Load a profile by name (``"rtx4090"``) from ``hardware_dir``, or from a YAML file path."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    path = Path(name_or_path)
    name = path.stem
    if path.suffix not in (".yaml", ".yml"):
        path = hardware_dir() / f"{name_or_path}.yaml"
        name = str(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no hardware profile {str(name_or_path)!r} (looked for {path}); "
            f"shipped profiles: {available_hardware() or 'none found'}; or pass a path to a YAML file"
        )
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of profile fields, got {type(data).__name__}")
    return HardwareProfile.from_dict(data, name=name)

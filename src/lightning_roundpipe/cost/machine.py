"""The user's machine on the command line: overrides of a hardware profile, and ``--detect``.

A profile (``cost/profiles/*.yaml``) describes a machine class; a user's machine differs in the
GPU count, the memory and the link. ``override_profile`` replaces those fields from the
command-line values (``--gpus 2 --host-memory 128 --pcie gen3``) and ``detect_machine``
reads them off the local machine: GPUs through ``torch.cuda`` when present, host RAM through
``psutil`` when installed, else ``os.sysconf``, and the CPU cores. Both return the lines that say
what was assumed, so the plan is never silently about another machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .hardware import HardwareProfile, available_hardware, parse_quantity

GiB = 2**30
# Achieved pinned-copy rate of one x16 link per direction: ~80% of the raw rate (8, 16, 32 GT/s
# x 16 lanes, 128b/130b: 15.75, 31.5, 63 GB/s), as the rtx4090 profile assumes for PCIe 4.0.
PCIE_BYTES_PER_S = {"gen3": 12.5e9, "gen4": 25e9, "gen5": 50e9}
# Fused CPU Adam parameters per second per core (conf/hardware_measurements/dev_host.yaml): with
# --detect the host optimizer's compute rate is the core count times this.
ADAM_PARAMS_PER_S_PER_CORE = 3.4e8
DEFAULT_DETECT_PROFILE = "rtx4090"


def size_in_gib(text: str | float) -> float:
    """Bytes of ``"128"`` (GiB), ``"128 GB"`` or ``"24GiB"``: a bare number is GiB."""
    try:
        return float(text) * GiB
    except ValueError:
        return parse_quantity(text)


def link_bytes_per_s(text: str) -> float:
    """One direction of the host link: ``gen3``/``gen4``/``gen5`` (x16), or a rate, a bare number in GB/s."""
    key = str(text).strip().lower()
    if key in PCIE_BYTES_PER_S:
        return PCIE_BYTES_PER_S[key]
    try:
        return float(key) * 1e9
    except ValueError:
        pass
    try:
        return parse_quantity(text)
    except ValueError:
        raise ValueError(f"--pcie expects gen3, gen4, gen5 or a rate such as '20 GB/s', got {text!r}") from None


def override_profile(profile: HardwareProfile, *, gpus: int | None = None, gpu_memory: str | None = None,
                     host_memory: str | None = None, pcie: str | None = None) -> tuple[HardwareProfile, list[str]]:
    """``profile`` with the given fields replaced, and one line per replaced field."""
    changes: dict = {}
    said: list[str] = []
    if gpus is not None:
        changes["num_gpus"] = gpus
        said.append(f"{gpus} GPU(s) (profile: {profile.num_gpus})")
    if gpu_memory is not None:
        changes["gpu_memory_bytes"] = int(size_in_gib(gpu_memory))
        said.append(f"{changes['gpu_memory_bytes'] / GiB:.1f} GiB per GPU (profile: {profile.gpu_memory_bytes / GiB:.1f})")
    if host_memory is not None:
        changes["host_memory_bytes"] = int(size_in_gib(host_memory))
        said.append(f"{changes['host_memory_bytes'] / GiB:.1f} GiB host memory (profile: "
                    f"{profile.host_memory_bytes / GiB:.1f})")
    if pcie is not None:
        changes["host_device_bytes_per_s"] = link_bytes_per_s(pcie)
        said.append(f"host link {changes['host_device_bytes_per_s'] / 1e9:.1f} GB/s per direction (profile: "
                    f"{profile.host_device_bytes_per_s / 1e9:.1f})")
    return (profile.replace(**changes) if changes else profile), said


@dataclass(frozen=True)
class DetectedMachine:
    """What the local machine reports (GPU fields None when torch sees no GPU)."""

    gpu_count: int
    gpu_name: str | None
    gpu_memory_bytes: int | None
    host_memory_bytes: int | None
    cores: int | None


def host_memory_bytes() -> int | None:
    """Physical RAM: psutil when installed, else ``os.sysconf`` (None where neither answers)."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def detect_machine() -> DetectedMachine:
    """Read GPUs (torch.cuda), host RAM and cores of this machine."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    name = memory = None
    if count:
        props = torch.cuda.get_device_properties(0)
        name, memory = props.name, int(props.total_memory)
    return DetectedMachine(count, name, memory, host_memory_bytes(), os.cpu_count())


def profile_for_gpu(gpu_name: str | None) -> str:
    """The shipped profile whose name appears in the GPU's name (``NVIDIA H100 80GB HBM3`` -> h100)."""
    squashed = (gpu_name or "").lower().replace(" ", "").replace("-", "")
    for name in sorted(available_hardware(), key=len, reverse=True):
        if name in squashed:
            return name
    return DEFAULT_DETECT_PROFILE


def apply_detection(profile: HardwareProfile, found: DetectedMachine) -> tuple[HardwareProfile, list[str]]:
    """``profile`` with what was detected, and lines saying what was found and what was assumed."""
    changes: dict = {}
    said: list[str] = []
    if found.gpu_count:
        changes.update(num_gpus=found.gpu_count, gpu_memory_bytes=found.gpu_memory_bytes)
        said.append(f"found {found.gpu_count} x {found.gpu_name} ({found.gpu_memory_bytes / GiB:.1f} GiB each)")
    else:
        said.append(f"no GPU found (torch.cuda sees none): assuming the profile's {profile.num_gpus} x "
                    f"{profile.gpu_memory_bytes / GiB:.1f} GiB GPUs")
    if found.host_memory_bytes:
        changes["host_memory_bytes"] = found.host_memory_bytes
        said.append(f"found {found.host_memory_bytes / GiB:.1f} GiB host memory")
    else:
        said.append(f"host memory unknown: assuming the profile's {profile.host_memory_bytes / GiB:.1f} GiB")
    if found.cores:
        changes["cpu_optimizer_params_per_s"] = found.cores * ADAM_PARAMS_PER_S_PER_CORE
        said.append(f"found {found.cores} CPU cores: host Adam at {found.cores} x {ADAM_PARAMS_PER_S_PER_CORE:.2g} "
                    f"parameters/s")
    said.append(f"from profile {profile.name}: compute rates, host link "
                f"{profile.host_device_bytes_per_s / 1e9:.1f} GB/s, host memory bandwidth")
    return profile.replace(**changes), said

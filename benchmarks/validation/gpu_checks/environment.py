"""The machine: GPUs with their PCIe link and NUMA node, cores, threads."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from .context import Ctx


def _sysfs(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _pcie_gen(speed: str | None) -> int | None:
    """PCIe generation from sysfs's link speed ("16.0 GT/s PCIe")."""
    try:
        rate = float(speed.split()[0])
    except (AttributeError, ValueError, IndexError):
        return None
    return {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}.get(rate)


def gpu_link(index: int) -> dict:
    """PCIe generation and width (current and maximum) and the NUMA node of GPU ``index``, from sysfs."""
    props = torch.cuda.get_device_properties(index)
    bus = None
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    out = dict(pci_bus_id=bus)
    if bus is not None:
        dev = Path("/sys/bus/pci/devices") / bus
        numa = _sysfs(dev / "numa_node")
        out.update(numa_node=int(numa) if numa not in (None, "") else None,
                   pcie_gen_current=_pcie_gen(_sysfs(dev / "current_link_speed")),
                   pcie_gen_max=_pcie_gen(_sysfs(dev / "max_link_speed")),
                   pcie_width_current=_int(_sysfs(dev / "current_link_width")),
                   pcie_width_max=_int(_sysfs(dev / "max_link_width")))
    return out


def _int(text: str | None) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def host_cores() -> dict:
    """Cores (all, usable by this process), NUMA nodes with their CPUs, torch's thread counts."""
    nodes = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        nodes[node.name] = _sysfs(node / "cpulist")
    return dict(cpus=os.cpu_count(), usable_cpus=len(os.sched_getaffinity(0)), numa_nodes=nodes,
                torch_threads=torch.get_num_threads(), torch_interop_threads=torch.get_num_interop_threads())


def check_environment(ctx: Ctx) -> tuple[str, str, dict]:
    info = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                host_memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                cuda_available=torch.cuda.is_available(), **host_cores())
    if ctx.cuda and torch.cuda.is_available():
        info["gpus"] = [dict(index=i, name=torch.cuda.get_device_name(i),
                             memory_bytes=torch.cuda.get_device_properties(i).total_memory,
                             capability=".".join(map(str, torch.cuda.get_device_capability(i))), **gpu_link(i))
                        for i in range(ctx.gpus)]
        try:
            info["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                              timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired) as err:
            info["topology"] = f"nvidia-smi not available: {err}"
    if ctx.cuda and not info.get("gpus"):
        return "fail", "no CUDA device", info
    if not ctx.cuda:
        return "pass", f"CPU only (fake streams), {info['usable_cpus']} usable cores", info
    g = info["gpus"]
    links = ", ".join(f"gen{x.get('pcie_gen_max')}x{x.get('pcie_width_max')}@numa{x.get('numa_node')}" for x in g)
    return "pass", f"{len(g)}x {g[0]['name']}; {links}; {info['usable_cpus']} cores", info

"""The node's shape, read from sysfs and procfs: NUMA nodes, their CPUs and memory,
the GPUs on each, and the CPUs this process may run on.

Rules:
- Everything is read under a root directory (``/`` on a real node; tests build a fake
  tree of a two-socket, 8-GPU node), and nothing here changes the system.
- A GPU's node comes from its PCI device: ``/sys/bus/pci/devices/<bus id>/numa_node``
  for every NVIDIA display or 3D controller (vendor 0x10de, class 0x0300 or 0x0302).
  Its UUID, which engines name their GPUs by, comes from the driver's
  ``/proc/driver/nvidia/gpus/<bus id>/information``; without it a GPU is counted on
  its node but cannot be matched to a worker.
- A node with memory counts; a node without memory (CPU-only, or a GPU's memory
  exposed as a node without CPUs) never holds a part of the region.
- Missing files mean "not there" (no NUMA: one node 0 with every CPU), never an error.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from kvoffloadd.region.hostfs import cgroup_dirs, read_text

NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA-compatible, 3D controller


@dataclass(frozen=True)
class Gpu:
    bus_id: str  # "0000:18:00.0"
    node: int  # -1: the firmware does not say
    uuid: bytes = b""  # 16 bytes, as CUDA reports it; empty when unknown


@dataclass(frozen=True)
class Node:
    node: int
    cpus: frozenset[int]
    has_memory: bool
    mem_total_bytes: int = 0
    mem_free_bytes: int = 0
    # huge page size in bytes -> (free, total) pages on this node
    huge_pages: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Topology:
    nodes: tuple[Node, ...]
    gpus: tuple[Gpu, ...]

    @property
    def memory_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.has_memory]

    def gpus_on(self, node: int) -> list[Gpu]:
        return [g for g in self.gpus if g.node == node]

    def node_of_gpu(self, uuid: bytes) -> int | None:
        for g in self.gpus:
            if g.uuid and g.uuid == uuid:
                return g.node if g.node >= 0 else None
        return None


def _read(root: str, path: str) -> str | None:
    try:
        with open(os.path.join(root, path.lstrip("/"))) as f:
            return f.read().strip()
    except OSError:
        return None


def parse_list(text: str) -> list[int]:
    """A kernel list such as ``0-3,8,10-11``."""
    out: list[int] = []
    for part in text.replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _node_meminfo(root: str, node: int) -> tuple[int, int]:
    text = _read(root, f"/sys/devices/system/node/node{node}/meminfo") or ""
    found = dict(re.findall(r"Node \d+ (\w+):\s+(\d+) kB", text))
    return int(found.get("MemTotal", 0)) << 10, int(found.get("MemFree", 0)) << 10


def _node_huge_pages(root: str, node: int) -> dict[int, tuple[int, int]]:
    base = os.path.join(root, f"sys/devices/system/node/node{node}/hugepages")
    out: dict[int, tuple[int, int]] = {}
    try:
        entries = os.listdir(base)
    except OSError:
        return out
    for entry in entries:
        m = re.fullmatch(r"hugepages-(\d+)kB", entry)
        if not m:
            continue
        rel = f"/sys/devices/system/node/node{node}/hugepages/{entry}"
        free = _read(root, f"{rel}/free_hugepages")
        total = _read(root, f"{rel}/nr_hugepages")
        out[int(m.group(1)) << 10] = (int(free or 0), int(total or 0))
    return out


def _nodes(root: str) -> tuple[Node, ...]:
    online = _read(root, "/sys/devices/system/node/online")
    if online is None:
        return (Node(0, frozenset(os.sched_getaffinity(0)), True),)
    with_memory = _read(root, "/sys/devices/system/node/has_memory")
    memory = set(parse_list(with_memory)) if with_memory is not None else None
    nodes = []
    for n in parse_list(online):
        cpus = _read(root, f"/sys/devices/system/node/node{n}/cpulist") or ""
        total, free = _node_meminfo(root, n)
        nodes.append(
            Node(
                n,
                frozenset(parse_list(cpus)),
                memory is None or n in memory,
                total,
                free,
                _node_huge_pages(root, n),
            )
        )
    return tuple(nodes)


def _uuid_of(root: str, bus_id: str) -> bytes:
    text = _read(root, f"/proc/driver/nvidia/gpus/{bus_id}/information") or ""
    m = re.search(r"GPU UUID:\s*GPU-([0-9a-fA-F-]+)", text)
    if not m:
        return b""
    digits = m.group(1).replace("-", "")
    return bytes.fromhex(digits) if len(digits) == 32 else b""


def _gpus(root: str) -> tuple[Gpu, ...]:
    base = os.path.join(root, "sys/bus/pci/devices")
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return ()
    gpus = []
    for bus_id in entries:
        rel = f"/sys/bus/pci/devices/{bus_id}"
        if _read(root, f"{rel}/vendor") != NVIDIA_VENDOR:
            continue
        if not (_read(root, f"{rel}/class") or "").startswith(GPU_CLASSES):
            continue
        node = int(_read(root, f"{rel}/numa_node") or -1)
        gpus.append(Gpu(bus_id.lower(), node, _uuid_of(root, bus_id)))
    return tuple(gpus)


def read_topology(root: str = "/") -> Topology:
    return Topology(_nodes(root), _gpus(root))


def usable_cpus(root: str = "/", allowed: set[int] | None = None) -> int:
    """CPUs this process may keep busy: its affinity, bounded by a cgroup CPU quota
    (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``) where one is set."""
    cpus = len(allowed if allowed is not None else os.sched_getaffinity(0))
    quota = _cpu_quota(root)
    return max(1, min(cpus, math.ceil(quota)) if quota else cpus)


def _cpu_quota(root: str) -> float | None:
    """The tightest CPU quota over this process's cgroup and its ancestors, in CPUs."""
    dirs = cgroup_dirs("cpu", root)
    if dirs is None:
        return None
    quotas = []
    for d in dirs.paths:
        if dirs.version == 2:
            text = read_text("/", f"{d}/cpu.max") or "max"
            quota, _, period = text.strip().partition(" ")
            if quota != "max" and period:
                quotas.append(int(quota) / int(period))
        else:
            q = read_text("/", f"{d}/cpu.cfs_quota_us")
            p = read_text("/", f"{d}/cpu.cfs_period_us")
            if q and p and int(q) > 0:
                quotas.append(int(q) / int(p))
    return min(quotas) if quotas else None

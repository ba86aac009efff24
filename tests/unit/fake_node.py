"""A fake sysfs/procfs tree of a node, for the code that reads the node's shape and
limits (region/topology.py, hostfs.py, backing.py, limits.py) under a root directory.

``two_socket_node`` is the node the issue is about: two sockets of 48 CPUs and 1 TiB
each, 8 GPUs (``gpus_per_node`` of them on each socket), a NIC and an NVSwitch that are
not GPUs, and the mount and cgroup files of a container under cgroup v2 or v1.
"""

from __future__ import annotations

import os
from pathlib import Path

GIB = 1 << 30


def write(root: Path, path: str, text: str) -> None:
    p = root / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def gpu_uuid(i: int) -> bytes:
    return bytes([0xA0 + i]) * 16


def _uuid_text(uuid: bytes) -> str:
    h = uuid.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def two_socket_node(
    root: Path,
    gpus_per_node: tuple[int, int] = (4, 4),
    *,
    mem_total_bytes: int = 1024 * GIB,
    huge_pages_2m: tuple[int, int] = (0, 0),  # (free, total) on each node
) -> None:
    sysn = "/sys/devices/system/node"
    write(root, f"{sysn}/online", "0-1\n")
    write(root, f"{sysn}/has_memory", "0-1\n")
    for node, cpus in ((0, "0-23,48-71"), (1, "24-47,72-95")):
        write(root, f"{sysn}/node{node}/cpulist", cpus + "\n")
        kib = mem_total_bytes >> 10
        write(
            root,
            f"{sysn}/node{node}/meminfo",
            f"Node {node} MemTotal:       {kib} kB\nNode {node} MemFree:        {kib // 2} kB\n",
        )
        hp = f"{sysn}/node{node}/hugepages/hugepages-2048kB"
        write(root, f"{hp}/free_hugepages", f"{huge_pages_2m[0]}\n")
        write(root, f"{hp}/nr_hugepages", f"{huge_pages_2m[1]}\n")
    buses = ["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]
    i = 0
    for node, count in enumerate(gpus_per_node):
        for _ in range(count):
            bus = f"0000:{buses[i]}:00.0"
            pci = f"/sys/bus/pci/devices/{bus}"
            write(root, f"{pci}/vendor", "0x10de\n")
            write(root, f"{pci}/class", "0x030200\n")
            write(root, f"{pci}/numa_node", f"{node}\n")
            write(
                root,
                f"/proc/driver/nvidia/gpus/{bus}/information",
                f"Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t {_uuid_text(gpu_uuid(i))}\n"
                f"Bus Location: \t {bus}\n",
            )
            i += 1
    for bus, vendor, cls in (
        ("0000:1b:00.0", "0x15b3", "0x020700"),
        ("0000:05:00.0", "0x10de", "0x068000"),
    ):
        write(root, f"/sys/bus/pci/devices/{bus}/vendor", vendor + "\n")
        write(root, f"/sys/bus/pci/devices/{bus}/class", cls + "\n")
        write(root, f"/sys/bus/pci/devices/{bus}/numa_node", "0\n")


def mountinfo(root: Path, extra: list[str] | None = None, cgroup_v1: bool = False) -> None:
    lines = [
        "22 1 0:21 / / rw,relatime - overlay overlay rw",
        "30 22 0:26 / /dev/shm rw,nosuid,nodev - tmpfs shm rw,size=67108864k",
        "31 22 0:27 / /dev/hugepages rw,relatime - hugetlbfs hugetlbfs rw,pagesize=2M",
        "32 22 0:28 / /mnt/huge1g rw,relatime - hugetlbfs nodev rw,pagesize=1024M",
    ]
    if cgroup_v1:
        lines += [
            "40 22 0:30 /kubepods/pod1/c1 /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory",
            "41 22 0:31 /kubepods/pod1/c1 /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup "
            "rw,cpu,cpuacct",
            "42 22 0:32 /kubepods/pod1/c1 /sys/fs/cgroup/hugetlb rw - cgroup cgroup rw,hugetlb",
        ]
    else:
        lines.append("40 22 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate")
    write(root, "/proc/self/mountinfo", "\n".join(lines + (extra or [])) + "\n")


def cgroup_v2(root: Path, limits: dict[str, dict[str, str]], controllers: str) -> None:
    """A container seen through its cgroup namespace at ``/sys/fs/cgroup`` = ``/``
    plus a sub-cgroup ``/kvoffloadd`` holding the process; ``limits``: files of each."""
    write(root, "/proc/self/cgroup", "0::/kvoffloadd\n")
    write(root, "/sys/fs/cgroup/cgroup.controllers", controllers + "\n")
    write(root, "/sys/fs/cgroup/kvoffloadd/cgroup.controllers", controllers + "\n")
    for rel, files in limits.items():
        for name, text in files.items():
            write(root, f"/sys/fs/cgroup{rel}/{name}", text + "\n")


def cgroup_v1(root: Path, limits: dict[str, dict[str, str]]) -> None:
    """A Kubernetes container under cgroup v1: the controllers mounted at their pod
    path (``/kubepods/pod1/c1``); ``limits``: ``{"memory": {file: text}}`` and so on."""
    write(
        root,
        "/proc/self/cgroup",
        "12:hugetlb:/kubepods/pod1/c1\n4:memory:/kubepods/pod1/c1\n"
        "3:cpu,cpuacct:/kubepods/pod1/c1\n1:name=systemd:/kubepods/pod1/c1\n",
    )
    for controller, files in limits.items():
        for name, text in files.items():
            write(root, f"/sys/fs/cgroup/{controller}/{name}", text + "\n")


def meminfo(root: Path, total_bytes: int, available_bytes: int) -> None:
    write(
        root,
        "/proc/meminfo",
        f"MemTotal:       {total_bytes >> 10} kB\nMemFree:        {available_bytes >> 10} kB\n"
        f"MemAvailable:   {available_bytes >> 10} kB\nHugepagesize:       2048 kB\n",
    )


def huge_pool(root: Path, size_kb: int, nr: int, free: int, resv: int = 0) -> None:
    rel = f"/sys/kernel/mm/hugepages/hugepages-{size_kb}kB"
    write(root, f"{rel}/nr_hugepages", f"{nr}\n")
    write(root, f"{rel}/free_hugepages", f"{free}\n")
    write(root, f"{rel}/resv_hugepages", f"{resv}\n")


def thp(root: Path, enabled: str = "madvise", shmem: str = "never") -> None:
    def bracket(choice: str, options: tuple[str, ...]) -> str:
        return " ".join(f"[{o}]" if o == choice else o for o in options) + "\n"

    rel = "/sys/kernel/mm/transparent_hugepage"
    write(root, f"{rel}/enabled", bracket(enabled, ("always", "madvise", "never")))
    opts = ("always", "within_size", "advise", "never", "deny", "force")
    write(root, f"{rel}/shmem_enabled", bracket(shmem, opts))


def exists(root: Path, path: str) -> bool:
    return os.path.exists(root / path.lstrip("/"))

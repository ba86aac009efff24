"""No surprise OOM: every limit that could kill the daemon once its region fills,
checked before the first page is touched.

The daemon populates its whole region, so every page of it is charged to the daemon's
memory cgroup (the cgroup of whoever faults a page first pays for it) and taken from
the node's memory, its tmpfs or its huge page pool. A region that does not fit is
killed minutes later, after listening, with nothing in its log: under systemd or
Kubernetes, a crash loop. So at start:

- the memory cgroup (v1 and v2), at every level that has a limit, must hold what the
  region still needs (its pages not already resident, a kept region's are) plus the
  daemon's own ``memory_headroom`` (which covers what the daemon uses already: a
  limit of ``region_size + memory_headroom`` is enough); with hugetlbfs only the
  headroom, huge pages being charged to the hugetlb controller instead (unless cgroup
  v2 is mounted with ``memory_hugetlb_accounting``);
- the host's ``MemAvailable`` likewise (the OOM killer picks the largest process);
- the region's tmpfs (``/dev/shm``) must have the free space, a hugetlbfs mount its
  ``size=`` and the huge page pool its free pages (``free - resv``, in total and on
  each node that holds a part), and a hugetlb cgroup its limit.

Rules:
- ``region_limits`` reads, under a root directory (a fake tree in tests), and returns
  every limit found with what it leaves and what the region needs of it; ``refusal``
  makes the one message a refused start prints: the limit, its numbers and the fix.
- Nothing here changes the system; unreadable files mean "no such limit".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvoffloadd.region.backing import Backing
from kvoffloadd.region.hostfs import cgroup_dirs, mounts, read_text

UNLIMITED_BYTES = 1 << 60  # cgroup v1 writes "no limit" as 2^63 rounded to a page
GIB = 1 << 30


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


@dataclass(frozen=True)
class Need:
    """What the region will take."""

    region_bytes: int
    resident_bytes: int  # of it, pages already held (a kept region)
    headroom_bytes: int  # the daemon's own memory beyond the region
    backing: Backing
    node_bytes: dict[int, int] = field(default_factory=dict)  # NUMA node -> part bytes
    # the daemon's own memory now, in its cgroup's usage already: the headroom covers it,
    # so a limit of region_size + memory_headroom is enough
    own_bytes: int = 0

    @property
    def new_bytes(self) -> int:
        return max(0, self.region_bytes - self.resident_bytes)


@dataclass(frozen=True)
class Limit:
    what: str  # "memory cgroup /system.slice/kvoffloadd.service (memory.max)"
    limit_bytes: int
    used_bytes: int
    needed_bytes: int
    fix: str  # how to make room, with "{need}" for the limit to reach
    region_share_bytes: int = 0  # of needed_bytes, what is the region's (the rest: headroom)

    @property
    def available_bytes(self) -> int:
        return max(0, self.limit_bytes - self.used_bytes)

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.available_bytes

    def describe(self) -> str:
        return (
            f"{self.what}: {human(self.available_bytes)} free of {human(self.limit_bytes)}, "
            f"needs {human(self.needed_bytes)}"
        )


def _int(text: str | None) -> int | None:
    try:
        return int((text or "").split()[0])
    except (ValueError, IndexError):
        return None


def memory_cgroup_limits(need: Need, root: str = "/") -> list[Limit]:
    dirs = cgroup_dirs("memory", root)
    if dirs is None:
        return []
    charged = need.headroom_bytes
    region_share = 0
    hugetlb_charged = any(
        m.fstype == "cgroup2" and "memory_hugetlb_accounting" in m.options for m in mounts(root)
    )
    if not need.backing.is_hugetlb or hugetlb_charged:
        region_share = need.new_bytes
        charged += region_share
    files = (
        ("memory.max", "memory.current")
        if dirs.version == 2
        else (
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
        )
    )
    out = []
    for path, name in zip(dirs.paths, dirs.names):
        text = read_text("/", os.path.join(path, files[0]))
        limit = None if text is None or text.strip() == "max" else _int(text)
        if limit is None or limit >= UNLIMITED_BYTES:
            continue
        used = _int(read_text("/", os.path.join(path, files[1]))) or 0
        out.append(
            Limit(
                f"memory cgroup {name} ({files[0]})",
                limit,
                max(0, used - need.own_bytes),
                charged,
                "raise the cgroup's memory limit to at least {need} (systemd: MemoryMax= "
                "of kvoffloadd.service; Kubernetes: resources.limits.memory of the "
                "kvoffloadd container)",
                region_share,
            )
        )
    return out


def own_resident_bytes(root: str = "/") -> int:
    """This process's resident memory (VmRSS)."""
    for line in (read_text(root, "/proc/self/status") or "").splitlines():
        if line.startswith("VmRSS:"):
            return (_int(line.split(":", 1)[1]) or 0) << 10
    return 0


def meminfo(root: str = "/") -> dict[str, int]:
    out = {}
    for line in (read_text(root, "/proc/meminfo") or "").splitlines():
        key, _, rest = line.partition(":")
        value = _int(rest)
        if value is not None:
            out[key] = value << 10 if rest.strip().endswith("kB") else value
    return out


def host_memory_limit(need: Need, root: str = "/") -> list[Limit]:
    info = meminfo(root)
    if "MemAvailable" not in info or "MemTotal" not in info:
        return []
    region = 0 if need.backing.is_hugetlb else need.new_bytes
    total = info["MemTotal"]
    return [
        Limit(
            "host memory (MemAvailable in /proc/meminfo)",
            total,
            total - info["MemAvailable"],
            region + need.headroom_bytes,
            "free memory on the node (at least {need} available)",
            region,
        )
    ]


def filesystem_limit(need: Need, root: str = "/") -> list[Limit]:
    """A tmpfs's free space; a hugetlbfs mount's size= (none: no limit)."""
    try:
        st = os.statvfs(os.path.join(root, need.backing.directory.lstrip("/")))
    except OSError:
        return []
    if st.f_blocks == 0:  # hugetlbfs without size=
        return []
    total = st.f_blocks * st.f_frsize
    d = need.backing.directory
    fix = (
        f"enlarge it to at least {{need}} (mount -o remount,size={{need_g}} {d}; Docker: "
        "--shm-size; Kubernetes: the volume's sizeLimit)"
        if not need.backing.is_hugetlb
        else f"remount {d} with a larger size= (at least {{need}})"
    )
    return [
        Limit(
            f"{d} ({need.backing.fstype})",
            total,
            total - st.f_bavail * st.f_frsize,
            need.new_bytes,
            fix,
            need.new_bytes,
        )
    ]


def huge_page_limits(need: Need, root: str = "/") -> list[Limit]:
    """Free pages of the pool (free minus reserved), in total and per node part."""
    b = need.backing
    if not b.is_hugetlb:
        return []
    kb = b.page_bytes >> 10
    rel = f"/sys/kernel/mm/hugepages/hugepages-{kb}kB"
    free = _int(read_text(root, f"{rel}/free_hugepages")) or 0
    resv = _int(read_text(root, f"{rel}/resv_hugepages")) or 0
    nr = _int(read_text(root, f"{rel}/nr_hugepages")) or 0
    page = b.page_bytes
    out = [
        Limit(
            f"{b.huge_pages} huge pages ({rel})",
            nr * page,
            (nr - free + resv) * page,
            need.new_bytes,
            f"reserve more: echo {{pages}} > {rel}/nr_hugepages (or hugepages= on the kernel "
            "command line, before memory fragments)",
            need.new_bytes,
        )
    ]
    if len(need.node_bytes) > 1 and not need.resident_bytes:
        for node, nbytes in sorted(need.node_bytes.items()):
            nrel = f"/sys/devices/system/node/node{node}/hugepages/hugepages-{kb}kB"
            nfree = _int(read_text(root, f"{nrel}/free_hugepages"))
            ntotal = _int(read_text(root, f"{nrel}/nr_hugepages"))
            if nfree is None or ntotal is None:
                continue
            out.append(
                Limit(
                    f"{b.huge_pages} huge pages on NUMA node {node} ({nrel})",
                    ntotal * page,
                    (ntotal - nfree) * page,
                    nbytes,
                    f"reserve more on that node: echo {{pages}} > {nrel}/nr_hugepages",
                    nbytes,
                )
            )
    return out + _hugetlb_cgroup_limits(need, root)


def _hugetlb_cgroup_limits(need: Need, root: str) -> list[Limit]:
    dirs = cgroup_dirs("hugetlb", root)
    if dirs is None:
        return []
    size = need.backing.size_name
    if dirs.version == 2:
        files = (f"hugetlb.{size}.max", f"hugetlb.{size}.current")
    else:
        files = (f"hugetlb.{size}.limit_in_bytes", f"hugetlb.{size}.usage_in_bytes")
    out = []
    for path, name in zip(dirs.paths, dirs.names):
        text = read_text("/", os.path.join(path, files[0]))
        limit = None if text is None or text.strip() == "max" else _int(text)
        if limit is None or limit >= UNLIMITED_BYTES:
            continue
        out.append(
            Limit(
                f"hugetlb cgroup {name} ({files[0]})",
                limit,
                _int(read_text("/", os.path.join(path, files[1]))) or 0,
                need.new_bytes,
                "raise it to at least {need} (Kubernetes: resources.limits.hugepages-"
                f"{'2Mi' if size == '2MB' else '1Gi'} of the kvoffloadd container)",
                need.new_bytes,
            )
        )
    return out


def region_limits(need: Need, root: str = "/") -> list[Limit]:
    """Every limit the region must fit, in the order a refusal names them."""
    return (
        memory_cgroup_limits(need, root)
        + huge_page_limits(need, root)
        + filesystem_limit(need, root)
        + host_memory_limit(need, root)
    )


def refusal(limits: list[Limit], need: Need) -> str | None:
    """The message of a refused start (the first limit the region does not fit), or
    None when it fits them all."""
    for lim in limits:
        if lim.fits:
            continue
        short = lim.needed_bytes - lim.available_bytes
        pages = -(-short // need.backing.page_bytes)
        total_pages = -(-lim.limit_bytes // need.backing.page_bytes) + pages
        target = lim.limit_bytes + short
        fix = lim.fix.format(need=human(target), need_g=f"{-(-target // GIB)}G", pages=total_pages)
        fits = max(0, lim.region_share_bytes - short + need.resident_bytes)
        lower = (
            f"; or lower region_size to at most {human(fits)}"
            if lim.region_share_bytes and fits
            else ""
        )
        headroom = lim.needed_bytes - lim.region_share_bytes
        needs = (
            f"{human(lim.region_share_bytes)} more for the region" if lim.region_share_bytes else ""
        )
        if headroom > 0:
            needs += (" plus " if needs else "") + f"{human(headroom)} of memory_headroom"
        return (
            f"the region does not fit in the {lim.what}: it needs {needs}, and "
            f"{human(lim.available_bytes)} of {human(lim.limit_bytes)} is free ("
            f"{human(short)} short). Fix: {fix}{lower}"
        )
    return None

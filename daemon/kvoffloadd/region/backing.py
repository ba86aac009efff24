"""What backs the region: ordinary shared memory, hugetlbfs huge pages, or shmem
transparent huge pages; and which directory its file lives in.

Rules:
- ``huge_pages = "off"``: a file in ``/dev/shm`` (or ``region_dir``), which must be a
  tmpfs: a region on a disk filesystem would page to disk under every copy.
- ``"2M"`` / ``"1G"``: a file on a hugetlbfs mount of that page size: ``region_dir``,
  else the first such mount (systemd mounts ``/dev/hugepages`` with the default size).
  The pages come from the reserved pool (``nr_hugepages``): too few reserved is
  refused at start (limits.py), never a SIGBUS later. A kept file is adopted on warm
  restart like a /dev/shm segment.
- ``"thp"``: a tmpfs file whose mount allocates huge pages (``huge=always``,
  ``within_size`` or ``advise``, or the global ``shmem_enabled=force``); refused with
  the reason and the fix where the mount never will or ``shmem_enabled`` says deny.
  The populator advises MADV_HUGEPAGE, and the stats say how much came out huge.
- Every refusal names the setting, what was found and how to fix it.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass

from kvoffloadd.region.hostfs import Mount, mount_of, mounts, read_text
from kvoffloadd.region.segment import SHM_DIR, RegionError

HUGE_PAGE_BYTES = {"2M": 2 << 20, "1G": 1 << 30}
HUGE_PAGES = ("off", "2M", "1G", "thp")


class BackingError(RegionError):
    pass


@dataclass(frozen=True)
class Backing:
    huge_pages: str  # "off", "2M", "1G" or "thp"
    directory: str
    page_bytes: int  # the region's page size: the huge page size for hugetlbfs
    fstype: str
    how: str = ""  # thp: what enables it

    @property
    def is_hugetlb(self) -> bool:
        return self.fstype == "hugetlbfs"

    @property
    def size_name(self) -> str:
        """The kernel's name of the page size in cgroup files: "2MB", "1GB"."""
        kib = self.page_bytes >> 10
        return f"{kib >> 20}GB" if kib >= 1 << 20 else f"{kib >> 10}MB"


def parse_page_size(text: str) -> int:
    """``2M``, ``1G``, ``2048k`` (hugetlbfs's pagesize option) in bytes."""
    m = re.fullmatch(r"(\d+)([kKmMgG]?)[bB]?", text.strip())
    if not m:
        raise ValueError(f"not a page size: {text!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def default_huge_page_bytes(root: str = "/") -> int:
    m = re.search(r"Hugepagesize:\s+(\d+) kB", read_text(root, "/proc/meminfo") or "")
    return int(m.group(1)) << 10 if m else 2 << 20


def mount_page_bytes(m: Mount, root: str = "/") -> int:
    opt = m.option("pagesize")
    return parse_page_size(opt) if opt else default_huge_page_bytes(root)


def shmem_enabled(root: str = "/") -> str:
    """The bracketed value of /sys/kernel/mm/transparent_hugepage/shmem_enabled."""
    text = read_text(root, "/sys/kernel/mm/transparent_hugepage/shmem_enabled") or ""
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else "never"


def resolve_backing(huge_pages: str, region_dir: str = "", root: str = "/") -> Backing:
    table = mounts(root)
    if huge_pages in ("off", "thp"):
        directory = region_dir or SHM_DIR
        m = mount_of(directory, table)
        if m is None or m.fstype != "tmpfs":
            found = m.fstype if m is not None else "not mounted"
            raise BackingError(
                f"region_dir {directory} is not on a tmpfs ({found}): the region must "
                "live in memory; use /dev/shm, or a tmpfs mount"
            )
        how = thp_how(m, root) if huge_pages == "thp" else ""
        return Backing(huge_pages, directory, mmap.PAGESIZE, "tmpfs", how)
    size = HUGE_PAGE_BYTES[huge_pages]
    if not os.path.isdir(os.path.join(root, f"sys/kernel/mm/hugepages/hugepages-{size >> 10}kB")):
        raise BackingError(
            f'huge_pages = "{huge_pages}": this kernel or CPU offers no pages of that size '
            f"(no /sys/kernel/mm/hugepages/hugepages-{size >> 10}kB); use another size"
        )
    if region_dir:
        m = mount_of(region_dir, table)
        if m is None or m.fstype != "hugetlbfs" or mount_page_bytes(m, root) != size:
            what = "not hugetlbfs" if m is None or m.fstype != "hugetlbfs" else "another size"
            raise BackingError(
                f'huge_pages = "{huge_pages}": region_dir {region_dir} is {what}; mount one: '
                f"mount -t hugetlbfs -o pagesize={huge_pages},mode=0700 none {region_dir}"
            )
        return Backing(huge_pages, region_dir, size, "hugetlbfs")
    for m in table:
        if m.fstype == "hugetlbfs" and mount_page_bytes(m, root) == size:
            return Backing(huge_pages, m.point, size, "hugetlbfs")
    raise BackingError(
        f'huge_pages = "{huge_pages}" needs a hugetlbfs mount of {huge_pages} pages and none '
        f"is mounted: mount -t hugetlbfs -o pagesize={huge_pages},mode=0700 none "
        f"/dev/hugepages-{huge_pages} (or set region_dir to one)"
    )


def thp_how(m: Mount, root: str = "/") -> str:
    """How the tmpfs at ``m`` gets transparent huge pages; ``BackingError`` if never."""
    knob = shmem_enabled(root)
    if knob == "deny":
        raise BackingError(
            'huge_pages = "thp": /sys/kernel/mm/transparent_hugepage/shmem_enabled is '
            '"deny", which turns huge pages off for every tmpfs; set it to "advise" '
            'or use huge_pages = "2M" (hugetlbfs)'
        )
    if knob == "force":
        return "shmem_enabled=force"
    huge = m.option("huge") or "never"
    if huge in ("always", "within_size", "advise"):
        return f"huge={huge}"
    raise BackingError(
        f'huge_pages = "thp": {m.point} is a tmpfs mounted with huge={huge}, which never '
        f"allocates huge pages; remount it (mount -o remount,huge=within_size {m.point}), "
        "or mount a tmpfs with huge=within_size and set region_dir to it, or use "
        'huge_pages = "2M" (hugetlbfs)'
    )

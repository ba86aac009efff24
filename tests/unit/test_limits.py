"""No surprise OOM (invariant 16), on fake node trees: every limit that could kill the
daemon once its region is populated is found (cgroup v2 and v1 memory, the host's
memory, the region's filesystem, free huge pages per pool and per node, hugetlb
cgroups), and a refusal names the limit, its numbers and the fix; the backing of the
region (tmpfs, hugetlbfs, transparent huge pages) is refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_node import cgroup_v1, cgroup_v2, huge_pool, meminfo, mountinfo, thp, two_socket_node

from kvoffloadd.region.backing import Backing, BackingError, resolve_backing
from kvoffloadd.region.hostfs import cgroup_dirs, mount_of, mounts
from kvoffloadd.region.limits import Need, refusal, region_limits

GIB = 1 << 30
MIB = 1 << 20
SHM = Backing("off", "/dev/shm", 4096, "tmpfs")
HUGE_2M = Backing("2M", "/dev/hugepages", 2 * MIB, "hugetlbfs")


def node_v2(root: Path, max_bytes: str, current_bytes: int, pod_max: str = "max") -> None:
    mountinfo(root)
    meminfo(root, 2048 * GIB, 1900 * GIB)
    cgroup_v2(
        root,
        {
            "/": {"memory.max": pod_max, "memory.current": str(current_bytes)},
            "/kvoffloadd": {"memory.max": max_bytes, "memory.current": str(current_bytes)},
        },
        "cpu memory hugetlb",
    )


def test_the_mount_table_and_the_cgroups_are_read(tmp_path: Path) -> None:
    node_v2(tmp_path, str(3 * GIB), 0)
    table = mounts(str(tmp_path))
    shm = mount_of("/dev/shm", table)
    assert shm is not None and shm.fstype == "tmpfs" and shm.option("size") == "67108864k"
    huge = mount_of("/dev/hugepages/kvoffload-x", table)
    assert huge is not None and huge.option("pagesize") == "2M"
    dirs = cgroup_dirs("memory", str(tmp_path))
    assert dirs is not None and dirs.version == 2
    assert dirs.names == ["/kvoffloadd", "/"]


def test_a_cgroup_v2_limit_below_region_and_headroom_is_refused(tmp_path: Path) -> None:
    """Scenario: the issue's case: memory.max 3 GiB, a 4 GiB region."""
    node_v2(tmp_path, str(3 * GIB), 100 * MIB)
    need = Need(4 * GIB, 0, GIB, SHM)
    limits = region_limits(need, str(tmp_path))
    (cg,) = [lim for lim in limits if "cgroup" in lim.what]
    assert cg.what == "memory cgroup /kvoffloadd (memory.max)"
    assert not cg.fits and cg.needed_bytes == 5 * GIB
    why = refusal(limits, need)
    assert why is not None
    assert "memory cgroup /kvoffloadd (memory.max)" in why
    assert "4.00 GiB more for the region plus 1.00 GiB of memory_headroom" in why
    assert "2.90 GiB of 3.00 GiB is free" in why
    assert "MemoryMax=" in why and "resources.limits.memory" in why
    assert "at least 5.10 GiB" in why  # what is used already, plus region and headroom
    assert "lower region_size to at most 1.90 GiB" in why
    # the same region fits a limit that holds it
    node_v2(tmp_path, str(6 * GIB), 100 * MIB)
    assert refusal(region_limits(need, str(tmp_path)), need) is None


def test_a_limit_of_region_and_headroom_is_enough(tmp_path: Path) -> None:
    """The daemon's own memory, in its cgroup's usage at the check, is what the
    headroom is for: memory.max = region + headroom fits, one byte less does not."""
    region, headroom, own = 4 * GIB, GIB, 200 * MIB
    node_v2(tmp_path, str(region + headroom), own)
    need = Need(region, 0, headroom, SHM, own_bytes=own)
    assert refusal(region_limits(need, str(tmp_path)), need) is None
    node_v2(tmp_path, str(region + headroom - 1), own)
    assert refusal(region_limits(need, str(tmp_path)), need) is not None
    counted_twice = Need(region, 0, headroom, SHM)
    node_v2(tmp_path, str(region + headroom), own)
    assert refusal(region_limits(counted_twice, str(tmp_path)), counted_twice) is not None


def test_a_pod_limit_above_the_container_binds_too(tmp_path: Path) -> None:
    node_v2(tmp_path, "max", 0, pod_max=str(2 * GIB))
    need = Need(4 * GIB, 0, GIB, SHM)
    why = refusal(region_limits(need, str(tmp_path)), need)
    assert why is not None and "memory cgroup / (memory.max)" in why


def test_a_kept_region_counts_only_what_it_still_needs(tmp_path: Path) -> None:
    node_v2(tmp_path, str(3 * GIB), 0)
    kept = Need(4 * GIB, 4 * GIB, GIB, SHM)  # all resident: only the headroom is new
    assert kept.new_bytes == 0
    assert refusal(region_limits(kept, str(tmp_path)), kept) is None


def test_cgroup_v1_limits_are_found_in_their_hierarchy(tmp_path: Path) -> None:
    mountinfo(tmp_path, cgroup_v1=True)
    meminfo(tmp_path, 2048 * GIB, 1900 * GIB)
    cgroup_v1(
        tmp_path,
        {
            "memory": {
                "memory.limit_in_bytes": str(3 * GIB),
                "memory.usage_in_bytes": str(10 * MIB),
            },
            "cpu,cpuacct": {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"},
        },
    )
    dirs = cgroup_dirs("memory", str(tmp_path))
    assert dirs is not None and dirs.version == 1
    assert dirs.paths == [str(tmp_path / "sys/fs/cgroup/memory")]
    need = Need(4 * GIB, 0, GIB, SHM)
    why = refusal(region_limits(need, str(tmp_path)), need)
    assert why is not None
    assert "memory cgroup /kubepods/pod1/c1 (memory.limit_in_bytes)" in why
    # v1 writes "no limit" as a huge number
    cgroup_v1(tmp_path, {"memory": {"memory.limit_in_bytes": "9223372036854771712"}})
    assert refusal(region_limits(need, str(tmp_path)), need) is None


def test_the_host_memory_binds_without_any_cgroup_limit(tmp_path: Path) -> None:
    mountinfo(tmp_path)
    meminfo(tmp_path, 16 * GIB, 3 * GIB)
    need = Need(4 * GIB, 0, GIB, SHM)
    why = refusal(region_limits(need, str(tmp_path)), need)
    assert why is not None and "host memory (MemAvailable in /proc/meminfo)" in why


def test_too_few_free_huge_pages_are_refused_with_the_pool_to_grow(tmp_path: Path) -> None:
    node_v2(tmp_path, str(3 * GIB), 0)  # memory.max does not hold huge pages
    huge_pool(tmp_path, 2048, nr=1024, free=1000, resv=40)  # 960 pages = 1.875 GiB
    need = Need(2 * GIB, 0, GIB, HUGE_2M)
    limits = region_limits(need, str(tmp_path))
    (pool,) = [lim for lim in limits if "huge pages" in lim.what]
    assert pool.available_bytes == 960 * 2 * MIB
    why = refusal(limits, need)
    assert why is not None
    assert "2M huge pages (/sys/kernel/mm/hugepages/hugepages-2048kB)" in why
    assert "echo 1088 > /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages" in why
    # the memory cgroup holds only the headroom: a 2 GiB limit is enough for a 2 GiB
    # region in huge pages, which would not fit as 4 KiB pages
    huge_pool(tmp_path, 2048, nr=2048, free=2048)
    node_v2(tmp_path, str(2 * GIB), 0)
    assert refusal(region_limits(need, str(tmp_path)), need) is None
    assert refusal(region_limits(Need(2 * GIB, 0, GIB, SHM), str(tmp_path)), need) is not None


def test_huge_pages_are_needed_on_each_node_that_holds_a_part(tmp_path: Path) -> None:
    node_v2(tmp_path, "max", 0)
    two_socket_node(tmp_path, (4, 4), huge_pages_2m=(512, 512))  # 1 GiB free per node
    huge_pool(tmp_path, 2048, nr=1024, free=1024)
    need = Need(2 * GIB, 0, 0, HUGE_2M, {0: 1 * GIB, 1: 1 * GIB})
    assert refusal(region_limits(need, str(tmp_path)), need) is None
    uneven = Need(2 * GIB, 0, 0, HUGE_2M, {0: 1536 * MIB, 1: 512 * MIB})
    why = refusal(region_limits(uneven, str(tmp_path)), uneven)
    assert why is not None and "huge pages on NUMA node 0" in why
    assert "/sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages" in why


def test_a_hugetlb_cgroup_limit_binds_huge_pages(tmp_path: Path) -> None:
    node_v2(tmp_path, "max", 0)
    huge_pool(tmp_path, 2048, nr=4096, free=4096)
    cgroup_v2(
        tmp_path,
        {"/kvoffloadd": {"hugetlb.2MB.max": str(GIB), "hugetlb.2MB.current": "0"}},
        "cpu memory hugetlb",
    )
    need = Need(2 * GIB, 0, 0, HUGE_2M)
    why = refusal(region_limits(need, str(tmp_path)), need)
    assert why is not None and "hugetlb cgroup /kvoffloadd (hugetlb.2MB.max)" in why
    assert "hugepages-2Mi" in why


def test_a_small_tmpfs_is_refused(tmp_path: Path) -> None:
    mountinfo(tmp_path)
    (tmp_path / "dev/shm").mkdir(parents=True)  # statvfs of the test's own filesystem
    import os

    st = os.statvfs(tmp_path / "dev/shm")
    free = st.f_bavail * st.f_frsize
    need = Need(free + GIB, 0, 0, SHM)
    (fs,) = [lim for lim in region_limits(need, str(tmp_path)) if lim.what.startswith("/dev/shm")]
    assert not fs.fits
    why = refusal([fs], need)
    assert why is not None and "--shm-size" in why


# ------------------------------------------------------------ backing


def test_huge_pages_find_their_hugetlbfs_mount(tmp_path: Path) -> None:
    mountinfo(tmp_path)
    meminfo(tmp_path, 64 * GIB, 60 * GIB)
    huge_pool(tmp_path, 2048, 0, 0)
    huge_pool(tmp_path, 1048576, 0, 0)
    b = resolve_backing("2M", root=str(tmp_path))
    assert (b.directory, b.page_bytes, b.size_name) == ("/dev/hugepages", 2 * MIB, "2MB")
    b = resolve_backing("1G", root=str(tmp_path))
    assert (b.directory, b.page_bytes, b.size_name) == ("/mnt/huge1g", GIB, "1GB")
    with pytest.raises(BackingError, match="region_dir /dev/shm is not hugetlbfs"):
        resolve_backing("2M", "/dev/shm", str(tmp_path))
    with pytest.raises(BackingError, match="another size"):
        resolve_backing("2M", "/mnt/huge1g", str(tmp_path))
    mountinfo(tmp_path, extra=[])
    (tmp_path / "proc/self/mountinfo").write_text("30 22 0:26 / /dev/shm rw - tmpfs shm rw\n")
    with pytest.raises(BackingError, match="mount -t hugetlbfs -o pagesize=2M"):
        resolve_backing("2M", root=str(tmp_path))


def test_a_region_dir_on_disk_is_refused(tmp_path: Path) -> None:
    mountinfo(tmp_path)
    with pytest.raises(BackingError, match="is not on a tmpfs"):
        resolve_backing("off", "/var/lib/kvoffload", str(tmp_path))


def test_thp_needs_a_tmpfs_that_allocates_huge_pages(tmp_path: Path) -> None:
    mountinfo(tmp_path, extra=["50 22 0:40 / /run/kvo-thp rw - tmpfs tmpfs rw,huge=within_size"])
    thp(tmp_path, shmem="never")
    with pytest.raises(BackingError, match=r"huge=never.*remount,huge=within_size /dev/shm"):
        resolve_backing("thp", root=str(tmp_path))
    assert resolve_backing("thp", "/run/kvo-thp", str(tmp_path)).how == "huge=within_size"
    thp(tmp_path, shmem="force")
    assert resolve_backing("thp", root=str(tmp_path)).how == "shmem_enabled=force"
    thp(tmp_path, shmem="deny")
    with pytest.raises(BackingError, match="deny"):
        resolve_backing("thp", "/run/kvo-thp", str(tmp_path))

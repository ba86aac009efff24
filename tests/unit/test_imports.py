"""Engine memory the daemon imports: only the rows caches claim, one mapping per file,
nothing allocated on the daemon's account."""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time

import pytest

from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.messages import CacheDesc
from kvoffloadd import loopthread
from kvoffloadd.copies.imports import (
    DescriptorCache,
    FileMapping,
    MappedCache,
    map_file,
    plan_import,
    run_import,
)

MIB = 1 << 20
PAGE = mmap.PAGESIZE


def memfd(nbytes: int, sealed: bool = True, touch: tuple[int, int] | None = (0, -1)) -> int:
    """A memfd of ``nbytes``; pages in ``touch`` (start, end; -1: the end) written."""
    fd = os.memfd_create("t", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealed else 0))
    os.ftruncate(fd, nbytes)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    if touch is not None:
        start, end = touch
        os.pwrite(fd, b"\1" * ((nbytes if end < 0 else end) - start), start)
    return fd


def rss_shmem_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    return 0


def test_caches_over_one_file_share_one_mapping_of_the_rows_they_claim() -> None:
    """Three caches over one 64 MiB memfd, named by three descriptors: one mapping of
    the 2 MiB their rows span, charged as such."""
    fd = memfd(64 * MIB)
    fds = [fd, os.dup(fd), os.dup(fd)]
    descs = [CacheDesc("memfd", 4, 64 * 1024, i, 8 * MIB + i * 256 * 1024, 0) for i in range(3)]
    plan = plan_import(descs, fds)
    assert plan.charges() == {
        "caches": 3,
        "mappings": 1,
        "mapped_bytes": 2 * 256 * 1024 + 4 * 64 * 1024,
        "descriptors": 0,
    }
    caches = run_import(plan)
    assert all(isinstance(c, MappedCache) for c in caches)
    assert len({id(c.mapping) for c in caches}) == 1
    deadline = time.monotonic() + 10  # the engine's descriptors are the import's to
    while any(os.path.exists(f"/proc/self/fd/{fd_}") for fd_ in fds):  # close (closer)
        assert time.monotonic() < deadline, "the import left a descriptor open"
        time.sleep(0.01)
    for c in caches:
        c.close()


def test_a_claim_of_one_row_of_a_huge_sparse_file_maps_and_faults_one_row() -> None:
    """768 MiB memfd_io, one 16 KiB row claimed (and populated): the daemon maps that
    row's pages only and faults none of the file."""
    big = 768 * MIB
    fd = memfd(big, sealed=False, touch=(big - 16 * 1024, big))
    before = rss_shmem_bytes()
    plan = plan_import([CacheDesc("memfd_io", 1, 16 * 1024, 0, big - 16 * 1024, 0)], [fd])
    assert plan.charges()["mapped_bytes"] == 16 * 1024
    assert plan.charges()["descriptors"] == 1
    (cache,) = run_import(plan)
    assert isinstance(cache, DescriptorCache)
    assert cache.mapping.nbytes == 16 * 1024
    assert rss_shmem_bytes() - before < MIB  # not the 768 MiB file
    cache.close()
    assert cache.mapping.fd == -1  # the daemon's duplicate went with its last cache


def test_memory_the_engine_never_touched_is_refused_not_allocated() -> None:
    fd = memfd(16 * MIB, sealed=False, touch=(0, MIB))  # the rest is a hole
    plan = plan_import([CacheDesc("memfd_io", 16, MIB, 0, 0, 0)], [fd])
    before = rss_shmem_bytes()
    with pytest.raises(InvalidArgumentError, match="never touched"):
        run_import(plan)
    assert rss_shmem_bytes() - before < MIB


def test_a_file_whose_size_is_not_whole_pages_is_imported_whole() -> None:
    """vLLM sizes its KV buffer in bytes, not pages: the last page is part file, part
    past its end, and that is no hole."""
    nbytes = 120 * PAGE + 3 * 1024
    fd = memfd(nbytes)
    caches = run_import(plan_import([CacheDesc("memfd", 1, nbytes, 0)], [fd]))
    assert [c.nbytes for c in caches] == [nbytes]
    for c in caches:
        c.close()


def test_a_refused_plan_names_what_is_wrong() -> None:
    fd = memfd(MIB, sealed=False)
    with pytest.raises(InvalidArgumentError, match="sealed against shrinking"):
        plan_import([CacheDesc("memfd", 1, 4096, 0)], [fd])
    with pytest.raises(InvalidArgumentError, match="all 'memfd' or all 'memfd_io'"):
        plan_import([CacheDesc("memfd", 1, 4096, 0), CacheDesc("memfd_io", 1, 4096, 0)], [fd])
    with pytest.raises(InvalidArgumentError, match="holds 1048576"):
        plan_import([CacheDesc("memfd_io", 2, MIB, 0)], [fd])
    with pytest.raises(InvalidArgumentError, match="descriptor #3"):
        plan_import([CacheDesc("memfd_io", 1, 4096, 3)], [fd])
    r, w = os.pipe()
    with pytest.raises(InvalidArgumentError, match="memfd or shared-memory"):
        plan_import([CacheDesc("memfd_io", 1, 4096, 0)], [r])
    for x in (fd, r, w):
        os.close(x)


def test_nothing_maps_on_the_loop_thread() -> None:
    """Invariant 15 by construction: the loop claims its thread, and a mapping made on it
    is a broken invariant; the same mapping on another thread (a copier's) is made."""
    fd = memfd(PAGE)
    mapped: list[int] = []
    loopthread.claim()
    try:
        with pytest.raises(AssertionError, match="loop thread"):
            map_file(fd, PAGE, 0)
        t = threading.Thread(target=lambda: mapped.append(map_file(fd, PAGE, 0)))
        t.start()
        t.join(timeout=10)
    finally:
        loopthread.release()
        os.close(fd)
    assert len(mapped) == 1
    FileMapping(mapped[0], PAGE, 0, users=1).release()

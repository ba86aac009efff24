"""The region's shared-memory segment: its geometry and header; finding, checking,
creating and dropping it.

Rules:
- A segment is a file in a memory filesystem: ``/dev/shm`` (tmpfs, as ``shm_open``
  makes them) by default, a hugetlbfs mount for huge pages (backing.py). It is opened
  ``O_NOFOLLOW`` (never through a link), and a found segment is checked on the
  descriptor that is then used: a regular file of the daemon's uid with no group or
  other bits (``check_ours``).
- One daemon per segment: an exclusive ``flock`` on the segment itself (``lock``),
  taken before anything in it is read or changed.
- A segment is created ``O_CREAT|O_EXCL``, mode 0600, at its full size (a multiple of
  its page size); a found one is never resized.
- ``problem`` says why a segment cannot be recovered as a region of a geometry (its
  size, its magic, its format version, its header fields), or ``None``: a segment
  cut short would fault (SIGBUS) at the first touch beyond its end.
- Which name is the daemon's region is regionstate.py's business; this module only
  acts on the name it is given.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import time
from dataclasses import dataclass
from typing import Protocol

from kvoffload.datapath.regionfmt import (
    DATA_ALIGN_BYTES,
    EXTENT_RECORD_BYTES,
    FORMAT_VERSION,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MAX_NAMESPACES,
    NAMESPACE_RECORD_BYTES,
    SLOT_RECORD_BYTES,
)
from kvoffloadd.trust import UntrustedError, check_private_file, lock_region

HEADER_CHECKED_FIELDS = 14  # all but the owner's pid and the creation time
SHM_DIR = "/dev/shm"


class RegionError(RuntimeError):
    pass


@dataclass(frozen=True)
class Geometry:
    region_bytes: int
    extent_bytes: int
    num_extents: int
    slots_per_extent_max: int
    min_slot_bytes: int
    extent_table: int
    namespace_table: int
    slot_table: int
    data_offset: int
    page_bytes: int = mmap.PAGESIZE

    @staticmethod
    def plan(
        region_bytes: int, extent_bytes: int, min_slot_bytes: int, page_bytes: int = mmap.PAGESIZE
    ) -> Geometry:
        """The layout of a region of at most ``region_bytes``; with huge pages of
        ``page_bytes``, the data area starts on one and extents are whole ones."""
        if extent_bytes % mmap.PAGESIZE or min_slot_bytes % mmap.PAGESIZE:
            raise RegionError("extent_bytes and min_slot_bytes must be multiples of the page size")
        if extent_bytes % page_bytes:
            raise RegionError(
                f"extent_size {extent_bytes} is not a multiple of the huge page size "
                f"{page_bytes}: set extent_size to a multiple of it"
            )
        align = max(DATA_ALIGN_BYTES, page_bytes)
        if min_slot_bytes > extent_bytes:
            raise RegionError("min_slot_bytes is larger than extent_bytes")
        spe = extent_bytes // min_slot_bytes
        per_extent = extent_bytes + EXTENT_RECORD_BYTES + spe * SLOT_RECORD_BYTES
        fixed = HEADER_BYTES + MAX_NAMESPACES * NAMESPACE_RECORD_BYTES
        if align == DATA_ALIGN_BYTES:  # as every region without huge pages was planned
            num_extents = (region_bytes - fixed - 2 * align) // per_extent
        else:  # the most extents whose tables, rounded up to a huge page, still fit
            num_extents = (region_bytes - fixed) // per_extent
            meta = per_extent - extent_bytes
            while num_extents > 0 and (
                -(-(fixed + num_extents * meta) // align) * align + num_extents * extent_bytes
                > region_bytes
            ):
                num_extents -= 1
        if num_extents < 1:
            raise RegionError(
                f"a region of {region_bytes} bytes cannot hold one extent of {extent_bytes} bytes"
            )
        extent_table = HEADER_BYTES
        namespace_table = extent_table + num_extents * EXTENT_RECORD_BYTES
        slot_table = namespace_table + MAX_NAMESPACES * NAMESPACE_RECORD_BYTES
        meta_end = slot_table + num_extents * spe * SLOT_RECORD_BYTES
        data_offset = -(-meta_end // align) * align
        return Geometry(
            region_bytes=data_offset + num_extents * extent_bytes,
            extent_bytes=extent_bytes,
            num_extents=num_extents,
            slots_per_extent_max=spe,
            min_slot_bytes=min_slot_bytes,
            extent_table=extent_table,
            namespace_table=namespace_table,
            slot_table=slot_table,
            data_offset=data_offset,
            page_bytes=page_bytes,
        )

    @property
    def data_bytes(self) -> int:
        return self.num_extents * self.extent_bytes


def default_extent_bytes(region_bytes: int) -> int:
    """About 64 extents per region, between 2 MiB and 256 MiB, a power of two."""
    target = max(DATA_ALIGN_BYTES, min(256 * 1024 * 1024, region_bytes // 64))
    return 1 << (target.bit_length() - 1)


def header_fields(g: Geometry) -> tuple[object, ...]:
    return (
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        g.region_bytes,
        g.extent_bytes,
        g.num_extents,
        g.slots_per_extent_max,
        g.min_slot_bytes,
        MAX_NAMESPACES,
        g.extent_table,
        g.namespace_table,
        g.slot_table,
        SLOT_RECORD_BYTES,
        g.data_offset,
        os.getpid(),
        time.time_ns(),
    )


class HasFd(Protocol):
    @property
    def fd(self) -> int: ...


class SegmentFile:
    """A region file, opened; what the region uses of it (as of ``posix_ipc``'s
    SharedMemory, whose files in /dev/shm these are)."""

    def __init__(self, directory: str, name: str, fd: int) -> None:
        self.directory = directory
        self.name = name
        self.fd = fd

    @property
    def path(self) -> str:
        return path_of(self.name, self.directory)

    def close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def unlink(self) -> None:
        os.unlink(self.path)


def path_of(name: str, directory: str = SHM_DIR) -> str:
    return os.path.join(directory, name.lstrip("/"))


def find(name: str, directory: str = SHM_DIR) -> SegmentFile | None:
    """The segment under ``name``, not checked yet, or None; ``UntrustedError`` when
    something is there that cannot be ours (a link, another uid's private file)."""
    path = path_of(name, directory)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except PermissionError:
        raise UntrustedError(f"{path} belongs to another uid") from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise UntrustedError(f"{path} is a symlink") from None
    return SegmentFile(directory, name, fd)


def check_ours(
    shm: SegmentFile,
    name: str,
    remedy: str = "remove it, or start with --discard-region",
) -> None:
    """``UntrustedError`` unless the segment is a private file of the daemon's uid."""
    check_private_file(shm.fd, shm.path, remedy)


def lock(shm: SegmentFile, name: str) -> None:
    """Hold the segment for this daemon; ``RegionError`` if another one does."""
    try:
        lock_region(shm.fd, name)
    except UntrustedError as exc:
        shm.close_fd()
        raise RegionError(str(exc)) from None


def create(name: str, g: Geometry, directory: str = SHM_DIR) -> SegmentFile:
    """A new segment of the geometry's size, held by this daemon; ``FileExistsError``
    if anything (a file, a link) has the name."""
    path = path_of(name, directory)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    shm = SegmentFile(directory, name, fd)
    try:
        lock_region(fd, name)  # ours alone: O_EXCL just made it
        os.ftruncate(fd, g.region_bytes)
    except BaseException:
        shm.close_fd()
        os.unlink(path)
        raise
    return shm


def allocated_bytes(shm: SegmentFile | HasFd) -> int:
    """Bytes of the segment that hold pages (a kept region's are resident): tmpfs and
    hugetlbfs both count a file's pages in its blocks."""
    st = os.fstat(shm.fd)
    return min(st.st_size, st.st_blocks * 512)


def problem(shm: SegmentFile, g: Geometry) -> str | None:
    """Why the segment is not a region of geometry ``g`` in this format; None if it is."""
    size = os.fstat(shm.fd).st_size
    found: tuple[object, ...] = ()
    if size >= HEADER.size:
        with mmap.mmap(shm.fd, HEADER.size, prot=mmap.PROT_READ) as mm:
            found = tuple(HEADER.unpack(mm[: HEADER.size]))[:HEADER_CHECKED_FIELDS]
    if found[:2] != (MAGIC, FORMAT_VERSION):
        if found[:1] == (MAGIC,):
            return (
                f"holds a region of format version {found[1]} (this daemon reads {FORMAT_VERSION})"
            )
        return "holds a segment that is not a kvoffload region"
    if found != header_fields(g)[:HEADER_CHECKED_FIELDS]:
        return f"holds a region of {found[3]} bytes in extents of {found[4]} bytes"
    if size != g.region_bytes:
        return f"is {size} bytes long, its header says {g.region_bytes}"
    return None


def drop(name: str, directory: str = SHM_DIR) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path_of(name, directory))

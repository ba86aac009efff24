"""The region's shared-memory segment: its geometry and header; finding, checking,
creating and dropping it.

Rules:
- ``shm_open`` never follows a link (glibc opens ``/dev/shm/<name>`` with
  ``O_NOFOLLOW``), and a found segment is checked on the descriptor that is then used:
  a regular file of the daemon's uid with no group or other bits (``check_ours``).
- One daemon per segment: an exclusive ``flock`` on the segment itself (``lock``),
  taken before anything in it is read or changed.
- A segment is created ``O_CREAT|O_EXCL``, mode 0600, at its full size; a found one is
  opened with size 0, never resized.
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

import posix_ipc

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

    @staticmethod
    def plan(region_bytes: int, extent_bytes: int, min_slot_bytes: int) -> Geometry:
        if extent_bytes % mmap.PAGESIZE or min_slot_bytes % mmap.PAGESIZE:
            raise RegionError("extent_bytes and min_slot_bytes must be multiples of the page size")
        if min_slot_bytes > extent_bytes:
            raise RegionError("min_slot_bytes is larger than extent_bytes")
        spe = extent_bytes // min_slot_bytes
        per_extent = extent_bytes + EXTENT_RECORD_BYTES + spe * SLOT_RECORD_BYTES
        fixed = HEADER_BYTES + MAX_NAMESPACES * NAMESPACE_RECORD_BYTES + 2 * DATA_ALIGN_BYTES
        num_extents = (region_bytes - fixed) // per_extent
        if num_extents < 1:
            raise RegionError(
                f"a region of {region_bytes} bytes cannot hold one extent of {extent_bytes} bytes"
            )
        extent_table = HEADER_BYTES
        namespace_table = extent_table + num_extents * EXTENT_RECORD_BYTES
        slot_table = namespace_table + MAX_NAMESPACES * NAMESPACE_RECORD_BYTES
        meta_end = slot_table + num_extents * spe * SLOT_RECORD_BYTES
        data_offset = -(-meta_end // DATA_ALIGN_BYTES) * DATA_ALIGN_BYTES
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
        )


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


def find(name: str) -> posix_ipc.SharedMemory | None:
    """The segment under ``name``, not checked yet, or None; ``UntrustedError`` when
    something is there that cannot be ours (a link, another uid's private file)."""
    try:
        return posix_ipc.SharedMemory(name)  # size 0: never resize what is found
    except posix_ipc.ExistentialError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise UntrustedError(f"/dev/shm{name} is a symlink") from None
    except posix_ipc.PermissionsError:
        raise UntrustedError(f"/dev/shm{name} belongs to another uid") from None


def check_ours(
    shm: posix_ipc.SharedMemory,
    name: str,
    remedy: str = "remove it, or start with --discard-region",
) -> None:
    """``UntrustedError`` unless the segment is a private file of the daemon's uid."""
    check_private_file(shm.fd, f"/dev/shm{name}", remedy)


def lock(shm: posix_ipc.SharedMemory, name: str) -> None:
    """Hold the segment for this daemon; ``RegionError`` if another one does."""
    try:
        lock_region(shm.fd, name)
    except UntrustedError as exc:
        shm.close_fd()
        raise RegionError(str(exc)) from None


def create(name: str, g: Geometry) -> posix_ipc.SharedMemory:
    """A new segment of the geometry's size, held by this daemon;
    ``posix_ipc.ExistentialError`` if anything (a file, a link) has the name."""
    check_space(g.region_bytes)
    shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=g.region_bytes)
    lock_region(shm.fd, name)  # ours alone: O_CREX just made it
    return shm


def problem(shm: posix_ipc.SharedMemory, g: Geometry) -> str | None:
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


def drop(name: str) -> None:
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(name)


def check_space(nbytes: int) -> None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return
    avail = st.f_bavail * st.f_frsize
    if avail < nbytes:
        raise RegionError(
            f"/dev/shm has {avail} bytes free, the region needs {nbytes}; "
            "lower region_size or enlarge /dev/shm"
        )

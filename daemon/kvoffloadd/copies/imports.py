"""Engine memory the daemon imports: one mapping per file, of the rows caches claim only.

A CPU worker registers its caches as descriptors (SCM_RIGHTS) plus the geometry each
claims. Whatever it claims, the daemon holds only what the claim needs:

Rules:
- The loop plans an import (``plan_import``): each cache's geometry is checked, each
  descriptor is fstat-ed and checked (a regular shared-memory file: sealed against
  shrinking for kind ``memfd``, opened read-write for ``memfd_io``), and caches are
  grouped by the file behind them (device and inode): caches over one file, however
  many descriptors name it, share one mapping of the pages their rows span, never the
  whole file. What the import will hold (caches, mappings, mapped bytes, descriptors)
  is what the service charges to the peer before anything is mapped (``charges``).
- A copier thread maps (``run_import``): nothing maps on the loop thread.
- Nothing is pre-faulted: a copy faults only the pages it touches. A file whose claimed
  span has a hole (a page the engine never touched) at import is refused
  (``kvoffload.shared_kv_cache`` and SGLang's shm host pool pre-fault theirs). A hole
  an unsealable file gets later (the engine shrinks and regrows it) is filled by the
  daemon's next copy through it, charged to the daemon's memory: at most the span
  mapped, which the ledger charged to the peer at import (``mapped_bytes``).
- ``memfd_io`` files keep one duplicate descriptor per file, for system-call copies
  where the C copy loop is not built (``fdcopy``); their mapping is touched by the
  guarded copy or system calls only.
- A mapping and its descriptor close when the last cache using them closes, on a
  copier thread (unmapping what copies touched is page-table work); the engine's
  descriptors are closed by the import, whatever happens.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import stat
from dataclasses import dataclass, field

from kvoffload.datapath.runs import CacheGeometry
from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.messages import CacheDesc
from kvoffloadd.copies.closer import close_fds
from kvoffloadd.loopthread import off_loop

MEMFD, MEMFD_IO = "memfd", "memfd_io"
PAGE_BYTES = mmap.PAGESIZE
_F_SEAL_SHRINK = 0x0002


def check_desc(desc: CacheDesc) -> CacheGeometry:
    """The geometry a descriptor claims, if it is sane (``place_caches`` checks that
    the pages fit the namespace layout)."""
    stride = desc.row_stride_bytes or desc.page_bytes
    if (
        desc.num_blocks <= 0
        or desc.page_bytes <= 0
        or stride < desc.page_bytes
        or desc.offset_bytes < 0
    ):
        raise InvalidArgumentError(
            f"bad cache geometry: {desc.num_blocks} blocks, stride {stride}, "
            f"page {desc.page_bytes}, offset {desc.offset_bytes}"
        )
    return CacheGeometry(desc.num_blocks, desc.page_bytes, desc.offset_bytes, stride)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_long,
    ]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


_LIBC = _libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_file(fd: int, nbytes: int, offset: int) -> int:
    """Map ``nbytes`` of the file at ``offset`` shared, read-write; the address. Not
    Python's ``mmap``: it keeps a duplicate of the descriptor for as long as it lives,
    one descriptor per mapping the ledger would have to count."""
    off_loop("mapping an engine's memory")
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED
    address = _LIBC.mmap(None, nbytes, prot, flags, fd, offset)
    if address in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(address)


@dataclass
class FileMapping:
    """One mapping of the pages caches over one file claim, shared by those caches."""

    address: int  # where file offset ``lo`` is mapped
    nbytes: int
    lo: int
    fd: int = -1  # the daemon's duplicate of the file's descriptor (memfd_io only)
    users: int = 0

    @property
    def base_address(self) -> int:
        """Where file offset 0 would be: a cache's rows are at base + their offsets."""
        return self.address - self.lo

    def release(self) -> None:
        self.users -= 1
        if self.users > 0:
            return
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
        if self.address:
            off_loop("unmapping an engine's memory")
            _LIBC.munmap(self.address, self.nbytes)
            self.address = 0


@dataclass
class MappedCache:
    """A sealed memfd cache, copied by memmove through the shared mapping."""

    geometry: CacheGeometry
    mapping: FileMapping
    base_address: int = field(init=False)
    closed: bool = False

    def __post_init__(self) -> None:
        self.base_address = self.mapping.base_address
        self.mapping.users += 1

    @property
    def nbytes(self) -> int:
        return self.geometry.end_bytes - self.geometry.offset_bytes

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.mapping.release()


@dataclass
class DescriptorCache:
    """An unsealable memfd cache, copied by the guarded C copy or system calls (``fdcopy``)."""

    geometry: CacheGeometry
    mapping: FileMapping
    base_address: int = 0  # runs address the descriptor by file offset
    map_address: int = field(init=False)  # file offset 0 in the mapping of the rows
    fd: int = field(init=False)

    def __post_init__(self) -> None:
        self.map_address = self.mapping.base_address
        self.fd = self.mapping.fd
        self.mapping.users += 1

    @property
    def nbytes(self) -> int:
        return self.geometry.end_bytes - self.geometry.offset_bytes

    def close(self) -> None:
        if self.fd >= 0:
            self.fd = -1
            self.mapping.release()


@dataclass(frozen=True)
class FileGroup:
    """Caches over one file: the engine's descriptor, and the page span they claim."""

    fd: int
    lo: int
    hi: int  # page-aligned: may pass the end of a file whose size is not
    caches: tuple[int, ...]  # indices into the plan's caches
    file_bytes: int  # the file's size: past it, no page is expected


@dataclass(frozen=True)
class ImportPlan:
    kind: str
    geometries: list[CacheGeometry]
    groups: list[FileGroup]
    fds: list[int]  # every descriptor that came with the message: closed by the import

    def charges(self) -> dict[str, int]:
        """What the import will hold, as ledger lines."""
        return {
            "caches": len(self.geometries),
            "mappings": len(self.groups),
            "mapped_bytes": sum(g.hi - g.lo for g in self.groups),
            "descriptors": len(self.groups) if self.kind == MEMFD_IO else 0,
        }


def plan_import(descs: list[CacheDesc], fds: list[int]) -> ImportPlan:
    """Check a worker's CPU caches and group them by file (loop thread: no mapping).
    Raises InvalidArgumentError; closes nothing."""
    kinds = {d.kind for d in descs}
    if not descs or len(kinds) > 1 or not kinds <= {MEMFD, MEMFD_IO}:
        raise InvalidArgumentError(
            f"a worker's caches must be all 'memfd' or all 'memfd_io', got {sorted(kinds)}"
        )
    kind = descs[0].kind
    geometries = [check_desc(d) for d in descs]
    files: dict[tuple[int, int], tuple[int, list[int]]] = {}  # (dev, ino) -> fd, caches
    file_of: dict[int, tuple[tuple[int, int], int]] = {}  # fd -> (dev, ino), size
    for i, d in enumerate(descs):
        if not 0 <= d.fd_index < len(fds):
            raise InvalidArgumentError(
                f"cache refers to descriptor #{d.fd_index}, but {len(fds)} came with the message"
            )
        fd = fds[d.fd_index]
        if fd not in file_of:
            st = _check_file(fd, kind)
            file_of[fd] = (st.st_dev, st.st_ino), st.st_size
        key, size = file_of[fd]
        if geometries[i].end_bytes > size:
            raise InvalidArgumentError(
                f"cache needs {geometries[i].end_bytes} bytes but its memfd holds {size}"
            )
        files.setdefault(key, (fd, []))[1].append(i)
    groups = []
    for fd, members in files.values():
        lo = min(geometries[i].offset_bytes for i in members) // PAGE_BYTES * PAGE_BYTES
        end = max(geometries[i].end_bytes for i in members)
        hi = -(-end // PAGE_BYTES) * PAGE_BYTES
        groups.append(FileGroup(fd, lo, hi, tuple(members), file_of[fd][1]))
    return ImportPlan(kind, geometries, groups, list(fds))


def _check_file(fd: int, kind: str) -> os.stat_result:
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise InvalidArgumentError(
            f"a {kind} cache must be a memfd or shared-memory file descriptor"
        ) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgumentError(f"a {kind} cache must be a regular shared-memory file")
    if kind == MEMFD and not seals & _F_SEAL_SHRINK:
        raise InvalidArgumentError(
            "cache descriptor is not a memfd sealed against shrinking; "
            "allocate CPU caches with kvoffload.shared_kv_cache()"
        )
    if kind == MEMFD_IO and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise InvalidArgumentError("a memfd_io cache must be a regular file opened read-write")
    return st


def run_import(plan: ImportPlan) -> list[MappedCache | DescriptorCache]:
    """Map each file's span and make the caches (a copier thread). Raises
    InvalidArgumentError; always closes the engine's descriptors."""
    made: list[FileMapping] = []
    try:
        caches: list[MappedCache | DescriptorCache | None] = [None] * len(plan.geometries)
        for g in plan.groups:
            hole = _first_hole(g.fd, g.lo, g.hi)
            if hole < min(g.hi, g.file_bytes):
                raise InvalidArgumentError(
                    f"the cache memory at byte {hole} of its memfd was never touched (a "
                    "hole): the daemon does not allocate an engine's memory; pre-fault it "
                    "(kvoffload.shared_kv_cache does)"
                )
            fm = FileMapping(map_file(g.fd, g.hi - g.lo, g.lo), g.hi - g.lo, g.lo)
            made.append(fm)
            if plan.kind == MEMFD_IO:
                fm.fd = os.dup(g.fd)
            for i in g.caches:
                geo = plan.geometries[i]
                caches[i] = (
                    DescriptorCache(geo, fm) if plan.kind == MEMFD_IO else MappedCache(geo, fm)
                )
        out = [c for c in caches if c is not None]
        assert len(out) == len(caches)
        return out
    except BaseException:
        for fm in made:
            fm.users = 1
            fm.release()
        raise
    finally:
        close_fds(plan.fds)  # a peer's: an unused one may be anything (closer.py)


def _first_hole(fd: int, lo: int, hi: int) -> int:
    """The first byte in [lo, hi) that no page backs, or ``hi`` (SEEK_HOLE: a hole
    at the end of the file counts too)."""
    try:
        return os.lseek(fd, lo, os.SEEK_HOLE)
    except OSError:
        return hi

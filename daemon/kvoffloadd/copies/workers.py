"""Engine caches imported into the daemon: memfd-backed CPU KV tensors, and the
registration record of one worker (CUDA caches are imported by ``gpu``).

Rules:
- A cache arrives as a file descriptor (SCM_RIGHTS) plus a ``CacheDesc``. The daemon
  maps it only if the fd is sealed against shrinking (``F_SEAL_SHRINK``): otherwise
  the engine could truncate it under a running copy and crash the daemon with SIGBUS.
- Sizes are checked against the fd: every engine block id the daemon will accept
  (``0 .. num_blocks-1``) lies inside the mapping (invariant 4).
- Unsealable memfds (kind ``memfd_io``) are never mapped: ``fdcopy`` copies through
  them by descriptor, and a worker's caches are all of one kind.
- Descriptors are closed as soon as they are mapped; the mapping lives until the
  worker detaches or its client dies *and* its in-flight copies have drained.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvoffload.datapath.canonical import area_of
from kvoffload.datapath.copyplan import CacheGeometry, Placement
from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.messages import CacheDesc, JobResult
from kvoffloadd.copies.copier import ChecksumCheck
from kvoffloadd.copies.fdcopy import MEMFD_IO, import_descriptor, is_descriptor

_F_SEAL_SHRINK = 0x0002


class ImportedCache(Protocol):
    """An engine cache the daemon can address: CPU mapping or imported GPU memory."""

    @property
    def geometry(self) -> CacheGeometry: ...
    @property
    def base_address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def close(self) -> None: ...


@dataclass
class MappedCache:
    geometry: CacheGeometry
    mm: mmap.mmap
    array: npt.NDArray[np.uint8]
    base_address: int = field(init=False)  # read once: numpy's ctypes.data costs ~2 us

    def __post_init__(self) -> None:
        self.base_address = int(self.array.ctypes.data)

    @property
    def nbytes(self) -> int:
        return len(self.mm)

    def close(self) -> None:
        del self.array
        self.mm.close()


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


def map_cache(desc: CacheDesc, fd: int) -> MappedCache:
    """Validate and map one memfd cache; raises InvalidArgumentError."""
    if desc.kind != "memfd":
        raise InvalidArgumentError(
            f"cache kind {desc.kind!r} is not supported here (expected 'memfd')"
        )
    geometry = check_desc(desc)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if not seals & _F_SEAL_SHRINK:
        raise InvalidArgumentError(
            "cache descriptor is not a memfd sealed against shrinking; "
            "allocate CPU caches with kvoffload.shared_kv_cache()"
        )
    size = os.fstat(fd).st_size
    if geometry.end_bytes > size:
        raise InvalidArgumentError(
            f"cache needs {geometry.end_bytes} bytes but its memfd holds {size}"
        )
    mm = mmap.mmap(fd, size)
    return MappedCache(geometry, mm, np.frombuffer(mm, dtype=np.uint8))


@dataclass(frozen=True)
class ClientJob:
    """A job a client-copy worker is copying: what its completion needs."""

    token: int
    nbytes: int
    started_s: float
    check: ChecksumCheck | None
    corrupt: list[int]  # loads: areas that failed their checksum (nothing was copied)


@dataclass
class ClientCache:
    """A cache the client copies itself: the daemon only knows its geometry, and the
    copy runs it hands out are offsets from the cache's start."""

    geometry: CacheGeometry
    base_address: int = 0
    nbytes: int = 0

    def close(self) -> None:
        return


@dataclass
class AttachedWorker:
    """One engine rank's registration: its caches, in-flight jobs and finished results."""

    worker_id: int
    session_id: int
    ns_id: int
    rank: int
    caches: list[ImportedCache]
    placements: list[Placement]  # where each cache's page lives in a rank's area
    device: int | None = None  # CUDA ordinal for GPU caches
    store_event: int = 0  # imported interprocess event stores wait on (GPU)
    release: Callable[[], None] | None = None  # undoes the GPU imports
    active_jobs: set[int] = field(default_factory=set)
    finished: list[JobResult] = field(default_factory=list)
    closing: bool = False
    detach_rids: list[int] = field(default_factory=list)  # answered once drained
    client_copy: bool = False  # the client copies; jobs end with ClientCopyDone or Wrote
    push: bool = False  # one-way submits, results pushed (JobsDone)
    client_jobs: dict[int, ClientJob] = field(default_factory=dict)  # job id -> in flight
    parts: int = 1  # >1: one of an engine's ranks writing parts of canonical slots

    @property
    def area(self) -> int:
        """The rank area this worker copies to and from (the only one when canonical)."""
        return area_of(self.rank, self.parts)

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def close(self) -> None:
        for cache in self.caches:
            cache.close()
        self.caches = []
        if self.release is not None:
            self.release()
            self.release = None


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def attach_caches(descs: list[CacheDesc], fds: list[int]) -> list[ImportedCache]:
    """Map every cache of a worker or none; always closes every fd it was given."""
    try:
        mapped: list[ImportedCache] = []
        try:
            for desc in descs:
                if not 0 <= desc.fd_index < len(fds):
                    raise InvalidArgumentError(
                        f"cache refers to descriptor #{desc.fd_index}, "
                        f"but {len(fds)} came with the message"
                    )
                fd = fds[desc.fd_index]
                if desc.kind == MEMFD_IO:  # unsealable: copied by descriptor (fdcopy)
                    mapped.append(import_descriptor(check_desc(desc), desc, fd))
                else:
                    mapped.append(map_cache(desc, fd))
            if len({is_descriptor(c) for c in mapped}) > 1:
                raise InvalidArgumentError("a worker's caches must be all memfd or all memfd_io")
        except BaseException:
            for m in mapped:
                m.close()
            raise
        return mapped
    finally:
        close_fds(fds)

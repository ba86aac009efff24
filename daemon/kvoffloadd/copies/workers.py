"""The registration record of one worker (an engine rank) and the caches it imported.

Rules:
- CPU caches are imported by ``imports`` (one mapping per file, only the rows
  claimed), GPU caches by ``gpu`` (CUDA IPC handles); a client-copy worker's caches
  are geometry only.
- A worker's mappings live until it detaches or its client dies *and* its in-flight
  copies have drained; what it was charged (``charges``) is given back then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvoffload.datapath.canonical import area_of
from kvoffload.datapath.copyplan import select_caches
from kvoffload.datapath.runs import CacheGeometry, Placement
from kvoffload.protocol.messages import JobResult
from kvoffloadd.copies.copier import ChecksumCheck


class ImportedCache(Protocol):
    """An engine cache the daemon can address: CPU mapping or imported GPU memory."""

    @property
    def geometry(self) -> CacheGeometry: ...
    @property
    def base_address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def close(self) -> None: ...


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


@dataclass(frozen=True)
class Chosen:
    """The caches one transfer copies: their indices, the caches, their geometries
    and placements, and their base addresses (as ``JobPlan`` takes them)."""

    indices: list[int]
    caches: list[ImportedCache]
    geometries: list[CacheGeometry]
    placements: list[Placement]
    bases: npt.NDArray[np.int64]


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
    charges: dict[str, int] = field(default_factory=dict)  # ledger lines it holds
    _all: Chosen | None = field(default=None, repr=False)  # ``chosen([])``, once built

    @property
    def area(self) -> int:
        """The rank area this worker copies to and from (the only one when canonical)."""
        return area_of(self.rank, self.parts)

    def chosen(self, wanted: list[int]) -> Chosen:
        """The caches a transfer naming ``wanted`` copies (empty: all, worked out once
        per worker); InvalidArgumentError if an index is bad."""
        if not wanted and self._all is not None:
            return self._all
        indices = select_caches(len(self.caches), wanted)
        caches = [self.caches[i] for i in indices]
        chosen = Chosen(
            indices,
            caches,
            [c.geometry for c in caches],
            [self.placements[i] for i in indices],
            np.array([c.base_address for c in caches], dtype=np.int64),
        )
        if not wanted:
            self._all = chosen
        return chosen

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def close(self) -> None:
        for cache in self.caches:
            cache.close()
        self.caches = []
        self._all = None
        if self.release is not None:
            self.release()
            self.release = None

"""Caches the daemon copies without trusting their size: ``memfd_io``.

Some engines' host memory is a memfd that cannot be sealed (SGLang's ``shm``
host-pool allocator creates it without ``MFD_ALLOW_SEALING``). A plain copy through a
mapping of it is unsafe: the engine could shrink the memfd under a running memmove
and the daemon would die of SIGBUS. So only two things touch that memory:

- the guarded C copy (``_copyrun.copy_runs_guarded``), where it was built: a fault on
  the copying thread during the copy jumps back out of it and fails the part. It
  copies as the mapped caches' copies do, long runs streamed past the cache
  (`make bench-sglang`: 2 vCPUs, the kernel's copies reached 0.4-0.7 of memcpy);
- else the kernel, inside system calls, where a page that is gone makes the call
  fail with a short count or ``EFAULT`` (a fault in a kernel copy is fixed up, never
  a signal): a store reads the memfd (``preadv`` on its descriptor) into the region's
  slots; a load reads the region's file (``preadv`` on the daemon's own descriptor of
  the region) into the daemon's mapping of the memfd (reads take no inode lock;
  ``pwritev`` to the memfd serialises on its inode).

Either way a shrink fails that job, nothing else.

Rules:
- Only shared-memory files are taken (``F_GET_SEALS`` answers for memfd and tmpfs
  files only, and for nothing a read of which could block: no pipe, socket, FUSE or
  device file), opened read-write, regular, and at least as long as every row the
  descriptor claims (``imports``: one duplicate descriptor and one mapping of the
  claimed rows per file; the engine's descriptor is closed).
- The mapping of the memfd is read and written by the guarded copy or as a
  system-call buffer only: no Python, numpy or memmove access ever touches it
  (checksums cover region bytes only).
- The loop thread validates the job exactly as for mapped caches and hands over its
  ``JobPlan`` (``submit_planned``), split into ranges of whole slots, one per thread;
  each thread builds its range's runs, whose cache addresses are offsets into the
  memfd (``base_address`` 0), and reads them.
- Loads keep to the job's ``deadline_ns``: no copy call starts after it (checked
  before each one, runs cut to ``CHUNK_BYTES``), so an engine that gave up on a load at its
  deadline does not get bytes in pages it has reused.
- Completions go into the CPU copier's ``CompletionSink``: the loop handles them as
  any other copy's. No daemon metadata is touched here.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvoffload.datapath import memruns
from kvoffload.datapath.copyplan import JobPlan
from kvoffloadd.copies.copier import (
    ChecksumCheck,
    CompletionSink,
    CopyJob,
    CopyThreads,
    chunk_runs,
)
from kvoffloadd.copies.imports import DescriptorCache

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]
IOV_MAX = 1024


def is_descriptor(cache: object) -> bool:
    return isinstance(cache, DescriptorCache)


@dataclass(frozen=True)
class _PlanPart:
    """Slots ``first .. end`` of a validated job, for one copier thread."""

    job: CopyJob
    plan: JobPlan
    caches: list[DescriptorCache]
    first: int
    end: int
    deadline_ns: int


@dataclass(frozen=True)
class _Part:
    """Runs of one job: read ``nbytes`` from ``fds`` at ``offsets`` into ``buffers``
    (``fds`` None: copy from the addresses ``offsets``, guarded)."""

    fds: I64 | None
    offsets: I64
    buffers: I64
    nbytes: I64
    deadline_ns: int
    runs: int = 0  # the runs they were cut from


class FdCopier(CopyThreads):
    """Threads that copy between the region and descriptor caches."""

    CHUNK_BYTES = 1024 * 1024

    def __init__(self, threads: int, sink: CompletionSink, region_fd: int, region_address: int):
        self.sink = sink
        self.region_fd = region_fd  # the daemon's own descriptor of the region (loads)
        self.region_address = region_address
        self.guarded = memruns.NATIVE  # copies by the guarded C loop, else by syscalls
        super().__init__(threads, "kvoffload-fdcopy")

    def submit_planned(
        self,
        token: int,
        plan: JobPlan,
        caches: list[DescriptorCache],
        deadline_ns: int,
        check: ChecksumCheck | None,
    ) -> None:
        """Copy a validated job: its slots in one range per thread (one range for a
        small job, or a verified load, which checks everything before it copies)."""
        job, ranges = self._slot_ranges(token, plan, check)
        for first, end in ranges:
            self._queue.put(_PlanPart(job, plan, caches, first, end, deadline_ns))

    def _reads(self, item: _PlanPart) -> _Part:
        """The reads of one range: from the memfd into the region's memory (stores), or
        from the region's file into the daemon's mapping of the memfd (loads)."""
        runs = item.plan.runs(item.first, item.end)
        offsets, nbytes = runs.cache, runs.nbytes
        if self.guarded:  # addresses in the mappings on both sides
            maps = np.array([c.map_address for c in item.caches], dtype=np.int64)
            region, mine = runs.region + item.plan.region_base, offsets + maps[runs.which]
            src, dst = (mine, region) if item.plan.is_store else (region, mine)
            dst, src, nbytes = chunk_runs(dst, src, nbytes, self.CHUNK_BYTES)
            return _Part(None, src, dst, nbytes, item.deadline_ns, int(runs.nbytes.size))
        if item.plan.is_store:
            fds = np.array([c.fd for c in item.caches], dtype=np.int64)[runs.which]
            src, dst = offsets, runs.region + item.plan.region_base
        else:
            maps = np.array([c.map_address for c in item.caches], dtype=np.int64)
            fds = np.full(nbytes.size, self.region_fd, dtype=np.int64)
            src, dst = (
                runs.region + (item.plan.region_base - self.region_address),
                offsets + maps[runs.which],
            )
        src, dst, nbytes, fds = _chunk(src, dst, nbytes, fds, self.CHUNK_BYTES)
        return _Part(fds, src, dst, nbytes, item.deadline_ns, int(runs.nbytes.size))

    def _handle(self, item: _PlanPart) -> None:
        def copy() -> bool:
            part = self._reads(item)
            ok = copy_part(part)
            if ok:
                item.job.count(int(part.nbytes.sum()), part.runs)
            return ok

        if (done := item.job.run_part(copy)) is not None:
            self.sink.post(done)


def _chunk(src: I64, dst: I64, nbytes: I64, fds: I64, chunk: int) -> tuple[I64, ...]:
    """``chunk_runs`` that carries each run's descriptor along."""
    d, sr, n = chunk_runs(dst, src, nbytes, chunk)
    if n.size == nbytes.size:
        return src, dst, nbytes, fds
    return sr, d, n, np.repeat(fds, -(-nbytes // chunk))


def copy_part(part: _Part) -> bool:
    """Run one part's copies; False on a short count, a fault or a passed deadline."""
    fds, offsets, buffers, nbytes = part.fds, part.offsets, part.buffers, part.nbytes
    if fds is None:
        return _copy_guarded(part)
    # Runs that continue each other in the same file go in one syscall.
    cont = (fds[1:] == fds[:-1]) & (offsets[1:] == offsets[:-1] + nbytes[:-1])
    starts = [0, *(np.flatnonzero(~cont) + 1).tolist(), int(nbytes.size)]
    for a, b in itertools.pairwise(starts):
        for s in range(a, b, IOV_MAX):
            e = min(b, s + IOV_MAX)
            if part.deadline_ns and time.monotonic_ns() > part.deadline_ns:
                return False
            bufs = [
                (ctypes.c_char * n).from_address(addr)
                for addr, n in zip(buffers[s:e].tolist(), nbytes[s:e].tolist())
            ]
            if os.preadv(int(fds[s]), bufs, int(offsets[s])) != int(nbytes[s:e].sum()):
                return False
    return True


GUARDED_CALL_BYTES = 8 * 1024 * 1024  # a load's deadline is checked at least this often
_WARN_EVERY_S = 60.0
_warned_s = -_WARN_EVERY_S


def _copy_guarded(part: _Part) -> bool:
    """The part's runs by the guarded C copy, at most ``IOV_MAX`` runs and about
    ``GUARDED_CALL_BYTES`` per call (runs are at most ``CHUNK_BYTES``)."""
    global _warned_s
    copy, n = memruns.copy_runs_guarded, int(part.nbytes.size)
    ends = np.cumsum(part.nbytes)
    s = 0
    while s < n:
        if part.deadline_ns and time.monotonic_ns() > part.deadline_ns:
            return False
        start_bytes = int(ends[s - 1]) if s else 0
        e = int(np.searchsorted(ends, start_bytes + GUARDED_CALL_BYTES, side="right"))
        e = min(max(e, s + 1), s + IOV_MAX, n)
        if not copy(part.buffers[s:e], part.offsets[s:e], part.nbytes[s:e]):
            now = time.monotonic()
            if now - _warned_s >= _WARN_EVERY_S:  # an engine that shrinks its pool once
                _warned_s = now  # fails every job after: one line a minute, not each
                log.warning("a descriptor cache's memory vanished under a copy: its job fails")
            return False
        s = e
    return True

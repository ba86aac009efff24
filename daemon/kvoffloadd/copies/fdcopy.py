"""Caches the daemon copies through by descriptor and syscall: ``memfd_io``.

Some engines' host memory is a memfd that cannot be sealed (SGLang's ``shm``
host-pool allocator creates it without ``MFD_ALLOW_SEALING``). A mapping of it that
the daemon touches is unsafe: the engine could shrink the memfd under a running
memmove and the daemon would die of SIGBUS. So the daemon's own code never touches
that memory; only the kernel copies into and out of it, inside system calls, where a
page that is gone makes the call fail with a short count or ``EFAULT`` (a fault in
a kernel copy is fixed up, never a signal):

- a store reads the memfd (``preadv`` on its descriptor) into the region's slots;
- a load reads the region's file (``preadv`` on the daemon's own descriptor of the
  region) into the daemon's mapping of the memfd. Reads take no inode lock, so two
  threads copy twice as fast; writing the memfd with ``pwritev`` serialises on its
  inode (3.6 GB/s with one or two threads here, against 8.5 for this).

Either way a shrink fails that job, nothing else.

Rules:
- Only shared-memory files are taken (``F_GET_SEALS`` answers for memfd and tmpfs
  files only, and for nothing a read of which could block: no pipe, socket, FUSE or
  device file), opened read-write, regular, and at least as long as every row the
  descriptor claims (``imports``: one duplicate descriptor and one mapping of the
  claimed rows per file; the engine's descriptor is closed).
- The mapping of the memfd is used as a system-call buffer only: no Python, numpy or
  memmove access ever reads or writes it (checksums cover region bytes only).
- The loop thread validates the job exactly as for mapped caches and hands over its
  ``JobPlan``; a copier thread builds the runs (``submit_planned``), whose cache
  addresses are offsets into the memfd (``base_address`` 0).
- Loads keep to the job's ``deadline_ns``: no syscall starts after it (checked before
  each one, runs cut to ``CHUNK_BYTES``), so an engine that gave up on a load at its
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

from kvoffload.datapath.copyplan import JobPlan
from kvoffloadd.copies.copier import (
    ChecksumCheck,
    CompletionSink,
    CopyJob,
    CopyThreads,
    chunk_runs,
    finished,
    split_by_bytes,
)
from kvoffloadd.copies.imports import DescriptorCache

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]
IOV_MAX = 1024


def is_descriptor(cache: object) -> bool:
    return isinstance(cache, DescriptorCache)


@dataclass(frozen=True)
class _Planned:
    """A validated job whose runs a copier thread builds, then splits into parts."""

    token: int
    plan: JobPlan
    caches: list[DescriptorCache]
    deadline_ns: int
    check: ChecksumCheck | None


@dataclass(frozen=True)
class _Part:
    """Runs of one job: read ``nbytes`` from ``fds`` at ``offsets`` into ``buffers``."""

    job: CopyJob
    fds: I64
    offsets: I64
    buffers: I64
    nbytes: I64
    deadline_ns: int


class FdCopier(CopyThreads):
    """Threads that copy between the region and descriptor caches."""

    CHUNK_BYTES = 1024 * 1024
    MIN_SPLIT_BYTES = 4 * 1024 * 1024

    def __init__(self, threads: int, sink: CompletionSink, region_fd: int, region_address: int):
        self.sink = sink
        self.region_fd = region_fd  # the daemon's own descriptor of the region (loads)
        self.region_address = region_address
        super().__init__(threads, "kvoffload-fdcopy")

    def submit(
        self,
        token: int,
        caches: list[DescriptorCache],
        which: I64,
        region: I64,
        offsets: I64,
        nbytes: I64,
        is_store: bool,
        deadline_ns: int,
        check: ChecksumCheck | None,
    ) -> None:
        """Copy runs between region addresses and offsets into the caches' memfds."""
        if is_store:  # the memfd's file into the region's memory
            fds = np.array([c.fd for c in caches], dtype=np.int64)[which]
            src, dst = offsets, region
        else:  # the region's file into the daemon's mapping of the memfd
            maps = np.array([c.map_address for c in caches], dtype=np.int64)
            fds = np.full(nbytes.size, self.region_fd, dtype=np.int64)
            src, dst = region - self.region_address, offsets + maps[which]
        src, dst, nbytes, fds = _chunk(src, dst, nbytes, fds, self.CHUNK_BYTES)
        total = int(nbytes.sum())
        parts = len(self._threads) if total >= self.MIN_SPLIT_BYTES else 1
        if check is not None and check.expected is not None:
            parts = 1  # a verified load checks everything before it copies anything
        ranges = split_by_bytes(nbytes, parts)
        job = CopyJob(token, total, len(ranges), time.perf_counter(), check)
        for a, b in ranges:
            part = _Part(job, fds[a:b], src[a:b], dst[a:b], nbytes[a:b], deadline_ns)
            self._queue.put(part)

    def submit_planned(
        self,
        token: int,
        plan: JobPlan,
        caches: list[DescriptorCache],
        deadline_ns: int,
        check: ChecksumCheck | None,
    ) -> None:
        """Copy a validated job whose runs a copier thread builds (off the loop)."""
        self._queue.put(_Planned(token, plan, caches, deadline_ns, check))

    def _plan(self, item: _Planned) -> None:
        try:
            runs = item.plan.runs()
        except Exception:  # pragma: no cover - planning of validated inputs
            log.exception("descriptor copy of job %d could not be planned", item.token)
            self.sink.post(finished(item.token, False, 0, time.perf_counter(), None, []))
            return
        region = runs.region + item.plan.region_base
        self.submit(
            item.token,
            item.caches,
            runs.which,
            region,
            runs.cache,
            runs.nbytes,
            item.plan.is_store,
            item.deadline_ns,
            item.check,
        )

    def _handle(self, item: _Part | _Planned) -> None:
        if isinstance(item, _Planned):
            self._plan(item)
        elif (done := item.job.run_part(lambda: copy_part(item))) is not None:
            self.sink.post(done)


def _chunk(src: I64, dst: I64, nbytes: I64, fds: I64, chunk: int) -> tuple[I64, ...]:
    """``chunk_runs`` that carries each run's descriptor along."""
    d, sr, n = chunk_runs(dst, src, nbytes, chunk)
    if n.size == nbytes.size:
        return src, dst, nbytes, fds
    return sr, d, n, np.repeat(fds, -(-nbytes // chunk))


def copy_part(part: _Part) -> bool:
    """Run one part's reads; False on a short count, a fault or a passed deadline."""
    fds, offsets, buffers, nbytes = part.fds, part.offsets, part.buffers, part.nbytes
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

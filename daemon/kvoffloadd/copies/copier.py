"""CPU copier: threads that execute copy runs and report completions to the loop.

Rules:
- The loop hands over a validated transfer as its ``JobPlan`` (``submit_planned``)
  and spends nothing per copy on it: copier threads build its copies as strided groups
  (``JobPlan.groups``: one per cache for evenly stepping slots and blocks), a piece of
  whole slots at a time (``PIECE_COPIES``), and copy each group with one numpy call
  that releases the GIL. They never touch daemon metadata.
- A transfer of at most ``INLINE_BYTES`` (without checksums) is copied at once on the
  loop thread: two thread wake-ups would cost more than the copy. Its completion still
  goes through the sink, like every other.
- A larger one is split into ranges of whole slots, one per thread, unless a job per
  thread is queued already: the threads are busy with whole jobs then, and each part
  would pay the per-cache cost of building and starting its copies again. A split job
  completes when every part has. Jobs given as address arrays (``submit``) are split
  by bytes, runs longer than ``CHUNK_BYTES`` cut first, so one huge run still spreads.
- Completions go into a ``CompletionSink`` (a deque and an eventfd) shared with the GPU
  copy lanes; one eventfd write wakes the loop, which calls ``drain()``: completions
  are processed on the loop thread only.
- Memory behind the addresses must stay mapped until the job's completion has been
  drained; the daemon guarantees it by counting in-flight jobs per mapping.
- ``run_task`` runs other work that must stay off the loop (checking what a canonical
  store covered) on the same threads; its result comes back in the completion.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.datapath.copyplan import JobPlan
from kvoffload.datapath.memruns import copy_groups, copy_runs
from kvoffloadd.copies.crc import crc32

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Completion:
    token: int
    success: bool
    nbytes: int
    seconds: float
    checksums: list[int] | None = None  # stores with verification: one per area
    corrupt: list[int] = field(default_factory=list)  # loads: areas that failed
    result: Any = None  # what a task (``run_task``) returned
    runs: int = 0  # runs a copier built (``submit_planned``)


@dataclass(frozen=True)
class _Task:
    token: int
    fn: Callable[[], Any]


@dataclass(frozen=True)
class _PlanPart:
    """Slots ``first .. end`` of a planned job, for one copier thread."""

    job: CopyJob
    plan: JobPlan
    first: int
    end: int


@dataclass(frozen=True)
class ChecksumCheck:
    """Block checksums for one job: CRC32 of each slot's rank area of the region.

    Stores compute them after their copy; loads verify them before theirs and copy
    nothing when one differs (``expected`` -1: not known, not checked).
    """

    areas: list[int]  # absolute addresses
    area_bytes: int
    expected: list[int] | None = None

    def compute(self) -> list[int]:
        n = self.area_bytes
        return [crc32((ctypes.c_char * n).from_address(a)) for a in self.areas]

    def mismatches(self) -> list[int]:
        assert self.expected is not None
        return [
            i
            for i, (want, got) in enumerate(zip(self.expected, self.compute()))
            if want >= 0 and want != got
        ]


@dataclass
class CopyJob:
    """A job split into parts that copier threads run (CPU and descriptor copiers)."""

    token: int
    nbytes: int
    parts_left: int
    started_s: float
    check: ChecksumCheck | None = None
    failed: bool = False
    corrupt: list[int] = field(default_factory=list)
    runs: int = 0  # runs its parts built (planned jobs)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, nbytes: int, runs: int) -> None:
        """A part of a planned job copied ``nbytes`` in ``runs`` runs."""
        with self.lock:
            self.nbytes += nbytes
            self.runs += runs

    def run_part(self, copy: Callable[[], bool]) -> Completion | None:
        """Run one part (a verified load checks its blocks first, and copies nothing
        if one differs); the job's completion once its last part ran."""
        ok = True
        try:
            if self.check is not None and self.check.expected is not None:
                self.corrupt = self.check.mismatches()
            if not self.corrupt:
                ok = copy()
        except OSError as exc:  # a descriptor copy whose engine shrank its memory
            log.info("copy job %d failed: %s", self.token, exc)
            ok = False
        except Exception:  # pragma: no cover - memmove of validated ranges
            log.exception("copy job %d failed", self.token)
            ok = False
        with self.lock:
            self.failed |= not ok
            self.parts_left -= 1
            if self.parts_left:
                return None
        done = finished(
            self.token, not self.failed, self.nbytes, self.started_s, self.check, self.corrupt
        )
        return replace(done, runs=self.runs) if self.runs else done


class CopyThreads:
    """Threads that take items off one queue (``_handle``) until ``close``."""

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._handle(item)

    def _handle(self, item: Any) -> None:
        raise NotImplementedError

    MIN_SPLIT_BYTES = 4 * 1024 * 1024  # a transfer this large is split across threads

    def _slot_ranges(
        self, token: int, plan: JobPlan, check: ChecksumCheck | None
    ) -> tuple[CopyJob, list[tuple[int, int]]]:
        """A planned transfer's job, and its slots in one range of whole slots per
        thread (one range for a small transfer, or a verified load, which checks
        everything before it copies anything)."""
        slots = int(plan.slot_offsets.size)
        threads = len(self._threads)
        split = plan.most_bytes >= self.MIN_SPLIT_BYTES and self._queue.qsize() < threads
        parts = min(threads, slots) if split else 1
        if check is not None and check.expected is not None:
            parts = 1
        parts = max(parts, 1)
        job = CopyJob(token, 0, parts, time.perf_counter(), check)
        return job, [(i * slots // parts, (i + 1) * slots // parts) for i in range(parts)]

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()


def finished(
    token: int,
    ok: bool,
    nbytes: int,
    started_s: float,
    check: ChecksumCheck | None,
    corrupt: list[int],
) -> Completion:
    """A job's completion, for CPU and GPU copiers alike: a verified store's checksums
    are taken now that its bytes are in the region; a load that failed verification
    copied nothing and fails."""
    sums = check.compute() if ok and check is not None and check.expected is None else None
    ok = ok and not corrupt
    seconds = time.perf_counter() - started_s
    return Completion(token, ok, nbytes if ok else 0, seconds, sums, corrupt)


def chunk_runs(dst: I64, src: I64, nbytes: I64, chunk: int) -> tuple[I64, I64, I64]:
    """Cut every run longer than ``chunk`` bytes into pieces of at most ``chunk``."""
    if nbytes.size == 0 or int(nbytes.max()) <= chunk:
        return dst, src, nbytes
    pieces = -(-nbytes // chunk)
    idx = np.repeat(np.arange(nbytes.size), pieces)
    first = np.cumsum(pieces) - pieces
    k = np.arange(idx.size) - np.repeat(first, pieces)
    off = k * chunk
    n = np.minimum(nbytes[idx] - off, chunk)
    return dst[idx] + off, src[idx] + off, n


def split_by_bytes(nbytes: I64, parts: int) -> list[tuple[int, int]]:
    """Index ranges cutting the runs into at most ``parts`` chunks of similar bytes."""
    if nbytes.size == 0:
        return [(0, 0)]
    parts = max(1, min(parts, nbytes.size))
    if parts == 1:
        return [(0, int(nbytes.size))]
    cum = np.cumsum(nbytes)
    bounds = np.searchsorted(cum, cum[-1] * np.arange(1, parts) / parts, side="right")
    edges = [0, *sorted({int(b) for b in bounds if 0 < b < nbytes.size}), nbytes.size]
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a]


class CompletionSink:
    """Finished copies from any thread, handed to the loop thread."""

    def __init__(self) -> None:
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._done: deque[Completion] = deque()

    def post(self, completion: Completion) -> None:
        self._done.append(completion)
        os.eventfd_write(self.wake_fd, 1)

    def drain(self) -> list[Completion]:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.wake_fd)
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def close(self) -> None:
        os.close(self.wake_fd)


class CpuCopier(CopyThreads):
    CHUNK_BYTES = 4 * 1024 * 1024
    INLINE_BYTES = 64 * 1024  # smaller jobs are copied at once, on the caller's thread

    def __init__(self, threads: int) -> None:
        self.sink = CompletionSink()
        self.wake_fd = self.sink.wake_fd
        super().__init__(threads, "kvoffload-copy")

    def submit(
        self, token: int, dst: I64, src: I64, nbytes: I64, check: ChecksumCheck | None = None
    ) -> None:
        total = int(nbytes.sum())
        if total <= self.INLINE_BYTES and check is None:
            # Handing a few KiB to a thread costs more than copying them (two thread
            # wake-ups per job); the completion still goes through the sink.
            t0 = time.perf_counter()
            copy_runs(dst, src, nbytes)
            self.sink.post(finished(token, True, total, t0, None, []))
            return
        parts = len(self._threads) if total >= self.MIN_SPLIT_BYTES else 1
        if check is not None and check.expected is not None:
            parts = 1  # a verified load checks everything before it copies anything
        if parts > 1:
            dst, src, nbytes = chunk_runs(dst, src, nbytes, self.CHUNK_BYTES)
        ranges = split_by_bytes(nbytes, parts)
        job = CopyJob(token, total, len(ranges), time.perf_counter(), check)
        for a, b in ranges:
            self._queue.put((job, dst[a:b], src[a:b], nbytes[a:b]))

    PIECE_COPIES = 1 << 16  # copies one piece of a planned job builds at most

    def submit_planned(self, token: int, plan: JobPlan, check: ChecksumCheck | None) -> None:
        """Copy a validated transfer whose copies the copier builds (off the loop)."""
        if plan.most_bytes <= self.INLINE_BYTES and check is None:
            t0 = time.perf_counter()
            groups = plan.groups()
            copy_groups(groups)
            done = finished(token, True, groups.total_bytes, t0, None, [])
            self.sink.post(replace(done, runs=groups.runs))
            return
        job, ranges = self._slot_ranges(token, plan, check)
        for first, end in ranges:
            self._queue.put(_PlanPart(job, plan, first, end))

    def _plan_part(self, part: _PlanPart) -> None:
        plan = part.plan

        def copy() -> bool:
            for first, end in plan.piece_bounds(part.first, part.end, self.PIECE_COPIES):
                groups = plan.groups(first, end)
                copy_groups(groups)
                part.job.count(groups.total_bytes, groups.runs)
            return True

        if (done := part.job.run_part(copy)) is not None:
            self.sink.post(done)

    def run_task(self, token: int, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on a copier thread; its completion carries what it returned (a
        task that raises fails)."""
        self._queue.put(_Task(token, fn))

    def _task(self, task: _Task) -> None:
        t0 = time.perf_counter()
        try:
            result, ok = task.fn(), True
        except Exception:
            log.exception("copier task %d failed", task.token)
            result, ok = None, False
        self.sink.post(Completion(task.token, ok, 0, time.perf_counter() - t0, result=result))

    def _handle(self, item: Any) -> None:
        if isinstance(item, _Task):
            self._task(item)
        elif isinstance(item, _PlanPart):
            self._plan_part(item)
        else:
            job, dst, src, sizes = item

            def copy() -> bool:
                copy_runs(dst, src, sizes)
                return True

            if (done := job.run_part(copy)) is not None:
                self.sink.post(done)

    def drain(self) -> list[Completion]:
        return self.sink.drain()

    def close(self) -> None:
        super().close()
        self.sink.close()

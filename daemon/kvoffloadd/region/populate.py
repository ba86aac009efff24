"""Populating the region: every page faulted in (allocated and zeroed) before a copy
needs it, by threads bound to the node that is to hold it, in chunk order.

Rules:
- One coordinating thread and ``plan.threads`` workers per part; a worker is bound to
  its part's CPUs (``sched_setaffinity``: no privilege needed) and, where the plan says
  so and the kernel lets it, each piece gets its part's memory policy first
  (``mbind(MPOL_PREFERRED)``: never an OOM kill for a full node, and for shared memory
  the policy stays with the object). Without CAP_SYS_NICE under a container's seccomp
  filter, mbind fails with EPERM and the bound threads' first touch places the pages.
- Workers take pieces of at most ``PIECE_BYTES`` of their part's chunks in region
  order, so chunk 0 is done first by all of them together; a chunk is populated
  (``ChunkStates.mark_populated``) when its last piece is. A worker out of work helps
  other parts only where memory policies place the pages anyway.
- Each piece is one ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14), through kernel.py,
  so the GIL is free while the kernel works; older kernels get a write-touch of every
  page (numpy, which releases the GIL too).
- A kept region (warm restart) is populated already: the coordinator first marks every
  chunk whose pages are all resident (``mincore``) as populated (ready for copies at
  once), then the same pass only maps them (no allocation, no zeroing); pinning waits
  for that mapping, which runs on every thread, not on its own one.
- Progress (bytes, rates, per part) is logged every ``PROGRESS_LOG_S`` and once at the
  end; after the end, a sample of each chunk's pages is asked where it lies
  (``move_pages``), which the stats report as the share on the intended node.
- A failure (ENOMEM, EFAULT) stops population with one warning line; the region still
  serves, faulting pages on first use.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvoffloadd.region import kernel
from kvoffloadd.region.hostfs import huge_mapped_bytes
from kvoffloadd.region.placement import ChunkStates, RegionPlan

log = logging.getLogger(__name__)

PIECE_BYTES = 64 << 20
PROGRESS_LOG_S = 5.0
SAMPLES_PER_CHUNK = 16
GIB = 1 << 30

Touch = Callable[[int, int], None]  # (address, bytes): fault the range in


def populate_write(address: int, nbytes: int) -> None:
    kernel.madvise(address, nbytes, kernel.MADV_POPULATE_WRITE)


def touch_pages(address: int, nbytes: int, page_bytes: int = 4096) -> None:
    """Write-touch every page, keeping its contents (kernels before 5.14)."""
    raw = memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")
    view = np.frombuffer(raw, dtype=np.uint8)
    pages = view[::page_bytes]
    pages += 0  # read-modify-write: whatever is there stays


class _Part:
    """One part's work queue and progress (its workers share it, under the lock)."""

    def __init__(self, pieces: list[tuple[int, int, int]], nbytes: int) -> None:
        self.pieces = pieces  # (chunk, offset in the data area, bytes), region order
        self.next = 0
        self.bytes = nbytes
        self.populated_bytes = 0
        self.first_s = 0.0
        self.last_s = 0.0
        self.local_ratio: float | None = None
        self.threads = 0


class Populator:
    def __init__(
        self,
        base_address: int,
        plan: RegionPlan,
        states: ChunkStates,
        *,
        page_bytes: int = 4096,
        recovered: bool = False,
        huge_advise: bool = False,
        touch: Touch = populate_write,
        tail: tuple[int, int] | None = None,
        resident: Callable[[int, int], int] = kernel.resident_bytes,
        unit_bytes: int = 0,
        piece_bytes: int = PIECE_BYTES,
    ) -> None:
        """``base_address``: where the data area is mapped; ``tail``: (address, bytes)
        of more to populate after the data (the slot tables); ``resident(address,
        bytes)``: how much of a range a kept region holds already; ``unit_bytes``:
        the readiness unit (an extent; 0: a chunk), marked as its pieces are done."""
        self.base = base_address
        self.plan = plan
        self.states = states
        self.page_bytes = page_bytes
        self.recovered = recovered
        self.huge_advise = huge_advise
        self.touch = touch
        self.tail = tail
        self.resident = resident
        self.error = ""
        self.placement = "none"  # "mbind", "threads" (affinity), "none"
        self.started_s = 0.0
        self.finished_s = 0.0
        self.first_chunk_s = 0.0
        self.resident_at_start_bytes = 0
        self.huge_page_bytes = 0  # of the data area, mapped by huge pages (at the end)
        self.done = False  # all of it populated, checked and reported
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._remaining = [0] * len(plan.chunks)
        self._mbind_ok = plan.mbind
        self._parts: list[_Part] = []
        piece = max(page_bytes, piece_bytes // page_bytes * page_bytes)
        unit = unit_bytes or plan.chunk_bytes
        self._unit_left = [0] * len(states.units)
        for p in range(len(plan.parts)):
            pieces = []
            for c, (off, n) in enumerate(plan.chunks):
                if plan.part_of_chunk[c] != p:
                    continue
                for o in range(off, off + n, piece):
                    k = min(piece, off + n - o)
                    pieces.append((c, o, k))
                    self._remaining[c] += 1
                    for u in range(o // unit, -(-(o + k) // unit)):
                        self._unit_left[u] += 1
            self._parts.append(_Part(pieces, sum(n for _, _, n in pieces)))
        self._unit = unit
        self._thread = threading.Thread(target=self._run, name="kvoffload-populate", daemon=True)

    # ------------------------------------------------------------ control

    def start(self) -> None:
        if self._thread.ident is not None:
            return
        self.started_s = time.monotonic()
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self) -> None:
        if self._thread.ident is not None:
            self._thread.join()

    def stop(self) -> None:
        self._stop.set()
        self.wait()

    @property
    def elapsed_s(self) -> float:
        """Seconds populating took, or has taken so far."""
        if not self.started_s:
            return 0.0
        return (self.finished_s or time.monotonic()) - self.started_s

    @property
    def populated_bytes(self) -> int:
        return sum(p.populated_bytes for p in self._parts)

    # ------------------------------------------------------------ threads

    def _run(self) -> None:
        try:
            if self.recovered:
                self._mark_resident()
            if self.huge_advise:
                self._advise_huge()
            workers = self._start_workers()
            logged_s = time.monotonic()
            while alive := [w for w in workers if w.is_alive()]:
                alive[0].join(max(0.0, logged_s + PROGRESS_LOG_S - time.monotonic()))
                if time.monotonic() >= logged_s + PROGRESS_LOG_S:
                    self._log_progress()
                    logged_s = time.monotonic()
            self.finished_s = time.monotonic()
            if self.tail is not None and not self._stop.is_set() and not self.error:
                self._touch_safely(*self.tail)
            if not self._stop.is_set():
                self._sample_placement()
                if self.huge_advise or self.page_bytes > mmap.PAGESIZE:
                    # smaps walks the whole mapping's page tables: only where it tells
                    self.huge_page_bytes = huge_mapped_bytes(self.base)
                self._log_done()
                self.done = not self.error
        finally:
            self.states.release_waiters()

    def _mark_resident(self) -> None:
        for c, (off, n) in enumerate(self.plan.chunks):
            try:
                resident = self.resident(self.base + off, n)
            except OSError:
                return
            if resident >= n:
                self.resident_at_start_bytes += n
                self.states.mark_resident(c)
                self._first_chunk(c)

    def _advise_huge(self) -> None:
        total = sum(n for _, n in self.plan.chunks)
        try:
            kernel.madvise(self.base, total, kernel.MADV_HUGEPAGE)
        except OSError as exc:
            log.warning("transparent huge pages not applied to the region: %s", exc)

    def _start_workers(self) -> list[threading.Thread]:
        workers = []
        for p, part in enumerate(self.plan.parts):
            for i in range(self.plan.threads[p]):
                t = threading.Thread(
                    target=self._work,
                    args=(p, part.cpus),
                    name=f"kvoffload-populate-{p}.{i}",
                    daemon=True,
                )
                self._parts[p].threads += 1
                workers.append(t)
        if self._mbind_ok:
            self.placement = "mbind"
        elif any(p.cpus for p in self.plan.parts):
            self.placement = "threads"
        for t in workers:
            t.start()
        return workers

    def _work(self, part: int, cpus: frozenset[int]) -> None:
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)  # this thread only
            except OSError as exc:
                log.warning("cannot bind a populate thread to CPUs %s: %s", sorted(cpus), exc)
        order = [part, *(p for p in range(len(self._parts)) if p != part)]
        while not self._stop.is_set():
            job = None
            with self._lock:
                for p in order if self._mbind_ok else order[:1]:
                    q = self._parts[p]
                    if q.next < len(q.pieces):
                        job = (p, q.pieces[q.next])
                        q.next += 1
                        break
            if job is None:
                return
            p, (chunk, off, n) = job
            if self._mbind_ok:
                self._place(p, off, n)
            if not self._touch_safely(self.base + off, n):
                return
            self._piece_done(p, chunk, off, n)

    def _place(self, part: int, off: int, n: int) -> None:
        node = self.plan.parts[part].node
        if node is None:
            return
        try:
            kernel.mbind(self.base + off, n, kernel.MPOL_PREFERRED, [node])
        except OSError as exc:
            with self._lock:
                if self._mbind_ok:
                    self._mbind_ok = False
                    self.placement = "threads"
                    log.info(
                        "placing the region by thread affinity only (%s; mbind needs "
                        "CAP_SYS_NICE under container seccomp filters)",
                        exc.strerror,
                    )

    def _touch_safely(self, address: int, n: int) -> bool:
        try:
            self.touch(address, n)
        except OSError as exc:
            if exc.errno == errno.EINVAL and self.touch is populate_write:
                self.touch = lambda a, k: touch_pages(a, k, self.page_bytes)
                return self._touch_safely(address, n)
            with self._lock:
                if not self.error:
                    self.error = str(exc)
                    log.warning(
                        "populating the region stopped after %.1f GiB: %s; the rest is "
                        "faulted in as copies reach it",
                        self.populated_bytes / GIB,
                        exc,
                    )
            self._stop.set()
            return False
        return True

    def _piece_done(self, part: int, chunk: int, off: int, n: int) -> None:
        now = time.monotonic()
        units = range(off // self._unit, -(-(off + n) // self._unit))
        with self._lock:
            q = self._parts[part]
            q.populated_bytes += n
            q.first_s = q.first_s or now
            q.last_s = now
            self._remaining[chunk] -= 1
            done = self._remaining[chunk] == 0
            for u in units:
                self._unit_left[u] -= 1
                if self._unit_left[u] == 0:
                    self.states.mark_unit(u)
        if done:
            self._set_populated(chunk)

    def _set_populated(self, chunk: int) -> None:
        self._first_chunk(chunk)
        self.states.mark_populated(chunk)

    def _first_chunk(self, chunk: int) -> None:
        if not self.first_chunk_s and chunk == 0:
            self.first_chunk_s = time.monotonic() - (self.started_s or time.monotonic())

    # ------------------------------------------------------------ reports

    def _sample_placement(self) -> None:
        """The share of sampled pages on each part's intended node (move_pages)."""
        for p, part in enumerate(self.plan.parts):
            if part.node is None:
                continue
            addrs: list[int] = []
            for c, (off, n) in enumerate(self.plan.chunks):
                if self.plan.part_of_chunk[c] != p:
                    continue
                step = max(
                    self.page_bytes, n // SAMPLES_PER_CHUNK // self.page_bytes * self.page_bytes
                )
                addrs.extend(self.base + o for o in range(off, off + n, step))
            if not addrs:
                continue
            try:
                nodes = kernel.nodes_of_pages(addrs)
            except OSError:
                return
            placed = [x for x in nodes if x >= 0]
            if placed:
                self._parts[p].local_ratio = sum(x == part.node for x in placed) / len(placed)

    def rate_bytes_per_s(self, part: int | None = None) -> float:
        parts = self._parts if part is None else [self._parts[part]]
        done = sum(q.populated_bytes for q in parts)
        elapsed = self.elapsed_s
        return done / elapsed if elapsed > 0 else 0.0

    def part_statistics(self) -> list[dict[str, Any]]:
        out = []
        for p, q in enumerate(self._parts):
            out.append(
                {
                    "bytes": q.bytes,
                    "populated_bytes": q.populated_bytes,
                    "populate_threads": q.threads,
                    "populate_rate_bytes_per_s": round(self.rate_bytes_per_s(p)),
                    "local_ratio": q.local_ratio,
                }
            )
        return out

    def _describe_parts(self) -> str:
        rows = []
        for p, (part, q) in enumerate(zip(self.plan.parts, self._parts)):
            where = "all nodes" if part.node is None else f"node {part.node}"
            rows.append(
                f"{where}: {q.populated_bytes / GIB:.1f}/{q.bytes / GIB:.1f} GiB at "
                f"{self.rate_bytes_per_s(p) / GIB:.2f} GiB/s, {q.threads} threads"
            )
        return "; ".join(rows)

    def _log_progress(self) -> None:
        total = sum(q.bytes for q in self._parts)
        log.info(
            "populating the region: %.1f of %.1f GiB, %.1f GiB ready (%s)",
            self.populated_bytes / GIB,
            total / GIB,
            self.states.ready_units() * self._unit / GIB,
            self._describe_parts(),
        )

    def _log_done(self) -> None:
        if self.error:
            return
        what = "mapped (kept region, resident)" if self.recovered else "populated"
        log.info(
            "region %s: %.1f GiB in %.2f s, %.2f GiB/s (%s; placement %s, numa %s; "
            "%.1f GiB in huge pages)",
            what,
            self.populated_bytes / GIB,
            self.finished_s - self.started_s,
            self.rate_bytes_per_s() / GIB,
            self._describe_parts(),
            self.placement,
            self.plan.numa,
            self.huge_page_bytes / GIB,
        )

"""GPU copy lanes: one direction on one GPU, its stream and its two threads.

Rules:
- A job's runs are built off the loop, on the runtime's preparing threads (``prepare``
  and the kernel's share of the runs), several jobs at once: numpy lets go of the GIL
  over large arrays, and a job of 512-byte fragments has tens of thousands of runs.
  The lane's issuing thread takes jobs in the order they came, each once it is
  prepared, waits on the engine's store fence for a store, then enqueues the copies
  on the lane's stream:
  where the region part the job touches is pinned, the runs the device's calibration
  gives the gather kernel go to launches of it (``gather``, ``choice``), the rest to
  one batched copy (cuMemcpyBatchAsync) when the driver has it, else (and for unpinned
  parts) a cuMemcpyAsync loop.
- Its completing thread posts a job's completion only after the stream passed the
  job's event, so memory is never released under a running copy, even after errors.
- Lane threads and preparing threads touch no daemon metadata.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvoffload.cuda.driver import CudaApi, CudaError
from kvoffload.datapath.copyplan import JobPlan
from kvoffloadd.copies.calibrate import DevicePaths
from kvoffloadd.copies.choice import TILE_BYTES, kernel_runs
from kvoffloadd.copies.copier import ChecksumCheck, CompletionSink, finished
from kvoffloadd.copies.gather import TileRing

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


@dataclass
class GpuJob:
    token: int
    dst: I64
    src: I64
    nbytes: I64
    wait_event: int
    region_end_bytes: int  # one past the highest region offset the job touches
    started_s: float
    check: ChecksumCheck | None = None
    corrupt: list[int] = field(default_factory=list)
    plan: JobPlan | None = None  # built into dst/src/nbytes by a preparing thread
    kernel: Bools | None = None  # the runs the kernel moves, where it was ready


class CopyLane:
    """One direction on one GPU: one stream, an issuing and a completing thread.

    One stream per direction on purpose: spreading a transfer over 2 or 4 streams
    made 32 KiB-page copies 20-40% slower on an H100 (measured with ``make bench``).
    """

    def __init__(
        self,
        api: CudaApi,
        ordinal: int,
        to_host: bool,
        sink: CompletionSink,
        pinned: Callable[[GpuJob], bool],
        prepare: Callable[[GpuJob], None] = lambda job: None,
        paths: DevicePaths | None = None,
        preparers: Executor | None = None,
    ) -> None:
        """``preparers``: the threads that prepare jobs (None: the issuing thread)."""
        self._api, self.ordinal, self.to_host = api, ordinal, to_host
        self._sink, self._pinned, self._prepare = sink, pinned, prepare
        self._paths = paths
        self._preparers = preparers
        self._ring: TileRing | None = None
        self._jobs: queue.SimpleQueue[tuple[GpuJob, Future[None] | None] | None] = (
            queue.SimpleQueue()
        )
        # (job, completion event or 0, enqueued without error)
        self._issued: queue.SimpleQueue[tuple[GpuJob, int, bool] | None] = queue.SimpleQueue()
        self._free_events: queue.SimpleQueue[int] = queue.SimpleQueue()
        name = f"kvoffload-gpu{ordinal}-{'store' if to_host else 'load'}"
        self._waiter = threading.Thread(target=self._complete, name=f"{name}-done", daemon=True)
        self._issuer = threading.Thread(target=self._issue, name=name, daemon=True)
        self.batched_jobs = self.looped_jobs = self.kernel_jobs = 0
        self.kernel_bytes = 0
        self._waiter.start()
        self._issuer.start()

    def submit(self, job: GpuJob) -> None:
        pool = self._preparers
        self._jobs.put((job, pool.submit(self._prepare_job, job) if pool else None))

    def _prepare_job(self, job: GpuJob) -> None:
        """The job's runs, and which of them the kernel moves (if it is ready)."""
        self._prepare(job)
        paths = self._paths
        if paths is not None and paths.kernel_ready and job.nbytes.size and self._pinned(job):
            job.kernel = kernel_runs(paths.choice, self.to_host, job.dst, job.src, job.nbytes)

    def _event(self) -> int:
        try:
            return self._free_events.get_nowait()
        except queue.Empty:
            return self._api.event_create()

    def _enqueue(self, job: GpuJob, prepared: Future[None] | None, stream: int) -> None:
        api = self._api
        if prepared is None:
            self._prepare_job(job)
        else:
            prepared.result()  # its error, if any, fails the job
        if job.check is not None and job.check.expected is not None:
            job.corrupt = job.check.mismatches()  # verify the region before loading
            if job.corrupt:
                return
        if job.wait_event:
            api.stream_wait_event(stream, job.wait_event)
        dst, src, nbytes = job.dst, job.src, job.nbytes
        pinned = self._pinned(job)
        paths = self._paths
        mine = job.kernel
        if mine is not None and paths is not None:
            count = int(np.count_nonzero(mine))
            if count:
                if self._ring is None:
                    self._ring = TileRing(api)
                choice = paths.choice
                assert paths.kernel is not None
                ctas = choice.max_ctas[self.to_host] if choice else 2 * paths.kernel.multiprocessors
                tile = choice.tile_bytes if choice else TILE_BYTES
                every = count == nbytes.size  # the usual case: no masks to apply
                runs = (dst, src, nbytes) if every else (dst[mine], src[mine], nbytes[mine])
                self._ring.launch(paths.kernel, *runs, stream, ctas, tile)
                self.kernel_jobs += 1
                self.kernel_bytes += int(runs[2].sum())
                if every:
                    return
                rest = ~mine
                dst, src, nbytes = dst[rest], src[rest], nbytes[rest]
        if pinned and api.has_batch:
            api.memcpy_batch_async(dst, src, nbytes, stream, self.ordinal, self.to_host)
            self.batched_jobs += 1
        else:
            for d, s, n in zip(dst.tolist(), src.tolist(), nbytes.tolist()):
                api.memcpy_async(d, s, n, stream)
            self.looped_jobs += 1

    def _issue(self) -> None:
        api = self._api
        api.set_device(self.ordinal)
        stream = api.stream_create()
        while (item := self._jobs.get()) is not None:
            job, prepared = item
            ok = True
            event = 0
            try:
                self._enqueue(job, prepared, stream)
            except CudaError as exc:
                log.error("GPU %d copy job %d failed: %s", self.ordinal, job.token, exc)
                ok = False
            except Exception:  # building its runs failed: the job fails, the lane goes on
                log.exception("GPU %d copy job %d could not be planned", self.ordinal, job.token)
                ok = False
            try:  # even after a failure: completion waits for what was enqueued
                event = self._event()
                api.event_record(event, stream)
            except CudaError as exc:
                log.error("GPU %d cannot record a completion event: %s", self.ordinal, exc)
                ok = False
            self._issued.put((job, event, ok))
        self._issued.put(None)
        self._waiter.join()
        if self._ring is not None:
            self._ring.close()
        with contextlib.suppress(CudaError, queue.Empty):
            while True:
                api.event_destroy(self._free_events.get_nowait())
        with contextlib.suppress(CudaError):
            api.stream_destroy(stream)

    def _complete(self) -> None:
        self._api.set_device(self.ordinal)
        while (item := self._issued.get()) is not None:
            job, event, ok = item
            if event:
                try:
                    self._api.event_synchronize(event)
                except CudaError as exc:
                    log.error("GPU %d copy job %d failed: %s", self.ordinal, job.token, exc)
                    ok = False
                self._free_events.put(event)
            nbytes = int(job.nbytes.sum())
            self._sink.post(finished(job.token, ok, nbytes, job.started_s, job.check, job.corrupt))

    def close(self) -> None:
        self._jobs.put(None)
        self._issuer.join()

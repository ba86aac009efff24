"""GPU data path: engines' CUDA caches imported by IPC handle, copied on per-GPU streams.

Rules:
- GPUs are named by UUID on the wire; ``GpuRuntime`` maps each UUID to this process's
  ordinal, so the engines' ``CUDA_VISIBLE_DEVICES`` never matter.
- Each (GPU, IPC handle) is opened once and reference-counted: several tensors (and
  workers) inside one allocation share one mapping. A worker's imports are released
  by ``AttachedWorker.close``, which the service calls only after the worker's copies
  have drained (closing memory under a running copy is undefined behaviour).
- Import checks every row the daemon may touch against the imported allocation's size
  (invariant 4), exactly as the CPU path checks a memfd's size.
- Per GPU there are two lanes, stores (to the region) and loads (to the GPU), each with
  its own stream, an issuing thread and a completion thread. A store's stream first
  waits on the engine's interprocess event. Each transfer is one batched copy
  (cuMemcpyBatchAsync) when the driver has it and the region part it touches is pinned,
  else a cuMemcpyAsync loop. A completion is posted only after the stream passed the
  job's event, so memory is never released under a running copy, even after errors.
- Only the loop thread calls ``attach``/``submit``; lane threads touch no metadata.
  A transfer comes as a ``JobPlan``: its issuing thread builds the runs and cuts them
  at pinning-chunk boundaries, off the loop.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvoffload.cuda.driver import (
    IPC_HANDLE_BYTES,
    CudaApi,
    CudaError,
    driver_error,
    load_driver,
)
from kvoffload.datapath.copyplan import CacheGeometry, JobPlan, split_at_boundaries
from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.messages import CacheDesc
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import ChecksumCheck, CompletionSink, finished
from kvoffloadd.copies.workers import ImportedCache, check_desc
from kvoffloadd.region.pinning import RegionPinner
from kvoffloadd.region.region import SharedOffloadRegion

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]
_NONE: I64 = np.zeros(0, dtype=np.int64)


@dataclass
class GpuCache:
    geometry: CacheGeometry
    base_address: int  # device address of the allocation base + the tensor's offset
    nbytes: int
    release: Callable[[], None]

    def close(self) -> None:
        self.release()


@dataclass
class _Import:
    device_ptr: int
    size_bytes: int
    refs: int


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
    plan: JobPlan | None = None  # built into dst/src/nbytes by the issuing thread


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
        batch_ok: Callable[[GpuJob], bool],
        prepare: Callable[[GpuJob], None] = lambda job: None,
    ) -> None:
        self._api, self.ordinal, self.to_host = api, ordinal, to_host
        self._sink, self._batch_ok, self._prepare = sink, batch_ok, prepare
        self._jobs: queue.SimpleQueue[GpuJob | None] = queue.SimpleQueue()
        # (job, completion event or 0, enqueued without error)
        self._issued: queue.SimpleQueue[tuple[GpuJob, int, bool] | None] = queue.SimpleQueue()
        self._free_events: queue.SimpleQueue[int] = queue.SimpleQueue()
        name = f"kvoffload-gpu{ordinal}-{'store' if to_host else 'load'}"
        self._waiter = threading.Thread(target=self._complete, name=f"{name}-done", daemon=True)
        self._issuer = threading.Thread(target=self._issue, name=name, daemon=True)
        self.batched_jobs = self.looped_jobs = 0
        self._waiter.start()
        self._issuer.start()

    def submit(self, job: GpuJob) -> None:
        self._jobs.put(job)

    def _event(self) -> int:
        try:
            return self._free_events.get_nowait()
        except queue.Empty:
            return self._api.event_create()

    def _enqueue(self, job: GpuJob, stream: int) -> None:
        api = self._api
        self._prepare(job)
        if job.check is not None and job.check.expected is not None:
            job.corrupt = job.check.mismatches()  # verify the region before loading
            if job.corrupt:
                return
        if job.wait_event:
            api.stream_wait_event(stream, job.wait_event)
        if self._batch_ok(job):
            api.memcpy_batch_async(job.dst, job.src, job.nbytes, stream, self.ordinal, self.to_host)
            self.batched_jobs += 1
        else:
            for d, s, n in zip(job.dst.tolist(), job.src.tolist(), job.nbytes.tolist()):
                api.memcpy_async(d, s, n, stream)
            self.looped_jobs += 1

    def _issue(self) -> None:
        api = self._api
        api.set_device(self.ordinal)
        stream = api.stream_create()
        while (job := self._jobs.get()) is not None:
            ok = True
            event = 0
            try:
                self._enqueue(job, stream)
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


class GpuRuntime:
    """The daemon's GPUs: UUID map, imported handles and copy lanes (loop thread)."""

    def __init__(
        self,
        api: CudaApi,
        sink: CompletionSink,
        region_base: int,
        pinner: RegionPinner,
    ) -> None:
        self.api = api
        self.pinner = pinner
        self._sink = sink
        self._region_base = region_base
        self._boundary_bytes = max(1, pinner.chunk_bytes)
        self.ordinals = {api.device_uuid(i): i for i in range(api.device_count())}
        self._imports: dict[tuple[int, bytes], _Import] = {}
        self._lanes: dict[tuple[int, bool], CopyLane] = {}

    @property
    def open_handles(self) -> int:
        return len(self._imports)

    def describe(self) -> list[str]:
        return [f"{i}:{self.api.device_name(i)}" for i in sorted(self.ordinals.values())]

    # ------------------------------------------------------------ import

    def _ordinal(self, uuid: bytes) -> int:
        ordinal = self.ordinals.get(uuid)
        if ordinal is None:
            seen = ", ".join(u.hex() for u in self.ordinals) or "none"
            raise InvalidArgumentError(
                f"GPU {uuid.hex()} is not visible to kvoffloadd (it sees: {seen}); "
                "the daemon must run on the engine's node with every GPU visible"
            )
        return ordinal

    def _open(self, ordinal: int, handle: bytes) -> _Import:
        key = (ordinal, handle)
        imp = self._imports.get(key)
        if imp is None:
            try:
                ptr = self.api.ipc_open_mem_handle(handle)
                _base, size = self.api.address_range(ptr)
            except CudaError as exc:
                raise InvalidArgumentError(f"cannot import the CUDA IPC handle: {exc}") from exc
            imp = self._imports[key] = _Import(ptr, size, 0)
        imp.refs += 1
        return imp

    def _close(self, ordinal: int, handle: bytes) -> None:
        key = (ordinal, handle)
        imp = self._imports[key]
        imp.refs -= 1
        if imp.refs == 0:
            del self._imports[key]
            self.api.set_device(ordinal)
            try:
                self.api.ipc_close_mem_handle(imp.device_ptr)
            except CudaError as exc:
                log.warning("closing a CUDA IPC handle on GPU %d: %s", ordinal, exc)

    def attach(
        self, descs: list[CacheDesc], uuid: bytes, store_event: bytes
    ) -> tuple[int, list[ImportedCache], int]:
        """Import one worker's caches: (ordinal, caches, imported store event).

        The caller checked that the caches' pages fit the layout."""
        if any(d.kind != "cuda" or len(d.ipc_handle) != IPC_HANDLE_BYTES for d in descs):
            raise InvalidArgumentError(
                f"every cache of a GPU worker must be kind 'cuda' with a "
                f"{IPC_HANDLE_BYTES}-byte IPC handle"
            )
        if len(store_event) != IPC_HANDLE_BYTES:
            raise InvalidArgumentError("a GPU worker must send the IPC handle of its store event")
        ordinal = self._ordinal(uuid)
        geometries = [check_desc(d) for d in descs]
        self.api.set_device(ordinal)
        caches: list[ImportedCache] = []
        try:
            for desc, geo in zip(descs, geometries):
                imp = self._open(ordinal, desc.ipc_handle)
                release = _once(self._close, ordinal, desc.ipc_handle)
                if geo.end_bytes > imp.size_bytes:
                    release()
                    raise InvalidArgumentError(
                        f"cache needs {geo.end_bytes} bytes but its CUDA allocation "
                        f"holds {imp.size_bytes}"
                    )
                caches.append(GpuCache(geo, imp.device_ptr, geo.end_bytes, release))
            try:
                event = self.api.ipc_open_event_handle(store_event)
            except CudaError as exc:
                raise InvalidArgumentError(f"cannot import the store event: {exc}") from exc
        except BaseException:
            for c in caches:
                c.close()
            raise
        return ordinal, caches, event

    def release_event(self, ordinal: int, event: int) -> None:
        self.api.set_device(ordinal)
        with contextlib.suppress(CudaError):
            self.api.event_destroy(event)

    # ------------------------------------------------------------ copies

    def _lane(self, ordinal: int, to_host: bool) -> CopyLane:
        lane = self._lanes.get((ordinal, to_host))
        if lane is None:
            lane = CopyLane(self.api, ordinal, to_host, self._sink, self._batch_ok, self._prepare)
            self._lanes[(ordinal, to_host)] = lane
        return lane

    def _batch_ok(self, job: GpuJob) -> bool:
        """Batched only where the region part is pinned (registration is in order)."""
        return self.api.has_batch and job.region_end_bytes <= self.pinner.pinned_bytes

    def submit(
        self, ordinal: int, token: int, plan: JobPlan, wait: int, check: ChecksumCheck | None
    ) -> None:
        """Queue one transfer (``plan``'s addresses are absolute: host ones for the
        region); its lane builds the runs."""
        to_host = plan.is_store
        t0 = time.perf_counter()
        job = GpuJob(token, _NONE, _NONE, _NONE, wait if to_host else 0, 0, t0, check, plan=plan)
        self._lane(ordinal, to_host).submit(job)

    def _prepare(self, job: GpuJob) -> None:
        """On the lane's thread: the job's runs, cut where pinning chunks meet."""
        if job.plan is None:
            return
        dst, src, nbytes = job.plan.addresses()
        to_host = job.plan.is_store
        region, other = (dst, src) if to_host else (src, dst)
        rel, other, nbytes = split_at_boundaries(
            region - self._region_base, other, nbytes, self._boundary_bytes
        )
        job.region_end_bytes = int((rel + nbytes).max()) if rel.size else 0
        region = rel + self._region_base
        job.dst, job.src = (region, other) if to_host else (other, region)
        job.nbytes = nbytes

    def lane_counts(self) -> tuple[int, int]:
        """(jobs copied with one batched call, jobs copied with a cuMemcpyAsync loop)."""
        lanes = self._lanes.values()
        return sum(x.batched_jobs for x in lanes), sum(x.looped_jobs for x in lanes)

    def close(self) -> None:
        """Stop the lanes (after their queued copies) and unpin the region."""
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        self.pinner.close()


def start_gpu(
    cfg: DaemonConfig, region: SharedOffloadRegion, sink: CompletionSink
) -> tuple[GpuRuntime | None, str]:
    """The GPU runtime, or None and why not; starts pinning the region in the background."""
    if cfg.gpu == "off":
        return None, 'GPU support is off (gpu = "off" in the daemon config)'
    api = load_driver()
    if api is None:
        return None, driver_error()
    try:
        if api.device_count() == 0:
            return None, "no CUDA device is visible to the daemon"
        pinner = region.make_pinner(api)  # the region's chunks, each once populated
        runtime = GpuRuntime(api, sink, region.data_address, pinner)
    except CudaError as exc:
        return None, f"CUDA is not usable: {exc}"
    if cfg.pin_region:
        region.start_pinning()
    else:
        pinner.done.set()
    log.info(
        "GPU copies enabled on %s (driver %d, batched copies: %s)",
        ", ".join(runtime.describe()),
        getattr(api, "driver_version", 0),
        "yes" if api.has_batch else "no",
    )
    return runtime, ""


def _once(fn: Callable[[int, bytes], None], ordinal: int, handle: bytes) -> Callable[[], None]:
    done = False

    def release() -> None:
        nonlocal done
        if not done:
            done = True
            fn(ordinal, handle)

    return release

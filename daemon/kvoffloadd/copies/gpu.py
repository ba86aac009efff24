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
  its own stream, an issuing thread and a completion thread (``lanes``). Each device's
  copy paths (the gather kernel for small runs, DMA for the rest) are calibrated on it
  when its first worker attaches (``calibrate``); until then its lanes copy with DMA.
- A copier thread imports (``attach``: IPC opens map memory, never on the loop); the
  table of open imports is shared with the loop, which closes them, under a lock. Only
  the loop thread calls ``submit`` and ``device_paths``; lane threads touch no metadata.
  A transfer comes as a ``JobPlan``: one of ``PREPARING_THREADS`` threads, shared by
  every lane, builds its runs and cuts them at pinning-chunk boundaries, off the loop.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.cuda.driver import (
    IPC_HANDLE_BYTES,
    CudaApi,
    CudaError,
    driver_error,
    load_driver,
)
from kvoffload.datapath.copyplan import JobPlan
from kvoffload.datapath.runs import CacheGeometry, split_at_boundaries
from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.messages import CacheDesc
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.calibrate import DevicePaths
from kvoffloadd.copies.copier import ChecksumCheck, CompletionSink
from kvoffloadd.copies.imports import check_desc
from kvoffloadd.copies.lanes import CopyLane, GpuJob
from kvoffloadd.copies.workers import ImportedCache
from kvoffloadd.loopthread import off_loop
from kvoffloadd.region.pinning import RegionPinner
from kvoffloadd.region.region import SharedOffloadRegion

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]
_NONE: I64 = np.zeros(0, dtype=np.int64)
# Threads that build jobs' runs for every lane: two prepared 512-byte-fragment jobs
# 1.5x as fast as one (numpy lets go of the GIL over large arrays); the loop and the
# lanes' own threads need the rest of the GIL.
PREPARING_THREADS = 2


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


class GpuRuntime:
    """The daemon's GPUs: UUID map, imported handles and copy lanes (loop thread)."""

    def __init__(
        self,
        api: CudaApi,
        sink: CompletionSink,
        region_base: int,
        pinner: RegionPinner,
        kernel_mode: str = "off",
        calibration: dict[str, Any] | None = None,
    ) -> None:
        self.api = api
        self.pinner = pinner
        self.kernel_mode = kernel_mode
        self._calibration = calibration or {}  # keyword arguments of calibrate()
        self._sink = sink
        self._region_base = region_base
        self._boundary_bytes = max(1, pinner.chunk_bytes)
        self.ordinals = {api.device_uuid(i): i for i in range(api.device_count())}
        self._imports: dict[tuple[int, bytes], _Import] = {}
        # imports run on a copier thread (nothing maps on the loop), closes on the loop
        self._imports_lock = threading.Lock()
        self._lanes: dict[tuple[int, bool], CopyLane] = {}
        self._preparers = ThreadPoolExecutor(PREPARING_THREADS, "kvoffload-gpu-prepare")
        self.paths: dict[int, DevicePaths] = {}

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
        with self._imports_lock:
            imp = self._imports.get(key)
            if imp is None:
                off_loop("importing a CUDA IPC handle")
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
        with self._imports_lock:
            imp = self._imports[key]
            imp.refs -= 1
            if imp.refs:
                return
            del self._imports[key]
            self.api.set_device(ordinal)
            try:
                self.api.ipc_close_mem_handle(imp.device_ptr)
            except CudaError as exc:
                log.warning("closing a CUDA IPC handle on GPU %d: %s", ordinal, exc)

    def attach(
        self, descs: list[CacheDesc], uuid: bytes, store_event: bytes
    ) -> tuple[int, list[ImportedCache], int]:
        """Import one worker's caches: (ordinal, caches, imported store event). Runs on
        a copier thread (``device_paths`` is the loop's, when the import lands).

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

    def device_paths(self, ordinal: int) -> DevicePaths:
        """The device's copy paths; the first call starts their calibration."""
        paths = self.paths.get(ordinal)
        if paths is None:
            paths = self.paths[ordinal] = DevicePaths(ordinal, self.kernel_mode)
            paths.start(self.api, **self._calibration)
        return paths

    def _lane(self, ordinal: int, to_host: bool) -> CopyLane:
        lane = self._lanes.get((ordinal, to_host))
        if lane is None:
            paths = self.device_paths(ordinal)
            lane = CopyLane(
                self.api,
                ordinal,
                to_host,
                self._sink,
                self._pinned,
                self._prepare,
                paths,
                self._preparers,
            )
            self._lanes[(ordinal, to_host)] = lane
        return lane

    def _pinned(self, job: GpuJob) -> bool:
        """Whether the region part a job touches is pinned (registration is in order):
        batched copies and the kernel need it."""
        return job.region_end_bytes <= self.pinner.pinned_bytes

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
        """On a preparing thread: the job's runs, cut where pinning chunks meet."""
        if job.plan is None:
            return
        dst, src, nbytes = job.plan.addresses()
        to_host = job.plan.is_store
        region, other = (dst, src) if to_host else (src, dst)
        base, chunk = self._region_base, self._boundary_bytes
        if region.size:
            first, end = int(region.min()) - base, int((region + nbytes).max()) - base
            job.region_end_bytes = end
            if first // chunk != (end - 1) // chunk:  # some run crosses into another chunk
                rel, other, nbytes = split_at_boundaries(region - base, other, nbytes, chunk)
                region = rel + base
        job.dst, job.src = (region, other) if to_host else (other, region)
        job.nbytes = nbytes

    def lane_counts(self) -> tuple[int, int]:
        """(jobs copied with one batched call, jobs copied with a cuMemcpyAsync loop)."""
        lanes = self._lanes.values()
        return sum(x.batched_jobs for x in lanes), sum(x.looped_jobs for x in lanes)

    def kernel_counts(self) -> tuple[int, int]:
        """(jobs that launched the gather kernel, bytes it copied)."""
        lanes = self._lanes.values()
        return sum(x.kernel_jobs for x in lanes), sum(x.kernel_bytes for x in lanes)

    def close(self) -> None:
        """Stop the lanes (after their queued copies), the calibrations, and unpin."""
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        self._preparers.shutdown()
        for paths in self.paths.values():
            paths.close(self.api)
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
        runtime = GpuRuntime(api, sink, region.data_address, pinner, cfg.gpu_kernel)
    except CudaError as exc:
        return None, f"CUDA is not usable: {exc}"
    if cfg.pin_region:
        region.start_pinning()
    else:
        pinner.done.set()
    log.info(
        "GPU copies enabled on %s (driver %d, batched copies: %s, copy kernel: %s)",
        ", ".join(runtime.describe()),
        getattr(api, "driver_version", 0),
        "yes" if api.has_batch else "no",
        cfg.gpu_kernel,
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

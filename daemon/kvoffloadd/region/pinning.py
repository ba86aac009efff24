"""Page-locking the region for GPU DMA: cuMemHostRegister chunk by chunk, each as soon
as it is populated.

Rules:
- The region is registered in the chunks of its plan (placement.py: at most
  ``populate_chunk_size``, 2 GiB by default, whole extents), in order, so no slot
  straddles two registrations; GPU copy runs are cut at chunk boundaries
  (``kvoffload.datapath.copyplan.split_at_boundaries``) because a batched copy may not
  span two. Chunks of at most 2 GiB: one registration of >= 512 GiB fails on current
  drivers, and a registration holds driver locks that stall every other process's CUDA
  calls for as long as it runs (research/node-scale.md).
- Population and registration are a pipeline: the pinning thread waits for chunk i to
  be populated (``wait_chunk``), registers it while later chunks are being populated,
  and never registers memory still being faulted in (registering unpopulated memory
  faults it on this one thread).
- ``pinned_bytes`` is a prefix of the region (registration is in order): the GPU lanes
  batch copies only below it. Per chunk it keeps how long the registration took and
  how long it waited for population; ``statistics`` reports them.
- The driver call is a ctypes foreign call (``DriverApi``): the GIL is free while it runs.
- If a registration fails, the thread logs why and stops: the daemon keeps working
  with pageable copies. ``close`` unregisters every chunk it registered, before the
  region is unmapped.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvoffload.cuda.driver import CudaApi, CudaError

log = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 64 << 30
PROGRESS_LOG_S = 5.0
WAIT_POLL_S = 0.2  # how often a wait for population looks whether to stop
GIB = 1 << 30


def plan_chunks(
    region_bytes: int, align_bytes: int, max_chunk_bytes: int = MAX_CHUNK_BYTES
) -> list[tuple[int, int]]:
    """(offset, bytes) of each registration: aligned, at most ``max_chunk_bytes``."""
    per = max(align_bytes, max_chunk_bytes // align_bytes * align_bytes)
    return [(off, min(per, region_bytes - off)) for off in range(0, region_bytes, per)]


class RegionPinner:
    def __init__(
        self,
        api: CudaApi,
        base_address: int,
        chunks: list[tuple[int, int]],
        before: Callable[[], None] | None = None,
        wait_chunk: Callable[[int, float], bool | None] | None = None,
        on_pinned: Callable[[int], None] | None = None,
        on_stopped: Callable[[], None] | None = None,
    ) -> None:
        """``wait_chunk(i, timeout_s)``: block until chunk i is populated (True), its
        population ended without it (False) or the timeout passed (None);
        ``on_pinned(n)``: the first n chunks are registered; ``on_stopped``: no more
        will be (an error or close)."""
        self._api = api
        self._base = base_address
        self.chunks = chunks
        self.chunk_bytes = chunks[0][1] if chunks else 0
        self.total_bytes = sum(n for _, n in chunks)
        self.pinned_bytes = 0
        self.error = ""
        self.seconds = 0.0
        self.first_chunk_s = 0.0  # from start until the first chunk was registered
        self.chunk_seconds: list[float] = []  # each registration's own time
        self.wait_seconds = 0.0  # waiting for chunks to be populated
        self.done = threading.Event()
        self._before = before
        self._wait_chunk = wait_chunk
        self._on_pinned = on_pinned
        self._on_stopped = on_stopped
        self._stop = threading.Event()
        self._registered: list[int] = []
        self._thread = threading.Thread(target=self._run, name="kvoffload-pin", daemon=True)

    @property
    def fully_pinned(self) -> bool:
        return self.done.is_set() and self.pinned_bytes == self.total_bytes

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        logged_s = t0
        try:
            if self._before is not None:
                self._before()
            self._api.set_device(0)
            for i, (off, n) in enumerate(self.chunks):
                if self._stop.is_set():
                    return
                w0 = time.monotonic()
                if not self._wait(i):
                    return
                r0 = time.monotonic()
                self.wait_seconds += r0 - w0
                self._api.host_register(self._base + off, n)
                now = time.monotonic()
                self._registered.append(self._base + off)
                self.chunk_seconds.append(now - r0)
                self.pinned_bytes += n
                if i == 0:
                    self.first_chunk_s = now - t0
                if self._on_pinned is not None:
                    self._on_pinned(i + 1)
                if now - logged_s >= PROGRESS_LOG_S:
                    logged_s = now
                    self._log("pinning the region", now - t0)
            self.seconds = time.monotonic() - t0
            self._log("pinned the region for GPU copies", self.seconds)
        except CudaError as exc:
            self.error = str(exc)
            log.warning(
                "pinning the region stopped after %d MiB: %s; GPU copies of the rest "
                "stay pageable (slower)",
                self.pinned_bytes >> 20,
                exc,
            )
        finally:
            self.done.set()
            if self._on_stopped is not None and not self.fully_pinned:
                self._on_stopped()

    def _wait(self, i: int) -> bool:
        """Until chunk i is populated; False if stopped meanwhile. A chunk whose
        population stopped (an error) is registered anyway: registering faults it in."""
        while self._wait_chunk is not None and not self._stop.is_set():
            if self._wait_chunk(i, WAIT_POLL_S) is not None:
                break
        return not self._stop.is_set()

    def _log(self, what: str, elapsed_s: float) -> None:
        register_s = sum(self.chunk_seconds)
        log.info(
            "%s: %.1f of %.1f GiB in %d of %d chunks in %.2f s (first chunk at %.2f s; "
            "register %.2f GiB/s, at most %.3f s per chunk; %.2f s waiting for population)",
            what,
            self.pinned_bytes / GIB,
            self.total_bytes / GIB,
            len(self.chunk_seconds),
            len(self.chunks),
            elapsed_s,
            self.first_chunk_s,
            self.pinned_bytes / GIB / register_s if register_s else 0.0,
            max(self.chunk_seconds, default=0.0),
            self.wait_seconds,
        )

    def statistics(self) -> dict[str, Any]:
        """The pinning fields of the ``gpu`` stats section."""
        secs = self.chunk_seconds
        register_s = sum(secs)
        return {
            "pinned_bytes": self.pinned_bytes,
            "pin_target_bytes": self.total_bytes,
            "pin_chunks": len(self.chunks),
            "pin_chunk_bytes": self.chunk_bytes,
            "pinned_chunks": len(secs),
            "pin_seconds": round(self.seconds, 3),
            "pin_first_chunk_s": round(self.first_chunk_s, 3),
            "pin_chunk_seconds_last": round(secs[-1], 4) if secs else 0.0,
            "pin_chunk_seconds_max": round(max(secs), 4) if secs else 0.0,
            "pin_register_seconds_total": round(register_s, 3),
            "pin_wait_seconds_total": round(self.wait_seconds, 3),
            "pin_rate_bytes_per_s": round(self.pinned_bytes / register_s) if register_s else 0,
            "pin_error": self.error,
        }

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for ptr in reversed(self._registered):
            with contextlib.suppress(CudaError):
                self._api.host_unregister(ptr)
        self._registered.clear()

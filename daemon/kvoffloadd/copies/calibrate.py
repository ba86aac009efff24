"""Start-up calibration of a GPU's copy paths: the kernel against DMA, timed on the device.

Rules:
- Runs on its own thread, once per device, when the device's first lane starts; the
  lanes copy with DMA only until it has published its result (``DevicePaths``).
- It uses its own scratch buffers (device memory and pinned host memory, freed after)
  and its own stream: it never touches the region or engines' caches.
- Every method and direction is timed over ``choice.SIZES`` x ``choice.COUNTS`` (runs
  scattered over the scratch buffers), best of a few repeats, wall-clock from the
  first call to the completion event: what a lane pays, its Python included. The
  CTAs a launch may use are the fewest that reach 95% of the best rate at 32 KiB runs
  (fewer SMs taken from the engine for the same bytes).
- A failure (a driver that cannot load the PTX, no memory for the scratch buffers)
  leaves the device on DMA, with the reason in the stats.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.cuda.driver import CudaApi, CudaError
from kvoffloadd.copies.choice import (
    COUNTS,
    SIZES,
    TILE_BYTES,
    DeviceChoice,
    Timings,
    crossover,
)
from kvoffloadd.copies.gather import GatherKernel, TileRing, load_kernel

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]
SCRATCH_BYTES = 64 << 20
REPEATS = 3
CTA_PROBE_BYTES = 32 << 10


class DevicePaths:
    """One device's copy paths, as its lanes read them (published once, then fixed)."""

    def __init__(self, ordinal: int, mode: str) -> None:
        self.ordinal, self.mode = ordinal, mode
        self.kernel: GatherKernel | None = None
        self.choice: DeviceChoice | None = None  # None with a kernel: "always"
        self.state = "calibrating" if mode != "off" else "off"
        self.seconds = 0.0
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def kernel_ready(self) -> bool:
        return self.done.is_set() and self.kernel is not None

    def start(self, api: CudaApi, **kwargs: Any) -> None:
        if self.mode == "off":
            self.done.set()
            return
        self._thread = threading.Thread(
            target=self._run,
            args=(api,),
            kwargs=kwargs,
            name=f"kvoffload-gpu{self.ordinal}-calibrate",
            daemon=True,
        )
        self._thread.start()

    def _run(self, api: CudaApi, **kwargs: Any) -> None:
        t0 = time.monotonic()
        kernel = None
        try:
            api.set_device(self.ordinal)
            kernel, why = load_kernel(api, self.ordinal)
            if kernel is None:
                self.state = f"dma only: {why}"
                log.warning("GPU %d copies with DMA only: %s", self.ordinal, why)
                return
            if self.mode == "auto":
                self.choice = calibrate(api, self.ordinal, kernel, stop=self._stop, **kwargs)
            self.kernel = kernel
            self.state = "ready"
            log.info("GPU %d copy paths: %s", self.ordinal, self.describe())
        except (CudaError, _Stopped) as exc:
            self.state = f"dma only: calibration failed: {exc}"
            log.warning("GPU %d copies with DMA only: calibration failed: %s", self.ordinal, exc)
            if kernel is not None:
                with contextlib.suppress(CudaError):
                    api.module_unload(kernel.module)
        finally:
            self.seconds = time.monotonic() - t0
            self.done.set()

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "mode": self.mode}
        if self.kernel is not None:
            out["multiprocessors"] = self.kernel.multiprocessors
        c = self.choice
        if c is not None:
            for to_host, name in ((True, "store"), (False, "load")):
                out[f"{name}_max_ctas"] = c.max_ctas[to_host]
                out[f"{name}_kernel_below_bytes"] = c.crossover_bytes.get(to_host, 0)
        out["calibration_s"] = round(self.seconds, 3)
        return out

    def close(self, api: CudaApi) -> None:
        """Stop calibrating; unload the kernel (after the lanes stopped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.kernel is not None:
            with contextlib.suppress(CudaError):
                api.set_device(self.ordinal)
                api.module_unload(self.kernel.module)
            self.kernel = None


class _Stopped(Exception):
    pass


class _Bench:
    """Scratch buffers, a stream and an event: times one copy method."""

    def __init__(self, api: CudaApi, ordinal: int, scratch_bytes: int) -> None:
        self.api, self.ordinal, self.scratch_bytes = api, ordinal, scratch_bytes
        self.device = self.host = self.stream = self.event = 0
        self.ring: TileRing | None = None

    def __enter__(self) -> _Bench:
        api = self.api
        try:
            self.stream = api.stream_create()
            self.event = api.event_create()
            self.device = api.mem_alloc(self.scratch_bytes)
            self.host = api.host_alloc(self.scratch_bytes)
            self.ring = TileRing(api, buffers=2)
        except CudaError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        """Free what was made, each on its own (one failure must not leak the rest)."""
        api = self.api
        if self.ring is not None:
            self.ring.close()
        for free, handle in (
            (api.host_free, self.host),
            (api.mem_free, self.device),
            (api.event_destroy, self.event),
            (api.stream_destroy, self.stream),
        ):
            if handle:
                with contextlib.suppress(CudaError):
                    free(handle)

    def runs(self, size: int, count: int, to_host: bool, seed: int) -> tuple[I64, I64, I64]:
        rng = np.random.default_rng(seed)
        slots = self.scratch_bytes // size
        host = rng.permutation(slots)[:count].astype(np.int64) * size + self.host
        dev = rng.permutation(slots)[:count].astype(np.int64) * size + self.device
        nbytes = np.full(count, size, dtype=np.int64)
        return (host, dev, nbytes) if to_host else (dev, host, nbytes)

    def time(self, issue: Callable[[], None], repeats: int, stop: threading.Event) -> float:
        best = float("inf")
        for _ in range(repeats):
            if stop.is_set():
                raise _Stopped("the daemon is stopping")
            t0 = time.perf_counter()
            issue()
            self.api.event_record(self.event, self.stream)
            self.api.event_synchronize(self.event)
            best = min(best, time.perf_counter() - t0)
        return best

    def dma(self, dst: I64, src: I64, nbytes: I64, to_host: bool) -> None:
        api = self.api
        if api.has_batch:
            api.memcpy_batch_async(dst, src, nbytes, self.stream, self.ordinal, to_host)
        else:
            for d, s, n in zip(dst.tolist(), src.tolist(), nbytes.tolist()):
                api.memcpy_async(d, s, n, self.stream)

    def kernel(self, k: GatherKernel, dst: I64, src: I64, nbytes: I64, ctas: int) -> None:
        assert self.ring is not None
        self.ring.launch(k, dst, src, nbytes, self.stream, ctas, TILE_BYTES)


def calibrate(
    api: CudaApi,
    ordinal: int,
    kernel: GatherKernel,
    *,
    stop: threading.Event | None = None,
    scratch_bytes: int = SCRATCH_BYTES,
    sizes: tuple[int, ...] = SIZES,
    counts: tuple[int, ...] = COUNTS,
    repeats: int = REPEATS,
) -> DeviceChoice:
    """Time both methods on this device (the calling thread's) and build its choice."""
    stop = stop or threading.Event()
    sms = kernel.multiprocessors
    kernel_t: dict[bool, Timings] = {}
    dma_t: dict[bool, Timings] = {}
    max_ctas: dict[bool, int] = {}
    with _Bench(api, ordinal, scratch_bytes) as bench:
        for to_host in (True, False):
            probe = min(max(counts), scratch_bytes // CTA_PROBE_BYTES)
            d, s, n = bench.runs(CTA_PROBE_BYTES, probe, to_host, seed=1)
            by_ctas = {
                c: bench.time(partial(bench.kernel, kernel, d, s, n, c), repeats, stop)
                for c in sorted({max(1, sms // 4), max(1, sms // 2), sms, 2 * sms})
            }
            best = min(by_ctas.values())
            ctas = max_ctas[to_host] = min(c for c, t in by_ctas.items() if t <= best / 0.95)
            k_s = np.full((len(sizes), len(counts)), np.nan)
            d_s = np.full((len(sizes), len(counts)), np.nan)
            for i, size in enumerate(sizes):
                for j, count in enumerate(counts):
                    if count * size > scratch_bytes:
                        continue
                    d, s, n = bench.runs(size, count, to_host, seed=i * 31 + j)
                    k_s[i, j] = bench.time(
                        partial(bench.kernel, kernel, d, s, n, ctas), repeats, stop
                    )
                    d_s[i, j] = bench.time(partial(bench.dma, d, s, n, to_host), repeats, stop)
            kernel_t[to_host] = Timings(sizes, counts, k_s)
            dma_t[to_host] = Timings(sizes, counts, d_s)
    cross = {h: crossover(kernel_t[h], dma_t[h]) for h in (True, False)}
    return DeviceChoice(kernel_t, dma_t, max_ctas, crossover_bytes=cross)

"""The gather/scatter copy kernel: loading the shipped PTX and launching it on a lane.

Rules:
- The kernel is ``gather.cu``, shipped compiled to PTX (``gather.ptx``, built with
  ``tools/build-ptx``); the driver compiles the PTX for the device at load
  (``cuModuleLoadData``), so the daemon needs no CUDA toolkit. A device whose driver
  cannot load it, or that cannot reach registered host memory at its host address,
  copies with DMA only (``load_kernel`` says why).
- A launch reads its tiles from device memory: each lane owns a ring of descriptor
  buffers (pinned host + device, ``MAX_TILES`` tiles each), copied host->device on the
  lane's stream right before the launch. A buffer is reused only after the event
  recorded behind its launch completed, so neither copy nor kernel ever reads a
  rewritten buffer.
- Only a lane's issuing thread uses its ring; only region parts already pinned reach
  the kernel (the lane checks, as for batched copies).
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from importlib import resources

import numpy as np
import numpy.typing as npt

from kvoffload.cuda.driver import (
    ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
    ATTR_MULTIPROCESSOR_COUNT,
    CudaApi,
    CudaError,
)
from kvoffloadd.copies.choice import (
    MAX_TILES,
    THREADS_PER_CTA,
    fill,
    grid_ctas,
    tiles,
)

I64 = npt.NDArray[np.int64]
KERNEL_NAME = "kvo_gather"
TILE_RECORD_BYTES = 24
RING_BUFFERS = 4


def ptx_image() -> bytes:
    return (resources.files("kvoffloadd.copies") / "gather.ptx").read_bytes()


@dataclass(frozen=True)
class GatherKernel:
    """The kernel loaded on one device (its primary context)."""

    module: int
    function: int
    multiprocessors: int


def load_kernel(api: CudaApi, ordinal: int) -> tuple[GatherKernel | None, str]:
    """Load the kernel on ``ordinal`` (the calling thread's device): the kernel, or
    None and why the device copies with DMA only."""
    try:
        if not api.device_attribute(ordinal, ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM):
            return None, (
                "the GPU cannot reach registered host memory at its host address "
                "(CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM is 0)"
            )
        sms = api.device_attribute(ordinal, ATTR_MULTIPROCESSOR_COUNT)
        module = api.module_load_data(ptx_image())
        function = api.module_get_function(module, KERNEL_NAME)
    except (CudaError, OSError) as exc:
        return None, f"cannot load the copy kernel: {exc}"
    return GatherKernel(module, function, max(1, sms)), ""


class _Buffer:
    def __init__(self, api: CudaApi, capacity: int) -> None:
        nbytes = capacity * TILE_RECORD_BYTES
        self.host = api.host_alloc(nbytes)
        try:
            self.device = api.mem_alloc(nbytes)
        except CudaError:
            api.host_free(self.host)
            raise
        self.view = np.ctypeslib.as_array(
            (ctypes.c_uint64 * (capacity * 3)).from_address(self.host)
        ).reshape(capacity, 3)
        self.event = api.event_create()
        self.used = False


class TileRing:
    """A lane's descriptor buffers and its launches (the lane's issuing thread only)."""

    def __init__(self, api: CudaApi, capacity: int = MAX_TILES, buffers: int = RING_BUFFERS):
        self._api = api
        self.capacity = capacity
        self._buffers: list[_Buffer] = []
        self._count = buffers
        self._next = 0
        self.launches = 0
        self.tiles = 0

    def _buffer(self) -> _Buffer:
        if len(self._buffers) < self._count:
            self._buffers.append(_Buffer(self._api, self.capacity))
            return self._buffers[-1]
        buf = self._buffers[self._next]
        self._next = (self._next + 1) % self._count
        if buf.used:
            self._api.event_synchronize(buf.event)  # its last launch is done
        return buf

    def launch(
        self,
        kernel: GatherKernel,
        dst: I64,
        src: I64,
        nbytes: I64,
        stream: int,
        max_ctas: int,
        tile_bytes: int,
    ) -> None:
        """Copy the runs on ``stream``: tiles, at most ``capacity`` per launch."""
        td, ts, tn = tiles(dst, src, nbytes, tile_bytes)
        api = self._api
        for a in range(0, tn.size, self.capacity):
            n = min(self.capacity, tn.size - a)
            buf = self._buffer()
            fill(buf.view[:n], td[a : a + n], ts[a : a + n], tn[a : a + n])
            api.memcpy_async(buf.device, buf.host, n * TILE_RECORD_BYTES, stream)
            grid = grid_ctas(n, max_ctas)
            api.launch_kernel(kernel.function, grid, THREADS_PER_CTA, stream, (buf.device, n))
            api.event_record(buf.event, stream)
            buf.used = True
            self.launches += 1
            self.tiles += n

    def close(self) -> None:
        """Free the buffers once their launches are done (the stream still exists)."""
        api = self._api
        for buf in self._buffers:
            if buf.used:
                with contextlib.suppress(CudaError):
                    api.event_synchronize(buf.event)
            for free, handle in (
                (api.event_destroy, buf.event),
                (api.mem_free, buf.device),
                (api.host_free, buf.host),
            ):
                with contextlib.suppress(CudaError):
                    free(handle)
        self._buffers.clear()

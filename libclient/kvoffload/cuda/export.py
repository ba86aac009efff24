"""Exporting GPU KV caches to the daemon: raw CUDA IPC handles and a store fence.

Rules:
- A CUDA cache travels as the 64-byte IPC handle of its allocation's *base*, the
  tensor's byte offset inside that allocation, and its rows (count, page, stride), in
  msgspec fields: never a pickle, never torch's internal handle format.
- The GPU is named by its UUID, so the daemon finds it whatever either side's
  ``CUDA_VISIBLE_DEVICES`` says.
- Memory that legacy CUDA IPC cannot export (``cuMemCreate`` allocations: PyTorch's
  ``expandable_segments``, vLLM's sleep mode) is refused here, at registration, with
  what to change.
- Stores must not read KV before the engine wrote it: every store first records the
  worker's interprocess event on the engine's current stream, and the daemon's copy
  stream waits on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.cuda.driver import CudaApi, driver_error, load_driver
from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.messages import CacheDesc

NOT_EXPORTABLE = (
    "the KV cache tensor on {dev} lives in memory that CUDA IPC cannot export "
    "(allocated with cuMemCreate: PyTorch expandable_segments or vLLM sleep mode). "
    "Start the engine with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False and "
    "without sleep mode, or use client-copy mode."
)


@dataclass(frozen=True)
class CudaExport:
    """What AttachWorker carries for one rank's GPU caches."""

    device_uuid: bytes
    ordinal: int
    descs: list[CacheDesc]


def require_driver() -> CudaApi:
    api = load_driver()
    if api is None:
        raise InvalidArgumentError(f"CUDA caches need the CUDA driver: {driver_error()}")
    return api


def _rows(tensor: Any) -> tuple[int, int, int]:
    """(num_blocks, page_bytes, row_stride_bytes) of a 2-D row-contiguous view."""
    if tensor.dim() != 2 or tensor.stride(1) != 1:
        raise InvalidArgumentError(
            "a KV cache must be a 2-D (num_blocks, page) view with contiguous rows"
        )
    esize = int(tensor.element_size())
    return int(tensor.shape[0]), int(tensor.shape[1]) * esize, int(tensor.stride(0)) * esize


def export_cuda_caches(tensors: Sequence[Any], api: CudaApi) -> CudaExport:
    """Describe one rank's CUDA caches (all on one GPU) for the daemon to import."""
    devices = {int(t.device.index) for t in tensors}
    if len(devices) != 1:
        raise InvalidArgumentError(
            f"one worker's caches must be on one GPU, got cuda devices {sorted(devices)}"
        )
    ordinal = devices.pop()
    api.set_device(ordinal)
    descs = []
    for t in tensors:
        num_blocks, page, stride = _rows(t)
        ptr = int(t.data_ptr())
        if not api.ipc_capable(ptr):
            raise InvalidArgumentError(NOT_EXPORTABLE.format(dev=t.device))
        base, size = api.address_range(ptr)
        offset = ptr - base
        if offset + (num_blocks - 1) * stride + page > size:
            raise InvalidArgumentError("KV cache tensor extends past its CUDA allocation")
        descs.append(
            CacheDesc(
                kind="cuda",
                num_blocks=num_blocks,
                page_bytes=page,
                offset_bytes=offset,
                row_stride_bytes=stride,
                ipc_handle=api.ipc_get_mem_handle(base),
            )
        )
    return CudaExport(api.device_uuid(ordinal), ordinal, descs)


class StoreFence:
    """An interprocess event the engine records before each store (see module rules)."""

    def __init__(self, api: CudaApi, ordinal: int) -> None:
        self._api = api
        self.ordinal = ordinal
        api.set_device(ordinal)
        self._event = api.event_create(interprocess=True)
        self.handle = api.ipc_get_event_handle(self._event)

    def record(self, stream: int) -> None:
        self._api.set_device(self.ordinal)
        self._api.event_record(self._event, stream)

    def close(self) -> None:
        if self._event:
            self._api.event_destroy(self._event)
            self._event = 0


def current_stream(ordinal: int) -> int:
    """The raw handle of PyTorch's current stream on ``cuda:ordinal``."""
    import torch

    return int(torch.cuda.current_stream(ordinal).cuda_stream)

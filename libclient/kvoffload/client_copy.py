"""Client-copy mode: a worker that maps the region and copies its leased slots itself.

For engines whose caches cannot be exported to the daemon (plain CPU tensors, such as
vLLM's CPU backend or tests). DESIGN.md section 3.

Rules:
- Only uids the daemon's config trusts (``client_copy_uids``/``client_copy_gids``) get
  the region's descriptor: a process that maps it can read and write every block.
- The daemon still owns all metadata. Every job is validated by the daemon exactly as
  for daemon copies (slots leased to the namespace, block ids inside the registered
  caches), and the daemon answers with the copy runs; the worker only executes those
  runs and then reports the job done (``ClientCopyDone``).
- Copies run in the calling thread with ``memmove`` (ctypes releases the GIL). The
  caches must stay alive and unmoved while the worker is attached.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

import numpy as np

from .protocol import messages as m
from .protocol.errors import InvalidArgumentError
from .protocol.messages import unpack_ids

_memmove = ctypes.memmove


def describe_plain_cache(tensor: Any) -> tuple[m.CacheDesc, int]:
    """(descriptor, base address) of a plain 2-D CPU tensor with contiguous rows."""
    if getattr(tensor, "is_cuda", False) or tensor.device.type != "cpu":
        raise InvalidArgumentError("client-copy mode takes CPU tensors only")
    if tensor.dim() != 2 or tensor.stride(1) != 1:
        raise InvalidArgumentError(
            "a KV cache must be a 2-D (num_blocks, page) view with contiguous rows"
        )
    esize = tensor.element_size()
    desc = m.CacheDesc(
        kind="client",
        num_blocks=int(tensor.shape[0]),
        page_bytes=int(tensor.shape[1]) * esize,
        row_stride_bytes=int(tensor.stride(0)) * esize,
    )
    return desc, int(tensor.data_ptr())


class RegionMapping:
    """The region, mapped from the descriptor the daemon sent with ``WorkerAttached``."""

    def __init__(self, fd: int, region_bytes: int) -> None:
        try:
            if os.fstat(fd).st_size < region_bytes:
                raise InvalidArgumentError("the region descriptor is smaller than the region")
            self._mm = mmap.mmap(fd, region_bytes)
        finally:
            os.close(fd)
        self._view = np.frombuffer(self._mm, dtype=np.uint8)
        self.base_address = int(self._view.ctypes.data)

    def run(self, plan: m.CopyPlanReply, cache_bases: list[int], is_store: bool) -> int:
        """Execute the runs of one validated job; returns the bytes copied."""
        region = unpack_ids(plan.region) + self.base_address
        which = unpack_ids(plan.cache_index)
        bases = np.asarray(cache_bases, dtype=np.int64)
        cache = unpack_ids(plan.cache) + (bases[which] if which.size else 0)
        nbytes = unpack_ids(plan.nbytes)
        dst, src = (region, cache) if is_store else (cache, region)
        for d, s, n in zip(dst.tolist(), src.tolist(), nbytes.tolist()):
            _memmove(d, s, n)
        return int(nbytes.sum())

    def close(self) -> None:
        del self._view
        self._mm.close()

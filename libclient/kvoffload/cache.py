"""CPU KV caches the daemon can copy into and out of: tensors over sealed memfds.

``shared_kv_cache`` allocates a ``(num_blocks, page_bytes)`` int8 tensor in a memfd
sealed against shrinking and growing, so the daemon can map it safely (a client can
never truncate it under a running copy), and populates it (the daemon refuses memory
with holes: it never allocates an engine's pages on its own account).
``describe_cache`` finds the memfd behind
any row-contiguous 2-D view of such a tensor, so vLLM's canonical views of one
buffer work too.

The memfd stays open while the tensor lives (the client re-sends it on reconnect);
it is closed when the tensor's storage is freed.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.messages import CacheDesc

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MADV_POPULATE_WRITE = 23  # Linux 5.14


@dataclass(frozen=True)
class _Buffer:
    fd: int
    base_ptr: int
    nbytes: int


_buffers: dict[int, _Buffer] = {}
_lock = threading.Lock()
_dead: deque[int] = deque()  # base pointers of freed tensors, not yet forgotten


def _forget(base_ptr: int) -> None:
    """Storage finalizer. It can run inside a garbage-collection pass triggered while
    this very thread holds ``_lock``, so it never waits for the lock: it queues the
    buffer, and whoever holds the lock forgets it on release (``_reap``)."""
    _dead.append(base_ptr)
    _reap()


def _reap() -> None:
    if not _lock.acquire(blocking=False):
        return  # the holder reaps when it is done
    try:
        fds = []
        while _dead:
            buf = _buffers.pop(_dead.popleft(), None)
            if buf is not None:
                fds.append(buf.fd)
    finally:
        _lock.release()
    for fd in fds:
        os.close(fd)


def shared_kv_cache(num_blocks: int, page_bytes: int, *, name: str = "kvoffload-kv") -> Any:
    """A zeroed ``(num_blocks, page_bytes)`` int8 CPU tensor the daemon can map."""
    import torch

    if num_blocks <= 0 or page_bytes <= 0:
        raise InvalidArgumentError("num_blocks and page_bytes must be positive")
    nbytes = num_blocks * page_bytes
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mm = mmap.mmap(fd, nbytes)
        _populate(mm)
    except BaseException:
        os.close(fd)
        raise
    tensor = torch.frombuffer(mm, dtype=torch.int8).view(num_blocks, page_bytes)
    base_ptr = tensor.data_ptr()
    with _lock:
        _buffers[base_ptr] = _Buffer(fd, base_ptr, nbytes)
    _reap()
    weakref.finalize(tensor.untyped_storage(), _forget, base_ptr)
    return tensor


def _populate(mm: mmap.mmap) -> None:
    """Allocate every page now, on the engine's account: the daemon copies only into
    and out of memory the engine has populated (it never allocates an engine's pages)."""
    try:
        mm.madvise(MADV_POPULATE_WRITE)
    except OSError:  # before Linux 5.14: touch each page
        for offset in range(0, len(mm), mmap.PAGESIZE):
            mm[offset] = 0


def describe_cache(tensor: Any) -> tuple[CacheDesc, int]:
    """(descriptor without fd index, memfd) for a view of a ``shared_kv_cache`` tensor."""
    if getattr(tensor, "is_cuda", False):
        raise InvalidArgumentError("a worker's caches must be all CUDA or all CPU tensors")
    if tensor.dim() != 2 or tensor.stride(1) != 1:
        raise InvalidArgumentError(
            "a KV cache must be a 2-D (num_blocks, page) view with contiguous rows"
        )
    esize = tensor.element_size()
    ptr = tensor.data_ptr()
    with _lock:
        buf = next(
            (b for b in _buffers.values() if b.base_ptr <= ptr < b.base_ptr + b.nbytes), None
        )
    _reap()
    if buf is None:
        raise InvalidArgumentError(
            "this tensor is not backed by kvoffload.shared_kv_cache(); the daemon cannot map it"
        )
    desc = CacheDesc(
        kind="memfd",
        num_blocks=int(tensor.shape[0]),
        page_bytes=int(tensor.shape[1]) * esize,
        offset_bytes=ptr - buf.base_ptr,
        row_stride_bytes=int(tensor.stride(0)) * esize,
    )
    return desc, buf.fd

"""An SGLang host pool as kvoffload caches: where each page's bytes lie.

SGLang describes a page by ``get_page_buffer_meta(indices)``: one (pointer, bytes)
element per contiguous run of the page (MHA: K and V for the page-first layouts, K and
V of every layer for ``layer_first``; MLA: one), and by
``get_split_heads_page_buffer_meta`` the runs of each virtual head shard
(``page_head``). Read at three pages, the elements must be affine in the page number:
element ``e`` of page ``p`` starts at ``offset_e + p * stride_e`` inside the pool's
``kv_buffer``. Each element is then one kvoffload cache of ``page_num`` rows of
``bytes_e`` with a row stride of ``stride_e``, and a namespace slot holds one page.

Two ways to hand the caches over (``Caches``):
- ``views``: plain 2-D uint8 views of the pool (client-copy mode: the client copies
  through its own mapping of the region);
- ``descs``: descriptors into the pool's memfd (``"allocator": "shm"``), which the
  daemon copies through inside system calls only (kind ``memfd_io``): the memfd is
  not sealable, so no daemon code may touch its memory.

A pool whose pages are not affine runs inside one buffer is refused (``PoolError``).
SGLang hands out host pages whole: page ``i`` of a call starts at
``host_indices[i * page_size]``, a multiple of ``page_size``, and its slots follow in
order; ``block_ids`` checks that and gives the pages' numbers.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.protocol.messages import CacheDesc

MEMFD_IO = "memfd_io"

I64 = npt.NDArray[np.int64]


class PoolError(ValueError):
    """The host pool cannot be stored by kvoffload (said at start)."""


@dataclass(frozen=True)
class Element:
    offset_bytes: int  # of page 0 from the start of kv_buffer
    page_bytes: int
    stride_bytes: int  # from one page to the next


@dataclass(frozen=True)
class PoolShape:
    page_num: int
    page_size: int
    buffer_bytes: int
    shards: list[list[Element]]  # per namespace (virtual head shard): its elements


def _meta(pool: Any, page: int, split: int) -> tuple[list[int], list[int]]:
    import torch

    ps = pool.page_size
    idx = torch.arange(page * ps, (page + 1) * ps, dtype=torch.int64)
    if split > 1:
        ptrs, sizes = pool.get_split_heads_page_buffer_meta(idx, split)
    else:
        ptrs, sizes = pool.get_page_buffer_meta(idx)
    return [int(p) for p in ptrs], [int(s) for s in sizes]


def pool_shape(pool: Any, split: int = 1) -> PoolShape:
    """The elements of the pool's pages, per virtual head shard (``split`` of them)."""
    buffer = getattr(pool, "kv_buffer", None)
    if buffer is None or not buffer.is_contiguous():
        raise PoolError(f"{type(pool).__name__} has no contiguous kv_buffer to store from")
    base, nbytes = int(buffer.data_ptr()), int(buffer.numel() * buffer.element_size())
    pages = int(pool.page_num)
    if pages < 3:
        raise PoolError(f"the host pool has {pages} pages; kvoffload needs at least 3")
    p0, s0 = _meta(pool, 0, split)
    p1, s1 = _meta(pool, 1, split)
    pl, sl = _meta(pool, pages - 1, split)
    if not p0 or len(p0) % split or not (len(p0) == len(p1) == len(pl)) or s0 != s1 or s0 != sl:
        raise PoolError("the host pool's page elements differ from page to page")
    elements = []
    for a, b, z, size in zip(p0, p1, pl, s0):
        stride = b - a
        off = a - base
        if z != a + (pages - 1) * stride or stride < size or off < 0:
            raise PoolError("the host pool's pages are not evenly spaced runs")
        if off + (pages - 1) * stride + size > nbytes:
            raise PoolError("a host page lies outside the pool's kv_buffer")
        elements.append(Element(off, size, stride))
    # SGLang lists a split page's runs shard by shard: (K, V) of each
    per = len(elements) // split
    shards = [elements[j * per : (j + 1) * per] for j in range(split)]
    return PoolShape(pages, int(pool.page_size), nbytes, shards)


def plain_views(pool: Any, elements: list[Element], pages: int) -> list[Any]:
    """2-D uint8 views of the pool, one per element (client-copy caches)."""
    import torch

    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    return [
        torch.as_strided(flat, (pages, e.page_bytes), (e.stride_bytes, 1), e.offset_bytes)
        for e in elements
    ]


def memfd_descs(elements: list[Element], pages: int, offset_in_fd: int) -> list[CacheDesc]:
    """Descriptors of each element in the pool's memfd (the message's descriptor 0)."""
    return [
        CacheDesc(MEMFD_IO, pages, e.page_bytes, 0, offset_in_fd + e.offset_bytes, e.stride_bytes)
        for e in elements
    ]


def shm_offset(pool: Any) -> int:
    """Where the pool's kv_buffer starts in its memfd (SGLang's ``shm`` allocator maps
    the memfd from offset 0 into the tensor); PoolError when it is not the memfd's."""
    allocator = getattr(pool, "allocator", None)
    mm = getattr(allocator, "mm", None)
    if getattr(pool, "fd", None) is None or not isinstance(mm, mmap.mmap):
        raise PoolError('the host pool has no memfd (start SGLang with "allocator": "shm")')
    start = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    off = int(pool.kv_buffer.data_ptr()) - start
    size = int(pool.kv_buffer.numel() * pool.kv_buffer.element_size())
    if off < 0 or off + size > len(mm):
        raise PoolError("the host pool's kv_buffer is not inside its memfd")
    return off


def block_ids(host_indices: Any, pages: int, page_size: int) -> I64 | None:
    """Page numbers of ``pages`` whole pages; None unless every page is whole and
    page-aligned (SGLang's contract for zero-copy calls)."""
    idx = np.asarray(host_indices.cpu().numpy() if hasattr(host_indices, "cpu") else host_indices)
    if idx.size < pages * page_size:
        return None
    rows = idx[: pages * page_size].astype(np.int64).reshape(pages, page_size)
    starts = rows[:, 0]
    if np.any(starts % page_size) or not np.array_equal(
        rows - starts[:, None], np.broadcast_to(np.arange(page_size), rows.shape)
    ):
        return None
    result: I64 = starts // page_size
    return result

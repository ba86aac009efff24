"""Copy runs: the (region, cache, bytes) copies one transfer expands to, merged.

Rules:
- Pure numpy, no validation: the callers (``copyplan``) checked the transfer.
- A transfer's runs come cache by cache in the order of its caches, and runs merge
  only within one cache (both sides contiguous); every builder here agrees with
  ``_runs_by_cache``, the one-cache-at-a-time reference.
- Work is vectorized over the whole transfer where the caches allow it (plain caches;
  canonical caches whose parts have as many fragments and take the same turns): a
  loop per cache cost ~27 us (plain) to ~130 us (512-byte canonical fragments) each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvoffload.datapath.canonical import CanonicalPart, expand
from kvoffload.protocol.messages import KVLayout

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class CacheGeometry:
    """Where engine block ``b`` of one cache starts: ``offset + b * row_stride``."""

    num_blocks: int
    page_bytes: int
    offset_bytes: int
    row_stride_bytes: int

    @property
    def end_bytes(self) -> int:
        """One past the last byte of the last row."""
        return self.offset_bytes + (self.num_blocks - 1) * self.row_stride_bytes + self.page_bytes


@dataclass(frozen=True)
class Runs:
    """Merged copy runs for one cache: region offsets, cache offsets, lengths."""

    region: I64
    cache: I64
    nbytes: I64

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


@dataclass(frozen=True)
class JobRuns(Runs):
    """The merged runs of one transfer over several caches: ``which`` is the position,
    in the transfer's list of caches, of the cache each run's ``cache`` offset is in."""

    which: I64


@dataclass(frozen=True)
class Placement:
    """Where one cache's page lives in a rank's area: sub-block ``s`` of the cache's
    page starts at ``tensor_offset + s * tensor_page_bytes + part_offset``. With
    ``canon``, that is the cache's canonical page, and the worker's page scatters
    into it (canonical.py)."""

    tensor_offset: int
    tensor_page_bytes: int
    part_offset: int
    canon: CanonicalPart | None = None


def expand_positions(count: int, f: int, skip: int) -> tuple[I64, I64]:
    """(slot index, sub-block index) for each of the ``count`` engine blocks of a
    transfer that starts ``skip`` sub-blocks into its first slot."""
    sub = np.arange(skip, skip + count, dtype=np.int64)
    return sub // f, sub % f


def build_runs(
    layout: KVLayout,
    rank: int,
    slot_offsets: I64,
    block_ids: I64,
    skip: int,
    caches: list[CacheGeometry],
    placements: list[Placement],
    store_slots: I64 | None = None,
) -> JobRuns:
    """Merged copy runs of one transfer over its caches, cache by cache in order (the
    caller validated the inputs). ``rank`` picks the rank area (0 in a canonical
    namespace); a store into canonical pages passes its slot ids (``store_slots``),
    which decide whose turn each block is."""
    f = layout.block_size_factor
    slot_idx, sub_idx = expand_positions(block_ids.size, f, skip)
    base = slot_offsets[slot_idx] + rank * layout.rank_bytes
    if len(placements) > 1 and all(at.canon is None for at in placements):
        return _plain_runs(base, sub_idx, block_ids, caches, placements)
    page_ids = None if store_slots is None else store_slots[slot_idx] * f + sub_idx
    if len(placements) > 1:
        together = _canonical_runs(base, sub_idx, block_ids, page_ids, caches, placements)
        if together is not None:
            return together
    return _runs_by_cache(base, sub_idx, block_ids, page_ids, caches, placements)


def _runs_by_cache(
    base: I64,
    sub_idx: I64,
    block_ids: I64,
    page_ids: I64 | None,
    caches: list[CacheGeometry],
    placements: list[Placement],
) -> JobRuns:
    """``build_runs`` one cache at a time (any mix of plain and canonical caches)."""
    parts = []
    for at, cache in zip(placements, caches):
        region = base + at.tensor_offset + at.part_offset + sub_idx * at.tensor_page_bytes
        cache_off = cache.offset_bytes + block_ids * cache.row_stride_bytes
        if at.canon is None:
            parts.append(merge_runs(region, cache_off, cache.page_bytes))
        else:
            parts.append(merge_runs(*expand(at.canon, region, cache_off, page_ids)))
    which = np.repeat(np.arange(len(parts), dtype=np.int64), [r.region.size for r in parts])
    return JobRuns(
        np.concatenate([r.region for r in parts]),
        np.concatenate([r.cache for r in parts]),
        np.concatenate([r.nbytes for r in parts]),
        which,
    )


def _no_runs() -> JobRuns:
    empty = np.zeros(0, dtype=np.int64)
    return JobRuns(empty, empty, empty, empty)


def _page_grid(
    base: I64,
    sub_idx: I64,
    block_ids: I64,
    caches: list[CacheGeometry],
    placements: list[Placement],
) -> tuple[I64, I64]:
    """Where each block's page of each cache lies, in the region and in the cache:
    two (caches, blocks) arrays, a row of constants per cache broadcast against the
    blocks."""
    rows = [
        (
            at.tensor_offset + at.part_offset,
            at.tensor_page_bytes,
            c.offset_bytes,
            c.row_stride_bytes,
        )
        for at, c in zip(placements, caches)
    ]
    offset, tensor_page, cache_offset, stride = np.array(rows, dtype=np.int64).T[:, :, None]
    return base + offset + sub_idx * tensor_page, cache_offset + block_ids * stride


def _plain_runs(
    base: I64,
    sub_idx: I64,
    block_ids: I64,
    caches: list[CacheGeometry],
    placements: list[Placement],
) -> JobRuns:
    """``build_runs`` for caches without canonical mappings, all at once: one row of
    page copies per cache (a model has one cache per layer: a loop per cache cost
    ~27 us each), merged within rows, never across."""
    count = block_ids.size
    if count == 0 or not caches:
        return _no_runs()
    region, cache = _page_grid(base, sub_idx, block_ids, caches, placements)
    page = np.array([c.page_bytes for c in caches], dtype=np.int64)[:, None]
    goes_on = (region[:, 1:] - region[:, :-1] == page) & (cache[:, 1:] - cache[:, :-1] == page)
    if not goes_on.any():  # nothing merges (scattered blocks, or slots wider than pages)
        which = np.repeat(np.arange(len(caches), dtype=np.int64), count)
        return JobRuns(region.ravel(), cache.ravel(), page.ravel()[which], which)
    starts_here = np.ones(region.shape, dtype=bool)
    starts_here[:, 1:] = ~goes_on
    starts = np.flatnonzero(starts_here)
    ends = np.append(starts[1:], region.size)
    which = starts // count
    return JobRuns(
        region.ravel()[starts], cache.ravel()[starts], (ends - starts) * page.ravel()[which], which
    )


def _canonical_runs(
    base: I64,
    sub_idx: I64,
    block_ids: I64,
    page_ids: I64 | None,
    caches: list[CacheGeometry],
    placements: list[Placement],
) -> JobRuns | None:
    """``build_runs`` for canonical caches whose parts have as many fragments each and
    take the same turns, all caches at once: a (cache, block, fragment) array, merged
    within each cache's row (a loop per cache cost ~130 us each for a TP 2 engine's
    512-byte fragments). None where the parts differ so (the loop handles them)."""
    parts = [at.canon for at in placements]
    first = parts[0]
    if first is None:
        return None
    turn = (first.frags.shape, first.writers, first.writer)
    if any(p is None or (p.frags.shape, p.writers, p.writer) != turn for p in parts):
        return None
    if page_ids is not None and first.writers > 1:
        keep = page_ids % first.writers == first.writer
        base, sub_idx, block_ids = base[keep], sub_idx[keep], block_ids[keep]
    frags = np.stack([p.frags for p in parts if p is not None])  # (caches, frags, 3)
    c, b, n = len(caches), int(block_ids.size), frags.shape[1]
    if b * n == 0:
        return _no_runs()
    region_page, cache_page = _page_grid(base, sub_idx, block_ids, caches, placements)
    # flat, cache by cache, block by block, fragment by fragment (as the loop orders them)
    region = (region_page[:, :, None] + frags[:, None, :, 1]).ravel()
    cache = (cache_page[:, :, None] + frags[:, None, :, 0]).ravel()
    size = np.broadcast_to(frags[:, None, :, 2], (c, b, n)).ravel()
    row = b * n
    goes_on = (region[:-1] + size[:-1] == region[1:]) & (cache[:-1] + size[:-1] == cache[1:])
    goes_on[row - 1 :: row] = False  # never merged across caches
    if not goes_on.any():  # fragments apart in the canonical page: nothing merges
        return JobRuns(region, cache, size, np.repeat(np.arange(c, dtype=np.int64), row))
    starts = np.flatnonzero(np.concatenate(([True], ~goes_on)))
    return JobRuns(region[starts], cache[starts], np.add.reduceat(size, starts), starts // row)


def split_at_boundaries(
    region: I64, other: I64, nbytes: I64, boundary_bytes: int
) -> tuple[I64, I64, I64]:
    """Cut runs so that none crosses a multiple of ``boundary_bytes`` in the region.

    ``region`` holds offsets from the region's start. GPU copies need it: a batched
    copy may not span two host registrations (pinning chunks).
    """
    if region.size == 0:
        return region, other, nbytes
    first = region // boundary_bytes
    pieces = (region + nbytes - 1) // boundary_bytes - first + 1
    if int(pieces.max()) == 1:
        return region, other, nbytes
    idx = np.repeat(np.arange(region.size), pieces)
    k = np.arange(idx.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    start = np.maximum(region[idx], (first[idx] + k) * boundary_bytes)
    end = np.minimum(region[idx] + nbytes[idx], (first[idx] + k + 1) * boundary_bytes)
    shift = start - region[idx]
    return start, other[idx] + shift, end - start


def merge_runs(region: I64, cache: I64, nbytes: int | I64) -> Runs:
    """Merge consecutive copies (all ``nbytes`` long, or each its own) whose region
    and cache offsets both continue."""
    if region.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Runs(empty, empty, empty)
    if isinstance(nbytes, int):
        if region.size == 1:
            return Runs(region, cache, np.full(1, nbytes, dtype=np.int64))
        cont = (np.diff(region) == nbytes) & (np.diff(cache) == nbytes)
        starts = np.flatnonzero(np.concatenate(([True], ~cont)))
        ends = np.concatenate((starts[1:], [region.size]))
        return Runs(region[starts], cache[starts], (ends - starts) * nbytes)
    size = nbytes[:-1]
    cont = (region[:-1] + size == region[1:]) & (cache[:-1] + size == cache[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return Runs(region[starts], cache[starts], np.add.reduceat(nbytes, starts))

"""Copy descriptors: which bytes of which engine cache go to which bytes of the region.

Slot layout (one offloaded block), for world size W, block size factor f and
canonical tensors with engine-block page sizes p_0..p_{T-1}::

    slot: | rank 0 | rank 1 | ... | rank W-1 |            rank area = f * sum(p)
    rank: | tensor 0: f pages of p_0 | tensor 1: f pages of p_1 | ...

A worker may register one cache per layout tensor, or several caches that tile one
tensor's page in order (``place_caches``): a vLLM worker whose canonical tensors are
only known on the worker side opens the namespace with one page per rank,
``sum(p)``, and registers its tensors as parts of it. Every engine of a namespace
registers the same tensors, so the bytes mean the same to all of them.

Engine block ids map to sub-blocks in order, as vLLM's ``expand_block_ids``: slot i
holds sub-blocks ``i*f .. i*f+f-1``. A load may start inside the first slot by skipping
its first ``skip`` sub-blocks (``0 <= skip < f``); stores are always aligned. The last
slot may be partly filled (a request's tail shorter than f engine blocks): the ids
then cover fewer than ``num_slots * f - skip`` sub-blocks, but touch every slot.

Descriptors are built with numpy, adjacent runs are merged (both sides contiguous),
and the copier (CPU threads here, CUDA streams elsewhere) executes them. A validated
transfer is a ``JobPlan``: the copier builds its runs, a piece of whole slots at a
time (``JobPlan.pieces``), so no transfer costs the loop, or memory, in proportion to
the copies it expands to. CPU copiers take them as strided groups
(``JobPlan.groups``): a transfer whose slots and engine blocks both step evenly (one
allocation's slots, a request's blocks) is one group per cache, known without
building its runs. Everything here is pure: it is unit-tested without a daemon.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from kvoffload.datapath.canonical import CanonicalPart
from kvoffload.datapath.memruns import Groups, runs_as_groups
from kvoffload.datapath.runs import CacheGeometry, JobRuns, Placement, build_runs
from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.messages import KVLayout

I64 = npt.NDArray[np.int64]
SMALL_IDS = 128  # at most this many ids are checked as a list: numpy's setup costs more


def place_caches(
    layout: KVLayout, cache_page_bytes: list[int], canon: Sequence[CanonicalPart] = ()
) -> list[Placement]:
    """Placement of each cache, in order; InvalidArgumentError unless the caches'
    pages (their canonical pages, with ``canon``) tile the layout's tensor pages
    exactly (one or more caches per tensor)."""
    if canon:
        if len(canon) != len(cache_page_bytes):
            raise InvalidArgumentError(
                f"{len(canon)} canonical mappings for {len(cache_page_bytes)} caches"
            )
        placed = place_caches(layout, [c.canonical_page_bytes for c in canon])
        return [replace(at, canon=c) for at, c in zip(placed, canon)]
    f = layout.block_size_factor
    out: list[Placement] = []
    pages = iter(cache_page_bytes)
    tensor_offset = 0
    for t, p in enumerate(layout.tensor_page_bytes):
        part = 0
        while part < p:
            c = next(pages, None)
            if c is None or c <= 0 or part + c > p:
                raise InvalidArgumentError(
                    f"cache pages {cache_page_bytes} do not tile the namespace layout's "
                    f"tensor pages {layout.tensor_page_bytes} (at tensor {t})"
                )
            out.append(Placement(tensor_offset, p, part))
            part += c
        tensor_offset += p * f
    if len(out) != len(cache_page_bytes):
        raise InvalidArgumentError(
            f"{len(cache_page_bytes)} caches registered, but pages {cache_page_bytes[: len(out)]} "
            f"already fill the namespace layout {layout.tensor_page_bytes}"
        )
    return out


def check_transfer(
    layout: KVLayout, num_slots: int, block_ids: I64, skip: int, caches: list[CacheGeometry]
) -> None:
    """Validate sizes and engine block ids (invariant 4); InvalidArgumentError if wrong."""
    f = layout.block_size_factor
    if not 0 <= skip < f:
        raise InvalidArgumentError(f"skip {skip} is not in 0..{f - 1}")
    most = num_slots * f - skip
    least = max(most - f + 1, 0) if num_slots else 0
    if not least <= block_ids.size <= most:
        raise InvalidArgumentError(
            f"{num_slots} slots with block_size_factor {f} and skip {skip} need "
            f"{least}..{most} engine block ids, got {block_ids.size}"
        )
    if block_ids.size:
        limit = min(c.num_blocks for c in caches)
        if block_ids.size <= SMALL_IDS:  # numpy's reductions cost more on a step's few ids
            listed = block_ids.tolist()
            lo, hi = min(listed), max(listed)
        else:
            lo, hi = int(block_ids.min()), int(block_ids.max())
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise InvalidArgumentError(
                f"engine block id {bad} is outside the registered caches (0..{limit - 1})"
            )


def check_whole_store(
    layout: KVLayout, num_caches: int, chosen: int, num_slots: int, num_ids: int
) -> None:
    """InvalidArgumentError unless a store writes each of its slots whole: every
    registered cache (they tile the rank's area) and every engine block of every slot.
    A store that wrote part of a slot would make the rest of it, bytes of an earlier
    block, visible under its key."""
    f = layout.block_size_factor
    if chosen != num_caches or num_ids != num_slots * f:
        raise InvalidArgumentError(
            f"a store writes each of its slots whole: all {num_caches} registered caches "
            f"and {f} engine block(s) per slot ({num_slots * f} block ids for {num_slots} "
            f"slots); this one names {chosen} caches and {num_ids} block ids"
        )


def has_duplicates(ids: I64) -> bool:
    """Whether any id occurs twice (a sort, not a Python set, past ``SMALL_IDS``; one
    pass when the ids ascend, as one allocation's slots do)."""
    if ids.size <= SMALL_IDS:
        return len(set(ids.tolist())) != ids.size
    if bool((ids[1:] > ids[:-1]).all()):
        return False
    ordered = np.sort(ids)
    return bool((ordered[1:] == ordered[:-1]).any())


@dataclass(frozen=True)
class JobPlan:
    """A validated transfer, its runs not built yet: ``addresses`` builds them all,
    ``pieces`` a piece of whole slots at a time. Addresses are absolute: the region's
    mapping at ``region_base``, each chosen cache at ``cache_bases[i]``."""

    layout: KVLayout
    rank: int
    slot_offsets: I64
    block_ids: I64
    skip: int
    caches: list[CacheGeometry]
    placements: list[Placement]
    store_slots: I64 | None  # a store's slot ids (canonical turns), None for a load
    region_base: int
    cache_bases: I64
    copies_per_block: int = field(init=False)
    block_bytes: int = field(init=False)  # one engine block's pages in the chosen caches

    def __post_init__(self) -> None:
        per = sum(1 if p.canon is None else len(p.canon.frags) for p in self.placements)
        object.__setattr__(self, "copies_per_block", per)
        object.__setattr__(self, "block_bytes", sum(c.page_bytes for c in self.caches))

    @property
    def is_store(self) -> bool:
        return self.store_slots is not None

    @property
    def copies(self) -> int:
        """Copies the transfer expands to before merging (what planning costs)."""
        return int(self.block_ids.size) * self.copies_per_block

    @property
    def most_bytes(self) -> int:
        """Bytes the transfer copies at most (a canonical store copies its turns only)."""
        return int(self.block_ids.size) * self.block_bytes

    def runs(self, first: int = 0, end: int | None = None) -> JobRuns:
        """Merged runs of the slots ``first .. end`` (all by default)."""
        f, n = self.layout.block_size_factor, int(self.block_ids.size)
        end = self.slot_offsets.size if end is None else end
        a, b = max(first * f - self.skip, 0), min(end * f - self.skip, n)
        store = self.store_slots
        return build_runs(
            self.layout,
            self.rank,
            self.slot_offsets[first:end],
            self.block_ids[a:b],
            self.skip if first == 0 else 0,
            self.caches,
            self.placements,
            None if store is None else store[first:end],
        )

    def addresses(self, first: int = 0, end: int | None = None) -> tuple[I64, I64, I64]:
        """(dst, src, nbytes) of the slots ``first .. end``, by direction."""
        runs = self.runs(first, end)
        region = runs.region + self.region_base
        cache = runs.cache + self.cache_bases[runs.which]
        return (region, cache, runs.nbytes) if self.is_store else (cache, region, runs.nbytes)

    def pieces(self, max_copies: int) -> Iterator[tuple[I64, I64, I64]]:
        """``addresses`` a piece at a time: whole slots, at most ``max_copies`` copies
        each (at least one slot)."""
        for first, end in self.piece_bounds(0, self.slot_offsets.size, max_copies):
            yield self.addresses(first, end)

    def piece_bounds(self, first: int, end: int, max_copies: int) -> Iterator[tuple[int, int]]:
        """Slots ``first .. end`` in pieces of whole slots, at most ``max_copies``
        copies each (at least one slot)."""
        per_slot = max(1, self.layout.block_size_factor * self.copies_per_block)
        step = max(1, max_copies // per_slot)
        for a in range(first, end, step):
            yield a, min(a + step, end)

    def groups(self, first: int = 0, end: int | None = None) -> Groups:
        """The copies of slots ``first .. end`` as strided groups, by direction."""
        even = self._even_groups(first, self.slot_offsets.size if end is None else end)
        return even if even is not None else runs_as_groups(*self.addresses(first, end))

    def _even_groups(self, first: int, end: int) -> Groups | None:
        """One group per cache, if the slots and the engine blocks both step evenly
        (block_size_factor 1, no canonical pages; a cache whose pages continue each
        other on both sides is one run); None otherwise."""
        if self.layout.block_size_factor != 1 or any(p.canon for p in self.placements):
            return None
        slots, ids = self.slot_offsets[first:end], self.block_ids[first:end]
        if ids.size == 0 or not self.caches or not (_even(slots) and _even(ids)):
            return None
        rows = int(ids.size)
        slot_step = int(slots[1] - slots[0]) if rows > 1 else 0
        id_step = int(ids[1] - ids[0]) if rows > 1 else 0
        if rows > 1 and id_step == 0:
            return None  # one engine block named twice: left to the runs
        region0 = self.region_base + int(slots[0]) + self.rank * self.layout.rank_bytes
        rows_of = []  # (region, cache, bytes, rows, region step, cache step) per cache
        for at, cache, base in zip(self.placements, self.caches, self.cache_bases.tolist()):
            region = region0 + at.tensor_offset + at.part_offset
            mine = base + cache.offset_bytes + int(ids[0]) * cache.row_stride_bytes
            mine_step, n = id_step * cache.row_stride_bytes, cache.page_bytes
            if slot_step == n and mine_step == n:  # contiguous on both sides: one run
                rows_of.append((region, mine, n * rows, 1, 0, 0))
            else:
                rows_of.append((region, mine, n, rows, slot_step, mine_step))
        region_at, cache_at, nbytes, count, region_steps, cache_steps = map(list, zip(*rows_of))
        if self.is_store:
            return Groups(region_at, cache_at, nbytes, count, region_steps, cache_steps)
        return Groups(cache_at, region_at, nbytes, count, cache_steps, region_steps)


def _even(values: I64) -> bool:
    """Whether the values step by one amount (two or fewer always do)."""
    if values.size <= 2:
        return True
    steps = np.diff(values)
    return bool((steps == steps[0]).all())


def select_caches(count: int, wanted: list[int]) -> list[int]:
    """The cache indices one transfer copies (empty: all); InvalidArgumentError if bad."""
    if not wanted:
        return list(range(count))
    if len(set(wanted)) != len(wanted) or not all(0 <= i < count for i in wanted):
        raise InvalidArgumentError(f"cache indices {wanted} must be distinct and in 0..{count - 1}")
    return wanted

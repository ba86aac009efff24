"""Extents: the region's data area cut into equal extents, each owned by one namespace
or free (``ExtentPool``); ``slots.py`` cuts a namespace's extents into slots.

Memory is split like memcached's slab allocator:

    region data area
    +----------+----------+----------+----------+-----
    | extent 0 | extent 1 | extent 2 | extent 3 | ...     equal-size extents
    +----------+----------+----------+----------+-----
      ns A       ns B       free       ns A             one owner each, or free

Rules:
- A new extent is a ready one (populated, and pinned while a pinner runs) before one
  that is not, one of the namespace's NUMA part when its GPUs share a node, the lowest
  index among equals (``ExtentPool.take``; placement.py says what is ready where).
- A free list per NUMA part, lowest index last (taken first); an extent given back is
  put in its place, not the list sorted again (a namespace drop gives thousands back).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Protocol

# (extent, owner or None, slot_bytes, index of the extent among its owner's extents)
ExtentListener = Callable[[int, "int | None", int, int], None]


class ExtentPlacement(Protocol):
    """Where each extent lies and whether it is ready (placement.py implements it)."""

    num_parts: int
    part_of_extent: list[int]

    @property
    def all_ready(self) -> bool: ...
    def is_ready(self, ext: int) -> bool: ...
    def preferred_part(self, owner: int) -> int | None: ...


class _OnePart:
    """No placement: one part, every extent ready."""

    num_parts = 1
    all_ready = True

    def __init__(self, num_extents: int) -> None:
        self.part_of_extent = [0] * num_extents

    def is_ready(self, ext: int) -> bool:
        return True

    def preferred_part(self, owner: int) -> int | None:
        return None


READY_SCAN = 64  # free extents looked at per part for a ready one (they come ready in order)


class ExtentPool:
    """The region's extents: which are free, which namespace owns each.

    Free extents are kept per part (NUMA node), lowest index first. ``take`` hands out
    a ready extent before one still being populated or pinned, one of the owner's
    preferred part before another's (a miss counts in ``fallback_extents_total``), and
    spreads an owner without a preference over the parts by their sizes."""

    def __init__(
        self,
        num_extents: int,
        extent_bytes: int,
        data_offset: int = 0,
        on_change: ExtentListener | None = None,
        owners: list[int | None] | None = None,
        placement: ExtentPlacement | None = None,
    ) -> None:
        if num_extents <= 0 or extent_bytes <= 0:
            raise ValueError("an extent pool needs at least one extent of positive size")
        self.num_extents = num_extents
        self.extent_bytes = extent_bytes
        self.data_offset = data_offset
        self.owner: list[int | None] = list(owners) if owners else [None] * num_extents
        self.placement: ExtentPlacement = placement or _OnePart(num_extents)
        part_of = self.placement.part_of_extent
        parts = self.placement.num_parts
        # Lowest index last (popped first), so a fresh region fills from its start.
        self._free: list[list[int]] = [[] for _ in range(parts)]
        for e in range(num_extents - 1, -1, -1):
            if self.owner[e] is None:
                self._free[part_of[e]].append(e)
        self._num_free = sum(len(f) for f in self._free)
        self._weights = [part_of.count(p) for p in range(parts)]
        self._credit = [0] * parts  # smooth weighted round robin over parts
        self._on_change = on_change
        self.fallback_extents_total = 0
        self.unready_extents_total = 0

    @property
    def num_free(self) -> int:
        return self._num_free

    def free_in_part(self, part: int) -> int:
        return len(self._free[part])

    def take(self, owner: int, slot_bytes: int, chunk: int) -> int | None:
        if not self._num_free:
            return None
        ext = self._choose(owner)
        self._num_free -= 1
        self.owner[ext] = owner
        if self._on_change is not None:
            self._on_change(ext, owner, slot_bytes, chunk)
        return ext

    def _order(self, owner: int) -> list[int]:
        """Parts in the order ``owner`` should take from."""
        parts = len(self._free)
        if parts == 1:
            return [0]
        want = self.placement.preferred_part(owner)
        if want is None:  # interleave: the part furthest behind its share goes first
            credit, total = self._credit, sum(self._weights)
            for i, w in enumerate(self._weights):
                credit[i] += w
            want = max(range(parts), key=lambda i: credit[i] if self._free[i] else -total)
            credit[want] -= total
            return [want, *(p for p in range(parts) if p != want)]
        return [want, *(p for p in range(parts) if p != want)]

    def _choose(self, owner: int) -> int:
        order = self._order(owner)
        pl = self.placement
        pick: tuple[int, int] | None = None  # (part, position in its free list)
        if pl.all_ready:
            pick = next((p, len(self._free[p]) - 1) for p in order if self._free[p])
        else:
            for p in order:
                free = self._free[p]
                for i in range(len(free) - 1, max(-1, len(free) - 1 - READY_SCAN), -1):
                    if pl.is_ready(free[i]):
                        pick = (p, i)
                        break
                if pick is not None:
                    break
            if pick is None:
                self.unready_extents_total += 1
                pick = next((p, len(self._free[p]) - 1) for p in order if self._free[p])
        part, i = pick
        if part != order[0] and pl.preferred_part(owner) is not None:
            self.fallback_extents_total += 1
        return self._free[part].pop(i)

    def give_back(self, ext: int) -> None:
        if self.owner[ext] is None:
            raise AssertionError(f"extent {ext} freed twice")
        self.owner[ext] = None
        free = self._free[self.placement.part_of_extent[ext]]
        bisect.insort(free, ext, key=_descending)  # lowest last: taken first
        self._num_free += 1
        if self._on_change is not None:
            self._on_change(ext, None, 0, 0)


def _descending(ext: int) -> int:
    return -ext

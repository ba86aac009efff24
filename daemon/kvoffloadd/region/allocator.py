"""Slot allocation: the region is cut into extents, extents into per-namespace slots.

Memory is split like memcached's slab allocator:

    region data area
    +----------+----------+----------+----------+-----
    | extent 0 | extent 1 | extent 2 | extent 3 | ...     equal-size extents
    +----------+----------+----------+----------+-----
      ns A       ns B       free       ns A             one owner each, or free

A namespace owns whole extents and cuts each into slots of its own ``slot_bytes``
(``extent_bytes // slot_bytes`` slots per extent, the tail unused). Slot ids are local
to the namespace: slot ``s`` lives in the extent of the namespace's chunk
``s // slots_per_extent``, at ``(s % slots_per_extent) * slot_bytes``.

Rules:
- Allocation order (vLLM's CPU manager): fresh ids of the extents already owned first,
  then the most recently freed ids (LIFO), then a new extent from the shared pool; the
  ids of one allocation are handed out ascending. Blocks stored together are evicted
  together, so the most recent frees are mostly whole runs: sorted, one store's slots
  are contiguous where the free list allows and the copy planner merges them.
- A new extent is a ready one (populated, and pinned while a pinner runs) before one
  that is not, one of the namespace's NUMA part when its GPUs share a node, the lowest
  index among equals (``ExtentPool.take``; placement.py says what is ready where).
- ``num_free`` counts what allocation could hand out now, shared pool included.
- A freed slot whose copy is still running (``busy``) is not reusable until the copy
  drains; it is parked in ``deferred`` (invariant 3: no two copies share a slot).
  Store copies are counted apart as well (``is_storing``): a block becomes visible
  only once no copy into its slot is running.
- Any unused extent can go back to the pool (``release_chunk``), wherever it is:
  its chunk becomes a hole, whose ids are never handed out until an extent fills it
  again (the lowest hole first); ids of other chunks never change. So the index can
  move memory to another namespace from whichever extent holds nothing pinned, busy,
  leased or being written, not only from its top one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

_N = TypeVar("_N", bound=np.generic)

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
        free.append(ext)
        free.sort(reverse=True)
        self._num_free += 1
        if self._on_change is not None:
            self._on_change(ext, None, 0, 0)


class SlotPool:
    """One namespace's slots over the extents it owns."""

    def __init__(self, pool: ExtentPool, owner: int, slot_bytes: int) -> None:
        if slot_bytes <= 0 or slot_bytes > pool.extent_bytes:
            raise ValueError(
                f"slot of {slot_bytes} bytes does not fit an extent of {pool.extent_bytes} bytes"
            )
        self.pool = pool
        self.owner = owner
        self.slot_bytes = slot_bytes
        self.slots_per_extent = pool.extent_bytes // slot_bytes
        self.extents: list[int | None] = []  # by chunk; None: a hole
        self._fresh = 0  # ids below this have been handed out at least once (or freed)
        self._free: list[int] = []
        self._used_per_extent: list[int] = []
        self._num_used = 0  # sum(_used_per_extent), kept as it changes
        self._num_extents = 0  # owned chunks (holes not counted), set by _extents_changed
        self._capacity = 0  # len(extents) * slots_per_extent, set by _extents_changed
        self._busy: npt.NDArray[np.int32] = np.zeros(0, dtype=np.int32)  # copies per slot
        self._storing: npt.NDArray[np.int32] = np.zeros(0, dtype=np.int32)  # store copies
        self.deferred: set[int] = set()
        self._extent_array: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self._has_holes = False

    @property
    def capacity(self) -> int:
        """Slot ids in use by the chunk list (holes included)."""
        return self._capacity

    @property
    def num_extents(self) -> int:
        """Extents the namespace owns (holes not counted)."""
        return self._num_extents

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_free(self) -> int:
        own = self._capacity - self._fresh + len(self._free)
        return own + self.pool._num_free * self.slots_per_extent

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` slot ids; the caller checked ``num_free`` first."""
        if n > self.num_free:
            raise AssertionError(f"allocate({n}) with only {self.num_free} free")
        out: list[int] = []
        while len(out) < n:
            if self._fresh < self.capacity:
                take = min(n - len(out), self.capacity - self._fresh)
                out.extend(range(self._fresh, self._fresh + take))
                self._fresh += take
            elif self._free:
                take = min(n - len(out), len(self._free))
                out.extend(self._free[-take:])
                del self._free[-take:]
            else:
                self._grow()
        out.sort()
        used, spe = self._used_per_extent, self.slots_per_extent
        for slot in out:
            used[slot // spe] += 1
        self._num_used += n
        return out

    def free(self, slot: int) -> None:
        self.free_many((slot,))

    def free_many(self, slots: Sequence[int]) -> None:
        """``free`` for each of ``slots``, in order (one read of the copy counts)."""
        used, spe, free, busy = self._used_per_extent, self.slots_per_extent, self._free, self._busy
        freed = len(free)
        for slot in slots:
            if busy[slot] > 0:
                self.deferred.add(slot)
            else:
                used[slot // spe] -= 1
                free.append(slot)
        self._num_used -= len(free) - freed

    def _release(self, slot: int) -> None:
        self._used_per_extent[slot // self.slots_per_extent] -= 1
        self._num_used -= 1
        self._free.append(slot)

    def is_busy(self, slot: int) -> bool:
        return bool(self._busy[slot]) if 0 <= slot < self._busy.size else False

    def any_busy(self) -> bool:
        """Whether any copy touches one of these slots."""
        return bool(self._busy.any())

    def is_storing(self, slot: int) -> bool:
        """Whether a store copy into ``slot`` is running."""
        return bool(self._storing[slot]) if 0 <= slot < self._storing.size else False

    def mark_busy(self, slots: npt.NDArray[np.int64], store: bool = False) -> None:
        """A copy starts on ``slots`` (distinct, valid: the submit checked)."""
        self._busy[slots] += 1
        if store:
            self._storing[slots] += 1

    def unmark_busy(self, slots: npt.NDArray[np.int64], store: bool = False) -> None:
        busy = self._busy
        busy[slots] -= 1
        if store:
            self._storing[slots] -= 1
        if self.deferred:
            idle = slots[busy[slots] == 0].tolist()
            for s in self.deferred.intersection(idle):
                self.deferred.discard(s)
                self._release(s)

    def _grow(self) -> None:
        """One more extent: into the lowest hole, else at the top (fresh ids). Only its
        own entries change: the per-chunk and per-slot arrays grow by doubling (entries
        past the chunk list are -1 and 0), so filling a namespace of many extents costs
        no rebuild per extent."""
        hole = self.extents.index(None) if self._has_holes else len(self.extents)
        ext = self.pool.take(self.owner, self.slot_bytes, hole)
        if ext is None:
            raise AssertionError("extent pool exhausted during allocate")
        spe = self.slots_per_extent
        if hole == len(self.extents):
            self.extents.append(ext)
            self._used_per_extent.append(0)
            self._capacity += spe
        else:  # every id above ``_fresh`` is fresh: a hole's ids go on the free list
            self.extents[hole] = ext
            self._free.extend(range((hole + 1) * spe - 1, hole * spe - 1, -1))
        self._num_extents += 1
        self._has_holes = self._num_extents < len(self.extents)
        self._extent_array = _with_room(self._extent_array, len(self.extents), -1)
        self._extent_array[hole] = ext
        self._busy = _with_room(self._busy, self._capacity, 0)
        self._storing = _with_room(self._storing, self._capacity, 0)

    def _extents_changed(self) -> None:
        self._extent_array = np.asarray(
            [-1 if e is None else e for e in self.extents], dtype=np.int64
        )
        self._num_extents = len(self.extents) - self.extents.count(None)
        self._capacity = len(self.extents) * self.slots_per_extent
        self._has_holes = self._num_extents < len(self.extents)
        self._busy = _resized(self._busy, self.capacity)
        self._storing = _resized(self._storing, self.capacity)

    def adopt(self, extents: Sequence[int | None], used: set[int]) -> None:
        """Take over extents a previous daemon gave this namespace, by chunk (None:
        a hole; warm restart). ``used`` lies in owned chunks."""
        self.extents = list(extents)
        spe = self.slots_per_extent
        self._capacity = len(self.extents) * spe  # before _extents_changed: used below
        self._used_per_extent = [0] * len(extents)
        for slot in used:
            self._used_per_extent[slot // spe] += 1
        self._num_used = len(used)
        self._fresh = self.capacity
        self._free = [
            s
            for s in range(self.capacity - 1, -1, -1)
            if s not in used and self.extents[s // spe] is not None
        ]
        self._trim_holes()
        self._extents_changed()

    def chunk_slots(self, chunk: int) -> range:
        """Slot ids of one chunk."""
        return range(chunk * self.slots_per_extent, (chunk + 1) * self.slots_per_extent)

    def owned_chunks(self) -> list[int]:
        """Chunks that hold an extent, top first."""
        return [c for c in range(len(self.extents) - 1, -1, -1) if self.extents[c] is not None]

    def release_chunk(self, chunk: int) -> bool:
        """Give an unused chunk's extent back to the pool; False if a slot is in use."""
        if self.extents[chunk] is None or self._used_per_extent[chunk]:
            return False
        spe = self.slots_per_extent
        if self._fresh < self.capacity:  # from now on, every id is fresh no more
            self._free.extend(range(self.capacity - 1, self._fresh - 1, -1))
            self._fresh = self.capacity
        start, end = chunk * spe, (chunk + 1) * spe
        self._free = [s for s in self._free if not start <= s < end]
        ext = self.extents[chunk]
        assert ext is not None
        self.extents[chunk] = None
        self.pool.give_back(ext)
        self._trim_holes()
        self._extents_changed()
        return True

    def release_free_tail(self) -> int:
        """Give every completely unused top extent back to the pool; returns how many."""
        released = 0
        while self.extents and self._used_per_extent[-1] == 0:
            start = (len(self.extents) - 1) * self.slots_per_extent
            self._free = [s for s in self._free if s < start]
            self._fresh = min(self._fresh, start)
            ext = self.extents.pop()
            self._used_per_extent.pop()
            if ext is not None:
                self.pool.give_back(ext)
                released += 1
        if released:
            self._extents_changed()
        return released

    def _trim_holes(self) -> None:
        """Holes at the top are no chunk at all."""
        while self.extents and self.extents[-1] is None:
            start = (len(self.extents) - 1) * self.slots_per_extent
            self.extents.pop()
            self._used_per_extent.pop()
            self._fresh = min(self._fresh, start)
            self._free = [s for s in self._free if s < start]

    def region_offsets(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Byte offset in the region of each slot."""
        spe = self.slots_per_extent
        ext = self._extent_array[slots // spe]
        return (
            self.pool.data_offset + ext * self.pool.extent_bytes + (slots % spe) * self.slot_bytes
        )

    def is_valid(self, slots: npt.NDArray[np.int64]) -> bool:
        """Whether every slot id lies in an owned chunk."""
        if slots.size == 0:
            return True
        if slots.size <= 64:  # numpy's reductions cost more than this on small arrays
            values = slots.tolist()
            ok = bool(min(values) >= 0 and max(values) < self.capacity)
        else:
            ok = bool(slots.min() >= 0 and slots.max() < self.capacity)
        if ok and self._has_holes:
            return bool((self._extent_array[slots // self.slots_per_extent] >= 0).all())
        return ok


def _with_room(a: npt.NDArray[_N], size: int, fill: int) -> npt.NDArray[_N]:
    """``a`` if it has ``size`` entries, else a copy at least twice as large, its new
    entries ``fill``."""
    if a.size >= size:
        return a
    out = np.full(max(size, 2 * a.size), fill, dtype=a.dtype)
    out[: a.size] = a
    return out


def _resized(counts: npt.NDArray[np.int32], size: int) -> npt.NDArray[np.int32]:
    out = np.zeros(size, dtype=np.int32)
    keep = min(size, counts.size)
    out[:keep] = counts[:keep]
    return out


class SlotJournal:
    """Receives every slot state change (the region's slot table implements it)."""

    def leased(self, slot: int, lease: int) -> None: ...
    def writing(self, slot: int, key: bytes, lease: int = 0) -> None: ...
    def ready(self, slot: int, key: bytes) -> None: ...
    def buried(self, slot: int) -> None: ...
    def freed(self, slot: int) -> None: ...

    def writing_many(self, slots: Sequence[int], keys: Sequence[bytes], lease: int = 0) -> None:
        for slot, key in zip(slots, keys):
            self.writing(slot, key, lease)

    def freed_many(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.freed(slot)

    def leased_many(self, slots: Sequence[int], lease: int) -> None:
        for slot in slots:
            self.leased(slot, lease)

    def ready_many(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        for slot, key in zip(slots, keys):
            self.ready(slot, key)

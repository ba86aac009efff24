"""Slots: one namespace's slots over the extents it owns (``SlotPool``), and what a
slot's state changes are reported to (``SlotJournal``; the region's slot table).

A namespace cuts each of its extents into slots of its own ``slot_bytes``
(``extent_bytes // slot_bytes`` slots per extent, the tail unused). Slot ids are local
to the namespace: slot ``s`` lives in the extent of the namespace's chunk
``s // slots_per_extent``, at ``(s % slots_per_extent) * slot_bytes``.

Rules:
- Allocation order (vLLM's CPU manager): fresh ids of the extents already owned first,
  then the most recently freed ids (LIFO), then a new extent from the shared pool; the
  ids of one allocation are handed out ascending. Blocks stored together are evicted
  together, so the most recent frees are mostly whole runs: sorted, one store's slots
  are contiguous where the free list allows and the copy planner merges them.
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
- No call costs the namespace's size: counts are kept as they change, per-chunk and
  per-slot arrays grow by doubling, and a released chunk's free ids stay listed as
  counted tombstones (compacted once they are half the list). Growing, releasing and
  leasing on a node-sized region cost what they change.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from kvoffloadd.region.allocator import ExtentPool

_N = TypeVar("_N", bound=np.generic)

# At most this many slots are handled as a list: numpy's per-call setup costs more than
# the work on a job's or a step's few.
FEW_SLOTS = 64


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
        # Ids of released chunks stay in ``_free`` as counted tombstones, skipped when
        # popped and dropped when they outnumber the rest: releasing a chunk costs its
        # own ids, not a pass over every free slot of the namespace.
        self._stale: dict[int, int] = {}
        self._num_stale = 0
        self._used_per_extent: list[int] = []
        self._num_used = 0  # sum(_used_per_extent), kept as it changes
        self._num_extents = 0  # owned chunks (holes not counted), kept as chunks change
        self._capacity = 0  # len(extents) * slots_per_extent, kept as chunks change
        self._busy: npt.NDArray[np.int32] = np.zeros(0, dtype=np.int32)  # copies per slot
        self._copies = 0  # the sum of _busy: no slot is busy while it is 0
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
        own = self._capacity - self._fresh + len(self._free) - self._num_stale
        return own + self.pool.num_free * self.slots_per_extent

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
            elif not self._num_stale and self._free:
                take = min(n - len(out), len(self._free))
                out.extend(self._free[-take:])
                del self._free[-take:]
            elif len(self._free) > self._num_stale:
                self._pop_live(n - len(out), out)
            else:
                self._grow()
        out.sort()
        if out:
            self._count_used(out, 1)
        self._num_used += n
        return out

    def _count_used(self, slots: Sequence[int], delta: int) -> None:
        """Add ``delta`` to the used count of each slot's extent (a batch that lies in
        one extent, as most stores' do: one addition)."""
        used, spe = self._used_per_extent, self.slots_per_extent
        first = min(slots) // spe
        if first == max(slots) // spe:
            used[first] += delta * len(slots)
            return
        for slot in slots:
            used[slot // spe] += delta

    def _pop_live(self, n: int, out: list[int]) -> None:
        """Up to ``n`` free ids from the top of ``_free`` into ``out``, tombstones
        dropped on the way."""
        free, stale = self._free, self._stale
        while n and len(free) > self._num_stale:
            slot = free.pop()
            dead = stale.get(slot, 0)
            if dead:
                if dead == 1:
                    del stale[slot]
                else:
                    stale[slot] = dead - 1
                self._num_stale -= 1
            else:
                out.append(slot)
                n -= 1

    def _retire(self, slots: Iterable[int]) -> None:
        """Free ids that are no longer ids of this pool (their chunk went back): one
        tombstone each; the list is compacted once tombstones are half of it."""
        stale = self._stale
        for slot in slots:
            stale[slot] = stale.get(slot, 0) + 1
            self._num_stale += 1
        if self._num_stale > 64 and 2 * self._num_stale > len(self._free):
            kept = []
            for slot in self._free:
                dead = stale.get(slot, 0)
                if dead:
                    stale[slot] = dead - 1
                else:
                    kept.append(slot)
            self._free, self._stale, self._num_stale = kept, {}, 0

    def free(self, slot: int) -> None:
        self.free_many((slot,))

    def free_many(self, slots: Sequence[int]) -> None:
        """``free`` for each of ``slots``, in order (one read of the copy counts)."""
        used, spe, free, busy = self._used_per_extent, self.slots_per_extent, self._free, self._busy
        if not self._copies:  # no copy runs: none of them waits
            if slots:
                self._count_used(slots, -1)
            free.extend(slots)
            self._num_used -= len(slots)
            return
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
        return self._copies > 0

    def is_storing(self, slot: int) -> bool:
        """Whether a store copy into ``slot`` is running."""
        return bool(self._storing[slot]) if 0 <= slot < self._storing.size else False

    def mark_busy(self, slots: npt.NDArray[np.int64], store: bool = False) -> None:
        """A copy starts on ``slots`` (distinct, valid: the submit checked)."""
        self._busy[slots] += 1
        self._copies += len(slots)
        if store:
            self._storing[slots] += 1

    def unmark_busy(self, slots: npt.NDArray[np.int64], store: bool = False) -> None:
        busy = self._busy
        busy[slots] -= 1
        self._copies -= len(slots)
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

    def _recount(self) -> None:
        """The per-chunk state from the chunk list, in one pass (an adoption)."""
        self._extent_array = np.asarray(
            [-1 if e is None else e for e in self.extents], dtype=np.int64
        )
        self._num_extents = len(self.extents) - self.extents.count(None)
        self._capacity = len(self.extents) * self.slots_per_extent
        self._has_holes = self._num_extents < len(self.extents)
        self._busy = _with_room(self._busy, self._capacity, 0)
        self._storing = _with_room(self._storing, self._capacity, 0)

    def adopt(self, extents: Sequence[int | None], used: set[int]) -> None:
        """Take over extents a previous daemon gave this namespace, by chunk (None:
        a hole; warm restart). ``used`` lies in owned chunks."""
        self.extents = list(extents)
        spe = self.slots_per_extent
        self._used_per_extent = [0] * len(extents)
        for slot in used:
            self._used_per_extent[slot // spe] += 1
        self._num_used = len(used)
        self._stale, self._num_stale = {}, 0
        self._recount()
        self._fresh = self.capacity
        self._free = [
            s
            for s in range(self.capacity - 1, -1, -1)
            if s not in used and self.extents[s // spe] is not None
        ]
        self._trim_holes()

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
        self._retire(range(chunk * spe, (chunk + 1) * spe))  # every id of it is free
        ext = self.extents[chunk]
        assert ext is not None
        self.extents[chunk] = None
        self._extent_array[chunk] = -1
        self._num_extents -= 1
        self._has_holes = True
        self.pool.give_back(ext)
        self._trim_holes()
        return True

    def release_free_tail(self) -> int:
        """Give every completely unused top extent back to the pool; returns how many."""
        keep = len(self.extents)
        while keep and self._used_per_extent[keep - 1] == 0:
            keep -= 1
        if keep == len(self.extents):
            return 0
        gone = self.extents[keep:]
        self._cut(keep)
        for ext in gone:
            if ext is not None:
                self.pool.give_back(ext)
        return len(gone) - gone.count(None)

    def _trim_holes(self) -> None:
        """Holes at the top are no chunk at all."""
        keep = len(self.extents)
        while keep and self.extents[keep - 1] is None:
            keep -= 1
        if keep < len(self.extents):
            self._cut(keep)

    def _cut(self, keep: int) -> None:
        """Drop the chunks from ``keep`` up (unused, or holes): their listed free ids
        become tombstones (a hole's are already), their fresh ids are simply gone; when
        they are most of the list, one pass drops them and their tombstones instead."""
        spe, start, top = self.slots_per_extent, keep * self.slots_per_extent, len(self.extents)
        if 2 * (top - keep) * spe > len(self._free):
            self._free = [s for s in self._free if s < start]
            for slot in [s for s in self._stale if s >= start]:
                self._num_stale -= self._stale.pop(slot)
        else:
            listed = min(self._fresh, top * spe)  # ids below are listed or in use
            self._retire(
                slot
                for chunk in range(keep, top)
                if self.extents[chunk] is not None
                for slot in range(chunk * spe, min((chunk + 1) * spe, listed))
            )
        self._num_extents -= (top - keep) - self.extents[keep:].count(None)
        del self.extents[keep:], self._used_per_extent[keep:]
        self._extent_array[keep:top] = -1  # the arrays keep their room (see _grow)
        self._capacity = start
        self._has_holes = self._num_extents < keep
        self._fresh = min(self._fresh, start)

    def region_offsets(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Byte offset in the region of each slot (valid slots: ``is_valid``)."""
        spe = self.slots_per_extent
        if slots.size <= FEW_SLOTS:  # five numpy calls
            base, extent_bytes, slot_bytes, extents = (
                self.pool.data_offset,
                self.pool.extent_bytes,
                self.slot_bytes,
                self.extents,
            )
            offsets = [
                base + extents[s // spe] * extent_bytes + s % spe * slot_bytes
                for s in slots.tolist()
            ]
            return np.array(offsets, dtype=np.int64)
        ext = self._extent_array[slots // spe]
        return (
            self.pool.data_offset + ext * self.pool.extent_bytes + (slots % spe) * self.slot_bytes
        )

    def is_valid(self, slots: npt.NDArray[np.int64]) -> bool:
        """Whether every slot id lies in an owned chunk."""
        if slots.size == 0:
            return True
        if slots.size <= FEW_SLOTS:  # two numpy reductions
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

"""Extents and slots: allocation order, deferral of busy slots, giving extents back."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffloadd.region.allocator import ExtentPool
from kvoffloadd.region.slots import SlotPool

EXT = 4 * 4096


def test_fresh_then_lifo_then_new_extent() -> None:
    pool = ExtentPool(3, EXT, data_offset=1 << 20)
    a = SlotPool(pool, owner=0, slot_bytes=4096)
    assert a.num_free == 12
    assert a.allocate(3) == [0, 1, 2]
    a.free(1)
    a.free(0)
    assert a.allocate(3) == [0, 1, 3]  # fresh 3 first, then the frees; ascending
    assert a.extents == [0]
    assert a.allocate(2) == [4, 5]  # a new extent
    assert a.extents == [0, 1] and pool.owner == [0, 0, None]
    offsets = a.region_offsets(np.array([0, 3, 4, 5]))
    assert offsets.tolist() == [
        1 << 20,
        (1 << 20) + 3 * 4096,
        (1 << 20) + EXT,
        (1 << 20) + EXT + 4096,
    ]
    with pytest.raises(AssertionError):
        a.allocate(100)


def test_busy_slot_is_not_reused_until_its_copy_drains() -> None:
    """Invariant 3: a slot freed while a copy still touches it is parked, not reused."""
    a = SlotPool(ExtentPool(1, EXT), owner=0, slot_bytes=4096)
    slots = a.allocate(4)
    a.mark_busy(np.array([2]))
    a.free(2)
    assert a.num_free == 0 and a.deferred == {2}
    a.free(3)
    assert a.allocate(1) == [3]
    a.unmark_busy(np.array([2]))
    assert a.deferred == set() and a.allocate(1) == [2]
    assert slots == [0, 1, 2, 3]


def test_release_free_tail_gives_extents_back() -> None:
    pool = ExtentPool(2, EXT)
    a = SlotPool(pool, 0, 4096)
    b = SlotPool(pool, 1, 8192)
    a.allocate(5)  # two extents
    assert pool.num_free == 0 and b.num_free == 0
    for s in (4, 3):
        a.free(s)
    assert a.release_free_tail() == 1  # slot 4's extent is empty now
    assert pool.num_free == 1 and b.num_free == 2
    assert a.allocate(1) == [3]  # the freed id below the tail survives
    assert b.allocate(2) == [0, 1] and pool.owner == [0, 1]


def test_slot_larger_than_extent_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        SlotPool(ExtentPool(1, EXT), 0, EXT + 1)


def test_any_unused_extent_goes_back_and_its_chunk_is_a_hole_until_refilled() -> None:
    """Reclaim takes whichever extent holds nothing in use, not only the top one: the
    other chunks keep their ids and places; the hole's ids are not handed out."""
    pool = ExtentPool(4, EXT, data_offset=0)
    a = SlotPool(pool, 0, 4096)
    assert a.allocate(12) == list(range(12))  # chunks 0, 1, 2 on extents 0, 1, 2
    before = a.region_offsets(np.array([0, 11])).tolist()
    for s in range(4, 8):
        a.free(s)
    a.free(2)
    assert not a.release_chunk(0)  # slot 0 still used
    assert a.release_chunk(1) and a.extents == [0, None, 2] and a.num_extents == 2
    assert a.region_offsets(np.array([0, 11])).tolist() == before
    assert not a.is_valid(np.array([5])) and a.is_valid(np.array([0, 11]))
    assert pool.num_free == 2 and a.num_free == 1 + 2 * 4
    assert a.allocate(1) == [2]  # the free id of an owned chunk first
    b = SlotPool(pool, 1, 4096)
    assert b.allocate(1) == [0] and pool.owner[1] == 1  # extent 1 serves b now
    refill = a.allocate(2)  # a's hole refills from another extent: two of its ids
    assert len(set(refill)) == 2 and set(refill) <= set(range(4, 8))
    assert a.extents == [0, 3, 2] and a.is_valid(np.array([5]))
    for s in (*refill, *range(8, 12)):
        a.free(s)
    assert a.release_chunk(2) and a.release_chunk(1)
    assert a.extents == [0] and a.capacity == 4  # holes on top are trimmed


@pytest.mark.parametrize("extents", [8, 64])  # 64: enough released ids to compact the list
def test_the_kept_counts_match_the_slots_through_any_sequence_of_changes(extents: int) -> None:
    """``num_used``, ``num_extents`` and the per-chunk arrays are kept as slots and
    extents change (a lease on a node's region must not add up, or rebuild, thousands
    of extents): a seeded random walk over every operation that changes them,
    recounted after each step."""
    rng = np.random.default_rng(7)
    pool = ExtentPool(extents, EXT)
    a = SlotPool(pool, owner=0, slot_bytes=4096)
    held: set[int] = set()
    busy: set[int] = set()
    for _ in range(3000):
        op = int(rng.integers(8))
        op = 2 if op >= 6 else op  # frees as often as allocations: holes come and go
        if op <= 1 and a.num_free:
            got = a.allocate(int(rng.integers(1, min(6, a.num_free) + 1)))
            assert len(set(got)) == len(got) and not set(got) & (held | busy)
            assert a.is_valid(np.array(got, dtype=np.int64))  # in an owned chunk
            held.update(got)
        elif op == 2 and held:
            gone = [int(s) for s in rng.choice(sorted(held), int(rng.integers(1, 4)))]
            gone = list(dict.fromkeys(gone))
            a.free_many(gone)
            held.difference_update(gone)
        elif op == 3 and held and not busy:
            slot = int(rng.choice(sorted(held)))
            a.mark_busy(np.array([slot]))
            a.free(slot)  # deferred until its copy drains
            held.discard(slot)
            busy.add(slot)
        elif op == 4 and busy:
            a.unmark_busy(np.array(sorted(busy)))
            busy.clear()
        elif op == 5:
            if rng.integers(2):  # reclaim: any unused chunk goes back
                for chunk in a.owned_chunks():
                    a.release_chunk(chunk)
            a.release_free_tail()  # housekeeping: the unused top ones
        assert a.num_used == sum(a._used_per_extent) == len(held) + len(busy)
        per_extent = [0] * len(a._used_per_extent)  # each extent's own count, recounted
        for slot in held | busy:
            per_extent[slot // a.slots_per_extent] += 1
        assert a._used_per_extent == per_extent
        assert a._copies == int(a._busy.sum()) and a.any_busy() == bool(busy)
        assert a.num_extents == len(a.extents) - a.extents.count(None)
        assert a.num_extents == sum(o == 0 for o in pool.owner)
        assert pool._free[0] == sorted(pool._free[0], reverse=True)  # lowest taken first
        assert a.capacity == len(a.extents) * a.slots_per_extent
        # the arrays a grow extends in place (doubling): right up to the chunk list
        chunks = [-1 if e is None else e for e in a.extents]
        assert a._extent_array[: len(chunks)].tolist() == chunks
        assert a._busy.size >= a.capacity and a._storing.size >= a.capacity
        assert a.is_valid(np.array(sorted(held), dtype=np.int64))
        if op == 5:  # what a warm restart's adoption of the same state counts
            b = SlotPool(pool, owner=0, slot_bytes=4096)
            b.adopt(a.extents, held | busy)
            assert (b.num_used, b.num_extents, b.capacity, b.num_free) == (
                a.num_used,
                a.num_extents,
                a.capacity,
                a.num_free,
            )


def test_released_chunks_leave_no_id_behind_and_the_free_list_is_compacted() -> None:
    """Releasing a chunk costs its own ids, not a pass over the namespace's free list
    (a million entries on a node-sized region): its ids stay listed as tombstones,
    never handed out, and the list is compacted once they are half of it."""
    pool = ExtentPool(64, EXT)
    a = SlotPool(pool, owner=0, slot_bytes=4096)  # 4 slots per extent
    a.free_many(a.allocate(256))
    for chunk in range(1, 40):
        assert a.release_chunk(chunk)
    assert len(a._free) < 256  # compacted on the way (tombstones were half of it)
    kept = {s for c in (0, *range(40, 64)) for s in range(4 * c, 4 * c + 4)}
    assert a.num_free == len(kept) + 39 * 4  # the released extents are the pool's again
    assert set(a.allocate(len(kept))) == kept  # exactly the owned chunks' ids
    refill = a.allocate(8)  # then holes, refilled from the pool
    assert len(set(refill)) == 8 and a.num_extents == 27
    assert all(a.extents[s // 4] is not None for s in refill)
    a.free_many(refill)
    assert a.release_free_tail() == 0  # the top chunk is in use


def test_region_offsets_of_a_few_slots_match_the_vectorised_path() -> None:
    """A job's few slots take a list path, a large transfer numpy's: the same bytes,
    extents out of order and past a hole included."""
    pool = ExtentPool(6, EXT, data_offset=1 << 20)
    other = SlotPool(pool, 1, 4096)
    a = SlotPool(pool, 0, 4096)
    other.allocate(4)  # extent 0 is another pool's: a's chunks start at extent 1
    a.allocate(16)  # chunks 0..3 on extents 1..4
    for s in range(4, 8):
        a.free(s)
    assert a.release_chunk(1) and a.extents == [1, None, 3, 4]
    live = np.array([s for s in range(16) if not 4 <= s < 8] * 8, dtype=np.int64)
    assert live.size > 64
    whole = a.region_offsets(live).tolist()  # numpy
    few = [int(a.region_offsets(live[i : i + 1])[0]) for i in range(live.size)]  # lists
    assert few == whole
    assert whole[:3] == [(1 << 20) + EXT, (1 << 20) + EXT + 4096, (1 << 20) + EXT + 2 * 4096]
    assert whole[4] == (1 << 20) + 3 * EXT  # slot 8: chunk 2, on extent 3

"""Contiguous slots and the fewest copy runs (properties, with hypothesis).

- The allocator hands out each allocation ascending; slots freed together come back
  as one run to the next allocation of that size.
- ``merge_runs`` maps exactly the bytes the per-page descriptors map, in the fewest
  runs: one more than the places where either side stops being contiguous.
- ``build_runs`` plans all of a transfer's caches at once; its runs are exactly those
  of merging each cache's page copies on its own, in cache order.
- The vectorised submit checks (lease mirror, duplicate ids, busy marks) agree with
  their one-slot-at-a-time definitions.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.datapath.copyplan import has_duplicates, place_caches
from kvoffload.datapath.runs import CacheGeometry, build_runs, merge_runs
from kvoffload.protocol.messages import KVLayout
from kvoffloadd.index.leases import LeaseBook
from kvoffloadd.region.allocator import ExtentPool
from kvoffloadd.region.slots import SlotPool

EXT = 8 * 4096


def runs_of(slots: list[int]) -> int:
    return 1 + sum(1 for a, b in itertools.pairwise(slots) if b != a + 1) if slots else 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12)), max_size=60))
def test_allocations_are_ascending_unique_and_accounted(ops: list[tuple[bool, int]]) -> None:
    a = SlotPool(ExtentPool(6, EXT), owner=0, slot_bytes=4096)
    held: list[list[int]] = []
    in_use: set[int] = set()
    for is_alloc, n in ops:
        if is_alloc and n <= a.num_free:
            got = a.allocate(n)
            assert got == sorted(got) and len(set(got)) == n
            assert in_use.isdisjoint(got)
            in_use.update(got)
            held.append(got)
        elif held:
            for s in held.pop(n % len(held)):
                a.free(s)
                in_use.discard(s)
        assert a.num_used == len(in_use)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 16), min_size=2, max_size=12), st.data())
def test_slots_freed_together_come_back_as_one_run(sizes: list[int], data: st.DataObject) -> None:
    """Blocks stored together are evicted together: the next store of that many
    blocks gets them back contiguous, whatever order they were freed in."""
    a = SlotPool(ExtentPool(4, EXT), owner=0, slot_bytes=4096)
    stores = []
    for n in sizes:
        if n > a.num_free:
            break
        stores.append(a.allocate(n))
    assert all(runs_of(s) == 1 for s in stores)  # fresh ids
    while a.num_free > a.pool.num_free * a.slots_per_extent:
        a.allocate(1)  # no fresh ids left in the owned extents
    victim = stores[data.draw(st.integers(0, len(stores) - 1))]
    for s in data.draw(st.permutations(victim)):
        a.free(s)
    assert a.allocate(len(victim)) == victim


def page_pairs(region: np.ndarray, cache: np.ndarray, page: int) -> set[tuple[int, int]]:
    return {(int(r) + i, int(c) + i) for r, c in zip(region, cache) for i in range(0, page, 64)}


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=30, unique=True),
    st.lists(st.integers(0, 40), min_size=30, max_size=30, unique=True),
    st.sampled_from([64, 256]),
)
def test_merged_runs_cover_the_same_bytes_in_the_fewest_runs(
    slots: list[int], ids: list[int], page: int
) -> None:
    region = np.asarray(slots, dtype=np.int64) * page
    cache = np.asarray(ids[: len(slots)], dtype=np.int64) * page
    runs = merge_runs(region, cache, page)
    breaks = np.count_nonzero((np.diff(region) != page) | (np.diff(cache) != page))
    assert runs.region.size == 1 + breaks
    assert runs.total_bytes == len(slots) * page
    merged = {
        (int(r) + i, int(c) + i)
        for r, c, n in zip(runs.region, runs.cache, runs.nbytes)
        for i in range(0, int(n), 64)
    }
    assert merged == page_pairs(region, cache, page)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(0, 8), st.integers(1, 4))
def test_contiguous_blocks_into_contiguous_slots_copy_in_one_run(
    n: int, first_slot: int, f: int
) -> None:
    """One tensor per slot: a store of ascending engine blocks into ascending slots is
    one run per cache, sub-blocks included."""
    layout = KVLayout(tensor_page_bytes=[4096], block_size_factor=f)
    geoms = [CacheGeometry(64 * f + 8, 4096, 0, 4096)]
    slots = (np.arange(n) + first_slot) * layout.block_bytes
    runs = build_runs(
        layout, 0, slots, np.arange(n * f) + 3, 0, geoms, place_caches(layout, [4096])
    )
    assert runs.region.size == 1 and runs.total_bytes == n * f * 4096


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from([512, 1024, 4096]), min_size=1, max_size=5),
    st.integers(1, 3),
    st.data(),
)
def test_all_caches_at_once_plan_the_runs_of_one_cache_at_a_time(
    pages: list[int], f: int, data: st.DataObject
) -> None:
    world = data.draw(st.integers(1, 2))
    layout = KVLayout(tensor_page_bytes=pages, world_size=world, block_size_factor=f)
    rank = data.draw(st.integers(0, world - 1))
    nslots = data.draw(st.integers(0, 6))
    skip = data.draw(st.integers(0, f - 1)) if nslots else 0
    count = data.draw(st.integers(max(nslots * f - skip - f + 1, 0), max(nslots * f - skip, 0)))
    slots = data.draw(st.permutations(range(8)))[:nslots]
    if data.draw(st.booleans()):
        slots = sorted(slots)  # ascending slots: runs merge across blocks
    nblocks = 3 * 8 * f
    ids = data.draw(st.permutations(range(nblocks)))[:count]
    if data.draw(st.booleans()):
        ids = sorted(ids)
    # rows padded or not, caches at an offset or not: the strides decide what merges
    geoms = [
        CacheGeometry(
            nblocks, p, data.draw(st.sampled_from([0, 64])), p * data.draw(st.sampled_from([1, 2]))
        )
        for p in pages
    ]
    at = place_caches(layout, pages)
    got = build_runs(
        layout,
        rank,
        np.array(slots, dtype=np.int64) * layout.block_bytes,
        np.array(ids, dtype=np.int64),
        skip,
        geoms,
        at,
    )
    sub = np.arange(skip, skip + count, dtype=np.int64)
    base = np.array(slots, dtype=np.int64)[sub // f] * layout.block_bytes + rank * layout.rank_bytes
    want = [
        merge_runs(
            base + a.tensor_offset + a.part_offset + (sub % f) * a.tensor_page_bytes,
            g.offset_bytes + np.array(ids, dtype=np.int64) * g.row_stride_bytes,
            g.page_bytes,
        )
        for a, g in zip(at, geoms)
    ]
    assert got.region.tolist() == [x for w in want for x in w.region.tolist()]
    assert got.cache.tolist() == [x for w in want for x in w.cache.tolist()]
    assert got.nbytes.tolist() == [x for w in want for x in w.nbytes.tolist()]
    assert got.which.tolist() == [i for i, w in enumerate(want) for _ in range(w.region.size)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2000), max_size=80))
def test_duplicate_check_matches_a_set(ids: list[int]) -> None:
    assert has_duplicates(np.asarray(ids, dtype=np.int64)) == (len(set(ids)) != len(ids))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([0, 1, 2]), st.integers(0, 3000)), max_size=60),
    st.lists(st.integers(0, 4000), max_size=100),  # both sides of the small path
    st.sampled_from([0, 11, 22]),
)
def test_lease_mirror_agrees_with_the_book(
    ops: list[tuple[int, int]], probe: list[int], token: int
) -> None:
    book = LeaseBook()
    for op, slot in ops:
        if op == 0:
            book.grant(11, [slot])
        elif op == 1:
            book.assign(slot, 22)
        else:
            book.forget(slot)
    if ops and ops[0][0] == 0:
        book.release(11)
    slots = np.asarray(probe, dtype=np.int64)
    expected = token != 0 and all(book.may_write(token, s) for s in probe)
    assert book.all_writable(token, slots) == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True), max_size=10))
def test_busy_marks_defer_reuse_until_the_last_copy(jobs: list[list[int]]) -> None:
    """Invariant 3 with overlapping copies: a freed slot comes back only after every
    copy on it has drained."""
    a = SlotPool(ExtentPool(2, EXT), owner=0, slot_bytes=4096)
    a.allocate(16)
    for job in jobs:
        a.mark_busy(np.asarray(job, dtype=np.int64))
    for s in range(16):
        a.free(s)
    touched = {s for job in jobs for s in job}
    assert a.deferred == touched
    for i, job in enumerate(jobs):
        a.unmark_busy(np.asarray(job, dtype=np.int64))
        still = {s for later in jobs[i + 1 :] for s in later}
        assert a.deferred == touched & still
        assert not any(a.is_busy(s) for s in touched - still)
    assert a.num_used == 0

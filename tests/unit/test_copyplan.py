"""Copy descriptors match vLLM's expand_block_ids rule and merge adjacent runs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.datapath.canonical import CanonicalPart
from kvoffload.datapath.copyplan import SMALL_IDS, JobPlan, check_transfer, place_caches
from kvoffload.datapath.memruns import copy_groups, copy_runs
from kvoffload.datapath.runs import CacheGeometry, build_runs, merge_runs
from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.messages import KVLayout


def expand_block_ids(ids: list[int], f: int, skip: int) -> list[int]:
    """vLLM's rule: offloaded block b covers sub-blocks b*f .. b*f+f-1; skip the first ones."""
    out = [b * f + j for b in ids for j in range(f)]
    return out[skip:]


def reference_copy(
    layout: KVLayout,
    rank: int,
    slot_bytes: int,
    slots: list[int],
    block_ids: list[int],
    skip: int,
    caches: list[np.ndarray],
) -> np.ndarray:
    """Byte-by-byte model of a store into a region of slots."""
    region = np.zeros(max(slots) * slot_bytes + slot_bytes, dtype=np.uint8)
    f = layout.block_size_factor
    subs = expand_block_ids(list(range(len(slots))), f, skip)
    for sub, block in zip(subs, block_ids):
        i, j = divmod(sub, f)
        off = slots[i] * slot_bytes + rank * layout.rank_bytes
        for t, page in enumerate(layout.tensor_page_bytes):
            start = off + j * page
            region[start : start + page] = caches[t][block]
            off += page * f
    return region


@pytest.mark.parametrize(
    ("f", "skip", "world", "rank"), [(1, 0, 1, 0), (3, 0, 1, 0), (3, 2, 2, 1), (4, 1, 1, 0)]
)
def test_runs_reproduce_the_reference_layout(f: int, skip: int, world: int, rank: int) -> None:
    rng = np.random.default_rng(f * 10 + skip)
    pages = [512, 1024, 256]
    layout = KVLayout(tensor_page_bytes=pages, world_size=world, block_size_factor=f)
    slot_bytes = layout.block_bytes
    caches = [rng.integers(0, 256, (40, p), dtype=np.uint8) for p in pages]
    geoms = [CacheGeometry(40, p, 0, p) for p in pages]
    slots = [5, 0, 2]
    ids = rng.permutation(40)[: 3 * f - skip]
    check_transfer(layout, len(slots), ids, skip, geoms)
    at = place_caches(layout, pages)
    runs = build_runs(layout, rank, np.array(slots) * slot_bytes, ids, skip, geoms, at)
    region = np.zeros(6 * slot_bytes, dtype=np.uint8)
    for ro, co, n, i in zip(runs.region, runs.cache, runs.nbytes, runs.which):
        region[ro : ro + n] = caches[i].reshape(-1)[co : co + n]
    ref = reference_copy(layout, rank, slot_bytes, slots, ids.tolist(), skip, caches)
    assert np.array_equal(region[: ref.size], ref)


def test_adjacent_pages_merge_into_one_run() -> None:
    layout = KVLayout(tensor_page_bytes=[4096], block_size_factor=2)
    geoms = [CacheGeometry(16, 4096, 0, 4096)]
    at = place_caches(layout, [4096])
    runs = build_runs(layout, 0, np.array([0, 8192, 16384]), np.arange(6), 0, geoms, at)
    assert runs.region.tolist() == [0] and runs.nbytes.tolist() == [6 * 4096]
    runs = build_runs(layout, 0, np.array([0, 16384]), np.array([0, 1, 5, 6]), 0, geoms, at)
    assert runs.nbytes.tolist() == [8192, 8192]
    empty = merge_runs(np.zeros(0, np.int64), np.zeros(0, np.int64), 4096)
    assert empty.total_bytes == 0


def test_check_transfer_refuses_bad_ids_and_skip() -> None:
    layout = KVLayout(tensor_page_bytes=[64], block_size_factor=2)
    geoms = [CacheGeometry(8, 64, 0, 64)]
    check_transfer(layout, 2, np.array([0, 1, 2]), 1, geoms)
    check_transfer(layout, 2, np.array([0, 1, 2]), 0, geoms)  # a partly filled last slot
    check_transfer(layout, 2, np.array([0, 1]), 1, geoms)
    for ids, skip, needle in [
        ([0, 1, 2, 8], 0, "outside"),
        ([0, 1, 2, -3], 0, "outside"),
        ([0, 1], 0, "need 3..4"),  # the second slot would get nothing
        ([0], 1, "need 2..3"),
        ([0, 1, 2, 3, 4], 0, "need 3..4"),
        ([0, 1, 2], 2, "skip"),
    ]:
        with pytest.raises(InvalidArgumentError, match=needle):
            check_transfer(layout, 2, np.array(ids), skip, geoms)


@pytest.mark.parametrize("n", [SMALL_IDS, SMALL_IDS + 1])
def test_check_transfer_finds_an_id_out_of_range_among_few_ids_and_many(n: int) -> None:
    """A step's few ids are checked as a list, a large transfer's with numpy: both
    refuse an id past the smallest cache, at either end."""
    layout = KVLayout(tensor_page_bytes=[64, 64])
    geoms = [CacheGeometry(n + 1, 64, 0, 64), CacheGeometry(n, 64, 0, 64)]
    ids = np.arange(n, dtype=np.int64)
    check_transfer(layout, n, ids, 0, geoms)
    for bad in (n, -1):
        wrong = ids.copy()
        wrong[n // 2] = bad
        with pytest.raises(InvalidArgumentError, match=f"engine block id {bad} is outside"):
            check_transfer(layout, n, wrong, 0, geoms)


@pytest.mark.parametrize(("f", "skip", "world", "rank"), [(1, 0, 1, 0), (3, 2, 2, 1)])
def test_caches_that_tile_one_tensor_page_land_side_by_side(
    f: int, skip: int, world: int, rank: int
) -> None:
    """A vLLM worker registers its tensors as parts of one page per rank."""
    rng = np.random.default_rng(7)
    parts = [512, 1024, 256]
    layout = KVLayout(tensor_page_bytes=[sum(parts)], world_size=world, block_size_factor=f)
    caches = [rng.integers(0, 256, (40, p), dtype=np.uint8) for p in parts]
    geoms = [CacheGeometry(40, p, 0, p) for p in parts]
    slots, slot_bytes = [4, 1], layout.block_bytes
    ids = rng.permutation(40)[: 2 * f - skip]
    at = place_caches(layout, parts)
    runs = build_runs(layout, rank, np.array(slots) * slot_bytes, ids, skip, geoms, at)
    region = np.zeros(5 * slot_bytes, dtype=np.uint8)
    for ro, co, n, i in zip(runs.region, runs.cache, runs.nbytes, runs.which):
        region[ro : ro + n] = caches[i].reshape(-1)[co : co + n]
    for j, b in enumerate(ids.tolist()):
        slot, sub = divmod(j + skip, f)
        start = slots[slot] * slot_bytes + rank * layout.rank_bytes + sub * sum(parts)
        want = np.concatenate([c[b] for c in caches])
        assert np.array_equal(region[start : start + sum(parts)], want)


def test_caches_must_tile_the_layout_exactly() -> None:
    layout = KVLayout(tensor_page_bytes=[1024, 512])
    assert [p.part_offset for p in place_caches(layout, [512, 512, 512])] == [0, 512, 0]
    for bad in ([1024], [1024, 512, 8], [768, 512], [512, 1024], [1024, 0, 512]):
        with pytest.raises(InvalidArgumentError, match=r"tile|already fill"):
            place_caches(layout, bad)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(0, 3),
    st.integers(1, 9),
    st.integers(1, 64),
    st.booleans(),
)
def test_a_plan_built_in_pieces_copies_the_same_bytes(
    f: int, skip: int, num_slots: int, max_copies: int, canonical: bool
) -> None:
    """A copier builds a large job's runs a piece of whole slots at a time: whatever
    the piece size, the bytes moved are those of the whole plan."""
    skip %= f
    pages = [64, 32]
    layout = KVLayout(tensor_page_bytes=pages, block_size_factor=f)
    slot_bytes = layout.block_bytes
    ids = np.arange(num_slots * f - skip, dtype=np.int64)[::-1].copy()
    geoms = [CacheGeometry(64, p, 0, p) for p in pages]
    canon: list[CanonicalPart] = []
    if canonical:  # one-byte fragments, reversed: nothing merges
        canon = [
            CanonicalPart(p, np.array([[i, p - 1 - i, 1] for i in range(p)], dtype=np.int64))
            for p in pages
        ]
    at = place_caches(layout, pages, canon)
    caches = [
        np.arange(64 * p, dtype=np.uint8).reshape(64, p) * (t + 3) for t, p in enumerate(pages)
    ]
    slots = np.arange(num_slots, dtype=np.int64)[::-1] * 2  # every other slot, reversed
    region = [np.zeros(2 * num_slots * slot_bytes, dtype=np.uint8) for _ in range(2)]
    plans = [
        JobPlan(
            layout,
            0,
            slots * slot_bytes,
            ids,
            skip,
            geoms,
            at,
            slots,
            int(r.ctypes.data),
            np.array([c.ctypes.data for c in caches], dtype=np.int64),
        )
        for r in region
    ]
    copy_runs(*plans[0].addresses())
    for piece in plans[1].pieces(max_copies):
        copy_runs(*piece)
    assert plans[0].copies == ids.size * (sum(pages) if canonical else 2)
    assert np.array_equal(region[0], region[1]) and region[0].any()


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([1, 2]),
    st.integers(1, 12),
    st.sampled_from(["ascending", "descending", "scattered"]),
    st.sampled_from(["ascending", "descending", "scattered"]),
    st.booleans(),
    st.integers(0, 1),
    st.integers(1, 5),
)
def test_groups_copy_what_the_runs_copy(
    f: int, num_slots: int, slot_order: str, id_order: str, store: bool, rank: int, split: int
) -> None:
    """A copier copies a plan as strided groups, a range of slots at a time: for slots
    and engine blocks that step evenly or not, either way, the bytes are those of
    the plan's runs."""
    pages = [64, 32, 32]  # the second tensor's page tiled by two caches
    layout = KVLayout(tensor_page_bytes=[64, 64], block_size_factor=f, world_size=2)
    rng = np.random.default_rng(num_slots * 7 + f)

    def ordered(n: int, how: str) -> np.ndarray:
        a = np.arange(n, dtype=np.int64)
        orders: dict[str, np.ndarray] = {
            "ascending": a,
            "descending": a[::-1].copy(),
            "scattered": rng.permutation(a),
        }
        return orders[how]

    ids = ordered(num_slots * f, id_order) * 2  # every other engine block
    slots = ordered(num_slots, slot_order) * 3 + 1
    geoms = [CacheGeometry(2 * ids.size + 2, p, 8, p + 16) for p in pages]  # padded rows
    at = place_caches(layout, pages)
    region_bytes = (3 * num_slots + 2) * layout.block_bytes
    regions = [rng.integers(0, 256, region_bytes, dtype=np.uint8) for _ in range(2)]
    regions[1][:] = regions[0]
    caches = [[rng.integers(0, 256, g.end_bytes, dtype=np.uint8) for g in geoms] for _ in range(2)]
    for c0, c1 in zip(*caches):
        c1[:] = c0
    plans = [
        JobPlan(
            layout,
            rank,
            slots * layout.block_bytes,
            ids,
            0,
            geoms,
            at,
            slots if store else None,
            int(r.ctypes.data),
            np.array([c.ctypes.data for c in cs], dtype=np.int64),
        )
        for r, cs in zip(regions, caches)
    ]
    copy_runs(*plans[0].addresses())
    bounds = np.linspace(0, num_slots, split + 1).astype(int).tolist()
    for a, b in itertools.pairwise(bounds):
        copy_groups(plans[1].groups(a, b))
    assert np.array_equal(regions[0], regions[1])
    assert all(np.array_equal(c0, c1) for c0, c1 in zip(*caches))


def test_evenly_stepping_transfers_are_one_group_per_cache() -> None:
    """A store of 16 blocks from a cache per layer into contiguous slots: a group of
    16 rows per cache, known without building a run; one cache whose pages continue
    each other on both sides: one run."""
    pages = [32] * 4
    layout = KVLayout(tensor_page_bytes=pages)
    ids = np.arange(16, dtype=np.int64)
    slots = np.arange(5, 21, dtype=np.int64)

    def plan(pages: list[int]) -> JobPlan:
        layout = KVLayout(tensor_page_bytes=pages)
        geoms = [CacheGeometry(16, p, 0, p) for p in pages]
        bases = np.arange(len(pages), dtype=np.int64) << 20
        at = place_caches(layout, pages)
        return JobPlan(
            layout, 0, slots * layout.block_bytes, ids, 0, geoms, at, slots, 1 << 30, bases
        )

    g = plan(pages).groups()
    assert g.rows == [16] * 4 and g.nbytes == [32] * 4
    assert g.dst_step == [layout.block_bytes] * 4 and g.src_step == [32] * 4
    assert g.runs == 64 and g.total_bytes == 16 * layout.block_bytes
    whole = plan([128]).groups()
    assert (whole.rows, whole.nbytes) == ([1], [16 * 128])

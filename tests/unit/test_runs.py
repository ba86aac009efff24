"""Copy runs: the whole-transfer builders copy exactly what the one-cache-at-a-time
reference copies, run for run, for canonical caches of every shape they accept."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.datapath import runs as runs_mod
from kvoffload.datapath.canonical import CanonicalPart
from kvoffload.datapath.copyplan import place_caches
from kvoffload.protocol.messages import KVLayout


def _frags(rng: np.random.Generator, page: int, count: int, contiguous: bool) -> np.ndarray:
    """``count`` fragments of a ``page``-byte canonical page, split evenly; in order
    (they merge with each other) or shuffled on the canonical side."""
    size = page // (2 * count)
    local = np.arange(count, dtype=np.int64) * size
    canon = local * 2 if not contiguous else local
    if not contiguous:
        canon = rng.permutation(canon)
    return np.stack([local, canon, np.full(count, size, dtype=np.int64)], axis=1)


@settings(max_examples=150, deadline=None)
@given(
    caches=st.integers(2, 5),
    frags=st.integers(1, 6),
    f=st.integers(1, 3),
    blocks=st.integers(0, 9),
    contiguous=st.booleans(),
    writers=st.integers(1, 3),
    store=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_canonical_caches_at_once_match_the_loop_over_caches(
    caches: int,
    frags: int,
    f: int,
    blocks: int,
    contiguous: bool,
    writers: int,
    store: bool,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    page = 1024
    layout = KVLayout(tensor_page_bytes=[page] * caches, block_size_factor=f)
    writer = int(rng.integers(0, writers))
    parts = [
        CanonicalPart(page, _frags(rng, page, frags, contiguous), writers, writer)
        for _ in range(caches)
    ]
    local = page // 2
    placements = place_caches(layout, [local] * caches, parts)
    rows = 3 * blocks + 3
    geoms = [runs_mod.CacheGeometry(rows, local, c * 7 * local, local) for c in range(caches)]
    slots = -(-blocks // f) if blocks else 0
    slot_ids = rng.permutation(64)[:slots].astype(np.int64)
    ids = rng.permutation(rows)[:blocks].astype(np.int64)
    if contiguous and blocks:  # neighbouring blocks too, so runs merge across blocks
        ids = np.sort(ids)
    slot_idx, sub_idx = runs_mod.expand_positions(blocks, f, 0)
    base = (slot_ids * layout.block_bytes)[slot_idx]
    page_ids = slot_ids[slot_idx] * f + sub_idx if store else None

    together = runs_mod._canonical_runs(base, sub_idx, ids, page_ids, geoms, placements)
    one_by_one = runs_mod._runs_by_cache(base, sub_idx, ids, page_ids, geoms, placements)
    assert together is not None
    for a, b in ((together.region, one_by_one.region), (together.cache, one_by_one.cache)):
        assert a.tolist() == b.tolist()
    assert together.nbytes.tolist() == one_by_one.nbytes.tolist()
    assert together.which.tolist() == one_by_one.which.tolist()
    full = runs_mod.build_runs(
        layout, 0, slot_ids * layout.block_bytes, ids, 0, geoms, placements,
        slot_ids if store else None,
    )  # fmt: skip
    assert full.region.tolist() == one_by_one.region.tolist()


def test_canonical_caches_of_different_turns_are_built_one_by_one() -> None:
    """Parts that take different turns (or hold different fragment counts) cannot share
    one array: the whole-transfer builder declines and the loop builds them."""
    frags = np.array([[0, 0, 256], [256, 512, 256]], dtype=np.int64)
    layout = KVLayout(tensor_page_bytes=[1024, 1024])
    parts = [CanonicalPart(1024, frags, 2, 0), CanonicalPart(1024, frags, 2, 1)]
    placements = place_caches(layout, [512, 512], parts)
    geoms = [runs_mod.CacheGeometry(4, 512, 0, 512)] * 2
    one = np.zeros(1, dtype=np.int64)
    assert runs_mod._canonical_runs(one, one, one, one, geoms, placements) is None
    fewer = [parts[0], CanonicalPart(1024, frags[:1], 2, 0)]
    assert (
        runs_mod._canonical_runs(one, one, one, one, geoms, place_caches(layout, [512, 256], fewer))
        is None
    )


def test_runs_never_merge_from_one_cache_into_the_next() -> None:
    """Where one cache's last fragment and the next cache's first continue each other
    on both sides (offsets within each cache), they are still two runs: they are two
    allocations."""
    layout = KVLayout(tensor_page_bytes=[1024, 1024])
    whole = np.array([[0, 0, 1024]], dtype=np.int64)
    placements = place_caches(layout, [1024, 1024], [CanonicalPart(1024, whole)] * 2)
    geoms = [runs_mod.CacheGeometry(1, 1024, 0, 1024), runs_mod.CacheGeometry(1, 1024, 1024, 1024)]
    zero = np.zeros(1, dtype=np.int64)
    got = runs_mod.build_runs(layout, 0, zero, zero, 0, geoms, placements)
    assert got.region.tolist() == [0, 1024] and got.cache.tolist() == [0, 1024]
    assert got.nbytes.tolist() == [1024, 1024] and got.which.tolist() == [0, 1]

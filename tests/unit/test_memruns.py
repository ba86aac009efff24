"""Copy runs as strided groups (``kvoffload.datapath.memruns``), against the runs one by one.

- Every group expands back to exactly the runs it was made of, in order.
- Runs that step alike become one group: one per cache for a job with a cache per layer.
- Copying the groups writes the same bytes as copying each run with memmove, for
  runs in any order, of mixed lengths and with negative steps.
"""

from __future__ import annotations

import ctypes

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.datapath.memruns import GROUP_MIN_RUNS, Groups, copy_groups, copy_runs, group_runs

PAGE = 64


def expand(g: Groups) -> list[tuple[int, int, int]]:
    out = []
    for d, s, n, rows, ds, ss in zip(g.dst, g.src, g.nbytes, g.rows, g.dst_step, g.src_step):
        out.extend((d + i * ds, s + i * ss, n) for i in range(rows))
    return out


def arrays(runs: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = np.array(runs, dtype=np.int64).reshape(-1, 3)
    return a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(0, 10_000), st.sampled_from([8, 16, 64])),
        max_size=40,
    )
)
def test_groups_expand_to_the_runs_in_order(runs: list[tuple[int, int, int]]) -> None:
    g = group_runs(*arrays(runs))
    assert expand(g) == runs
    assert g.total_bytes == sum(n for _, _, n in runs)


def test_runs_that_step_alike_are_one_group_per_cache() -> None:
    """A store of 16 blocks from 4 per-layer caches into contiguous slots."""
    slot_bytes, blocks = 4 * PAGE, 16
    runs = [
        (10_000 + b * slot_bytes + c * PAGE, 100_000 * (c + 1) + b * PAGE * 3, PAGE)
        for c in range(4)
        for b in range(blocks)
    ]
    g = group_runs(*arrays(runs))
    assert g.rows == [blocks] * 4
    assert g.dst_step == [slot_bytes] * 4 and g.src_step == [PAGE * 3] * 4
    # a change of step or of length starts a new group; a lone run is a row of one
    odd = [(0, 0, 8), (8, 100, 8), (16, 200, 8), (40, 300, 8), (64, 400, 8), (100, 0, 16)]
    assert group_runs(*arrays(odd)).rows == [3, 2, 1]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_grouped_copies_write_what_one_by_one_copies_write(data: st.DataObject) -> None:
    slots = data.draw(st.integers(1, 24))
    order = data.draw(st.permutations(range(slots)))
    lengths = data.draw(
        st.lists(st.sampled_from([PAGE, PAGE // 2]), min_size=slots, max_size=slots)
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    src = rng.integers(0, 256, slots * PAGE * 2, dtype=np.uint8)
    want = np.zeros(slots * PAGE, dtype=np.uint8)
    got = np.zeros_like(want)
    # run i copies source page order[i]*2 (every other page) to destination slot i
    runs = [
        (int(got.ctypes.data) + i * PAGE, int(src.ctypes.data) + o * 2 * PAGE, n)
        for i, (o, n) in enumerate(zip(order, lengths))
    ]
    if data.draw(st.booleans()):
        runs.reverse()  # negative steps
    copy_groups(group_runs(*arrays(runs)))
    base = int(got.ctypes.data)
    for d, s, n in runs:
        ctypes.memmove(int(want.ctypes.data) + (d - base), s, n)
    assert np.array_equal(got, want)


def test_copy_runs_groups_only_jobs_of_many_runs() -> None:
    """Below GROUP_MIN_RUNS the runs go one by one; at and above, as groups: the
    same bytes either way (a cache per layer, a page per block, strided slots)."""
    for blocks in (GROUP_MIN_RUNS // 4, GROUP_MIN_RUNS):
        caches = 4
        rng = np.random.default_rng(blocks)
        src = [rng.integers(0, 256, blocks * PAGE, dtype=np.uint8) for _ in range(caches)]
        got = np.zeros(blocks * caches * PAGE, dtype=np.uint8)
        runs = [
            (
                int(got.ctypes.data) + (b * caches + c) * PAGE,
                int(src[c].ctypes.data) + b * PAGE,
                PAGE,
            )
            for c in range(caches)
            for b in range(blocks)
        ]
        copy_runs(*arrays(runs))
        # slot b holds page b of every cache, in cache order
        want = np.stack([x.reshape(blocks, PAGE) for x in src], axis=1).reshape(-1)
        assert np.array_equal(got, want)


def test_no_runs_copy_nothing() -> None:
    empty = np.zeros(0, dtype=np.int64)
    assert group_runs(empty, empty, empty).rows == []
    copy_runs(empty, empty, empty)

"""Copy runs as strided groups (``kvoffload.datapath.memruns``), against the runs one by one.

- Every group expands back to exactly the runs it was made of, in order.
- Runs that step alike become one group: one per cache for a job with a cache per layer.
- Copying the groups writes the same bytes as copying each run with memmove, for
  runs in any order, of mixed lengths and with negative steps: through the C copy loop
  and through the Python path it stands in for (``python_path``).
- The C loop is built wherever a compiler is; it streams long runs at any alignment
  and length, moves overlapping runs as memmove does, and refuses malformed vectors
  with a clear error before it copies anything.
"""

from __future__ import annotations

import array
import ctypes
import mmap
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.datapath import memruns
from kvoffload.datapath.memruns import (
    GROUP_MIN_RUNS,
    STREAM_MIN_BYTES,
    Groups,
    copy_groups,
    copy_runs,
    group_runs,
)

PAGE = 64


@pytest.fixture(params=["native", "python"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each copy test runs through the C loop (where built) and the Python path."""
    if request.param == "native" and not memruns.NATIVE:
        pytest.skip("the C copy loop is not built here")
    saved = memruns._native  # type: ignore[attr-defined]
    if request.param == "python":
        memruns._native = None  # type: ignore[attr-defined,assignment]
    try:
        yield request.param
    finally:
        memruns._native = saved  # type: ignore[attr-defined]


def expand(g: Groups) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
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


# the fixture only picks the path: the same for every example
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_grouped_copies_write_what_one_by_one_copies_write(path: str, data: st.DataObject) -> None:
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


def test_copy_runs_groups_only_jobs_of_many_runs(path: str) -> None:
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


def test_no_runs_copy_nothing(path: str) -> None:
    empty = np.zeros(0, dtype=np.int64)
    assert group_runs(empty, empty, empty).rows == []
    copy_runs(empty, empty, empty)


def test_the_c_copy_loop_is_built_where_a_compiler_is() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the Python path copies")
    assert memruns.NATIVE, "kvoffload.datapath._copyrun did not build: pip install -e ."


@pytest.mark.parametrize("path", ["native"], indirect=True)
@pytest.mark.parametrize(
    "length", [STREAM_MIN_BYTES - 1, STREAM_MIN_BYTES, 3 * STREAM_MIN_BYTES + 37]
)
@pytest.mark.parametrize("misalign", [0, 1, 15, 17])
def test_long_runs_stream_at_any_alignment_and_length(
    path: str, length: int, misalign: int
) -> None:
    rng = np.random.default_rng(length + misalign)
    src = rng.integers(0, 256, 2 * length + 64, dtype=np.uint8)
    got = np.zeros(2 * length + 128, dtype=np.uint8)
    base, sbase = int(got.ctypes.data) + misalign, int(src.ctypes.data) + 3
    # two runs swapped: the second source half lands first
    runs = [(base, sbase + length, length), (base + length + 7, sbase, length)]
    copy_runs(*arrays(runs))
    want = np.zeros_like(got)
    want[misalign : misalign + length] = src[3 + length : 3 + 2 * length]
    want[misalign + length + 7 : misalign + 2 * length + 7] = src[3 : 3 + length]
    assert np.array_equal(got, want)


@pytest.mark.parametrize("path", ["native"], indirect=True)
def test_overlapping_runs_move_as_memmove_does(path: str) -> None:
    n = 2 * STREAM_MIN_BYTES
    buf = np.arange(n + 4096, dtype=np.uint32).view(np.uint8)[: n + 4096].copy()
    want = buf.copy()
    at = int(buf.ctypes.data)
    copy_runs(*arrays([(at + 4096, at, n)]))  # forward overlap
    ctypes.memmove(int(want.ctypes.data) + 4096, int(want.ctypes.data), n)
    assert np.array_equal(buf, want)


@pytest.mark.parametrize("path", ["native"], indirect=True)
def test_the_c_loop_refuses_malformed_vectors_before_copying(path: str) -> None:
    native = memruns._native  # type: ignore[attr-defined]
    assert native is not None
    src = np.full(64, 7, dtype=np.uint8)
    got = np.zeros(64, dtype=np.uint8)
    d = np.array([got.ctypes.data], dtype=np.int64)
    s = np.array([src.ctypes.data], dtype=np.int64)
    with pytest.raises(ValueError, match="differ in length"):
        native.copy_runs(d, s, np.array([8, 8], dtype=np.int64), 0)
    with pytest.raises(TypeError, match="int64"):
        native.copy_runs(d, s, np.array([8], dtype=np.int32), 0)
    with pytest.raises(ValueError, match="negative run length"):
        native.copy_runs(d, s, np.array([-1], dtype=np.int64), 0)
    one = array.array("q", [1])
    with pytest.raises(ValueError, match="negative row count"):
        native.copy_groups(d, s, one, array.array("q", [-2]), one, one, 0)
    with pytest.raises(ValueError, match="stream_min_bytes"):
        native.copy_runs(d, s, np.array([8], dtype=np.int64), -1)
    assert not got.any()
    native.copy_runs(d, s, np.array([8], dtype=np.int64), 0)
    assert got[:8].tolist() == [7] * 8 and not got[8:].any()


def shrunk_memfd(nbytes: int) -> tuple[int, mmap.mmap]:
    """A mapped memfd of ``nbytes``, then shrunk to one page under its mapping."""
    fd = os.memfd_create("shrunk", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)
    mm[:] = b"\x05" * nbytes
    os.ftruncate(fd, mmap.PAGESIZE)
    return fd, mm


@pytest.mark.parametrize("path", ["native"], indirect=True)
@pytest.mark.parametrize("direction", ["from", "into"])
def test_a_guarded_copy_survives_memory_that_vanished(path: str, direction: str) -> None:
    """The memfd shrank under its mapping: a guarded copy from or into the vanished
    pages returns False (the runs before the fault copied); this process lives on,
    and the next guarded copy works."""
    n = 8 * STREAM_MIN_BYTES
    fd, mm = shrunk_memfd(n)
    try:
        at = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        mine = np.zeros(n, dtype=np.uint8)
        here = int(mine.ctypes.data)
        first = (here, at, mmap.PAGESIZE) if direction == "from" else (at, here, mmap.PAGESIZE)
        rest = (
            (here + n // 2, at + n // 2, n // 2)
            if direction == "from"
            else (at + n // 2, here + n // 2, n // 2)
        )
        assert memruns.copy_runs_guarded(*arrays([first, rest])) is False
        if direction == "from":
            assert mine[: mmap.PAGESIZE].tolist() == [5] * mmap.PAGESIZE  # before the fault
        assert memruns.copy_runs_guarded(*arrays([first])) is True
    finally:
        del at
        mm.close()
        os.close(fd)


@pytest.mark.parametrize("faulthandler_after", [False, True])
def test_a_fault_outside_a_guarded_copy_still_ends_the_process(faulthandler_after: bool) -> None:
    """The guard catches faults only on a guarded copy's thread while it copies: the
    same vanished memory read by a plain copy, after a guarded one installed the
    handler, kills the process with SIGBUS as before; also when Python's faulthandler
    was enabled after the handler and the next guarded copy put the handler back in
    front of it (the two hand the signal to each other once, then the process ends)."""
    if not memruns.NATIVE:
        pytest.skip("the C copy loop is not built here")
    later = (
        "import faulthandler; faulthandler.enable()\n"
        "assert memruns.copy_runs_guarded(v(buf.ctypes.data), v(at), v(1 << 20)) is False\n"
        if faulthandler_after
        else ""
    )
    code = f"""
import sys
sys.path[:0] = {sys.path!r}
import ctypes, mmap, os
import numpy as np
from kvoffload.datapath import memruns
fd = os.memfd_create("shrunk")
os.ftruncate(fd, 1 << 20)
mm = mmap.mmap(fd, 1 << 20)
os.ftruncate(fd, 0)
at = ctypes.addressof(ctypes.c_char.from_buffer(mm))
buf = np.zeros(1 << 20, dtype=np.uint8)
v = lambda *x: np.array(x, dtype=np.int64)
assert memruns.copy_runs_guarded(v(buf.ctypes.data), v(at), v(1 << 20)) is False
{later}print("guarded ok", flush=True)
memruns.copy_runs(v(buf.ctypes.data), v(at), v(1 << 20))
print("survived", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout == "guarded ok\n", proc.stderr
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.count("Fatal Python error") <= 2, proc.stderr[-2000:]

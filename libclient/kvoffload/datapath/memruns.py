"""CPU copy runs, executed: strided groups of runs as one numpy copy each.

Rules:
- Runs are (destination address, source address, bytes), as the copy planner makes
  them: no two runs write the same bytes, and their memory stays mapped while they
  run (the callers' guarantee). Nothing here checks addresses.
- Consecutive runs of one length whose addresses step by the same amounts on both
  sides form a group: the rows of two strided 2-D views, copied by one ``np.copyto``
  that holds the GIL once, not once per run. A lone run is one ``memmove``.
- A job with one cache per layer is such groups: one per cache, a row per block.
  Copied a run at a time, a 32 KiB page per Python call, two copier threads took
  turns on the GIL and moved ~7 GB/s together; as groups, ~10 GB/s (2 vCPUs).
- Grouping is numpy on the planner's arrays (no Python loop per run), for jobs of at
  least ``GROUP_MIN_RUNS`` runs: below, its fixed cost exceeds the memmoves'. It may leave
  two runs that could pair as two memmoves (a pair with an odd step next to a
  group), never put runs that step differently in one group. A planner that knows its
  groups (``JobPlan.groups``) hands them over as they are.
- A group's two views are numpy arrays over the process's address space (``_SPACE``),
  made by the ``ndarray`` constructor: ~1 us each, where ``__array_interface__`` took ~3.
- Where the C copy loop was built (``_copyrun``, optional at install), runs and groups
  go to it in one call each: no Python per run, no grouping needed, the GIL released
  once, and runs of ``STREAM_MIN_BYTES`` or more written with non-temporal stores. A
  32 KiB page copied by ``memmove`` goes through ``rep movsb`` or a cached loop at about
  half of one large memcpy (glibc streams only copies near the L3 size); streamed, at
  0.9 of it (2 vCPUs). Without it (or with ``KVOFFLOAD_NO_NATIVE_COPY=1`` in the
  environment), the numpy and ``memmove`` path below.
- A fresh mapping that copies will touch has its page tables filled in the background
  first (``populate_async``): the pages exist already (the region's, or an engine's
  memfd), but a copy that first touches them pays a page fault per 4 KiB.
"""

from __future__ import annotations

import array
import ctypes
import logging
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

try:
    from kvoffload.datapath import _copyrun as _native
except ImportError as exc:  # built where a compiler was found at install time
    logging.getLogger(__name__).info("no C copy loop (%s): copies take the Python path", exc)
    _native = None  # type: ignore[assignment]
BUILT = _native is not None  # whether the C copy loop was built
if os.environ.get("KVOFFLOAD_NO_NATIVE_COPY"):  # the Python path, as where not built
    _native = None  # type: ignore[assignment]

I64 = npt.NDArray[np.int64]
_memmove = ctypes.memmove
NATIVE = _native is not None  # whether the C copy loop runs the copies
# Runs this long or longer are streamed past the cache by the C loop: a KV page (the
# smallest is a few KiB per layer) is written once and read back much later, if ever.
STREAM_MIN_BYTES = 16 * 1024
# Grouping costs ~30 us of numpy whatever the count (2 vCPUs); a memmove from Python
# ~1 us: fewer runs than this are copied one by one.
GROUP_MIN_RUNS = 32


@dataclass(frozen=True)
class Groups:
    """Copy groups as Python lists (what a copy thread iterates): the first row's
    addresses, the row length, the row count and each side's step between rows."""

    dst: list[int]
    src: list[int]
    nbytes: list[int]
    rows: list[int]
    dst_step: list[int]
    src_step: list[int]

    @property
    def total_bytes(self) -> int:
        return sum(n * r for n, r in zip(self.nbytes, self.rows))

    @property
    def runs(self) -> int:
        """The runs the groups stand for."""
        return sum(self.rows)


def group_runs(dst: I64, src: I64, nbytes: I64) -> Groups:
    """The runs, in order, as strided groups (see the module's rules)."""
    count = nbytes.size
    if count < 2:
        return Groups(
            dst.tolist(), src.tolist(), nbytes.tolist(), [1] * count, [0] * count, [0] * count
        )
    dst_diff, src_diff = np.diff(dst), np.diff(src)
    # Link k joins runs k and k+1. A link can be inside a group when both runs have
    # one length and it steps as its neighbour link does (a lone odd step between two
    # groups is no group's). Where two groups meet, the run between goes to the left one.
    usable = nbytes[1:] == nbytes[:-1]
    alike = usable[1:] & usable[:-1] & (dst_diff[1:] == dst_diff[:-1])
    alike &= src_diff[1:] == src_diff[:-1]  # alike[k]: links k and k+1 step alike
    as_before = np.concatenate(([False], alike))
    kept = as_before | np.concatenate((alike, [False]))
    inside = kept & ~(~as_before & np.concatenate(([False], kept[:-1])))
    starts = np.flatnonzero(np.concatenate(([True], ~inside)))
    rows = np.diff(np.append(starts, count))
    step_at = np.minimum(starts, count - 2)  # a group's first link (lone runs: unused)
    many = rows > 1
    dst_step = np.where(many, dst_diff[step_at], 0)
    src_step = np.where(many, src_diff[step_at], 0)
    return Groups(
        dst[starts].tolist(),
        src[starts].tolist(),
        nbytes[starts].tolist(),
        rows.tolist(),
        dst_step.tolist(),
        src_step.tolist(),
    )


# The process's memory as one buffer: a view of any mapped address is an offset into it.
# It starts at the first page (nothing is mapped below mmap_min_addr) and ends at 2**57,
# the top of a 5-level page table's user space; numpy checks each view against it.
_SPACE_START = mmap.PAGESIZE
_SPACE = memoryview((ctypes.c_char * ((1 << 57) - _SPACE_START)).from_address(_SPACE_START))
_U8 = np.dtype(np.uint8)


def _rows(address: int, rows: int, nbytes: int, step: int) -> npt.NDArray[np.uint8]:
    """``rows`` rows of ``nbytes`` at ``address``, ``step`` bytes apart, as a 2-D view."""
    view: npt.NDArray[np.uint8] = np.ndarray(
        (rows, nbytes), _U8, _SPACE, address - _SPACE_START, (step, 1)
    )
    return view


def copy_groups(g: Groups) -> None:
    """Run the groups' copies (the GIL is released during each)."""
    if _native is not None:
        _native.copy_groups(
            _vector(g.dst), _vector(g.src), _vector(g.nbytes), _vector(g.rows),
            _vector(g.dst_step), _vector(g.src_step), STREAM_MIN_BYTES,
        )  # fmt: skip
        return
    for d, s, n, rows, d_step, s_step in zip(
        g.dst, g.src, g.nbytes, g.rows, g.dst_step, g.src_step
    ):
        if rows == 1:
            _memmove(d, s, n)
        else:
            np.copyto(_rows(d, rows, n, d_step), _rows(s, rows, n, s_step))


def runs_as_groups(dst: I64, src: I64, nbytes: I64) -> Groups:
    """The runs as groups: grouped when there are enough to pay for grouping, else a
    row of one each."""
    if nbytes.size >= GROUP_MIN_RUNS:
        return group_runs(dst, src, nbytes)
    ones, zeros = [1] * nbytes.size, [0] * nbytes.size
    return Groups(dst.tolist(), src.tolist(), nbytes.tolist(), ones, zeros, zeros)


def copy_runs(dst: I64, src: I64, nbytes: I64) -> None:
    """Copy the runs: in one C call, else grouped when there are enough to pay for
    grouping."""
    if _native is not None:
        _native.copy_runs(_vector(dst), _vector(src), _vector(nbytes), STREAM_MIN_BYTES)
        return
    copy_groups(runs_as_groups(dst, src, nbytes))


def copy_runs_guarded(dst: I64, src: I64, nbytes: I64) -> bool:
    """Copy the runs by the C loop, surviving memory that vanishes under it: False if
    a fault stopped the copy (the C loop must be built: ``NATIVE``)."""
    assert _native is not None, "copy_runs_guarded needs kvoffload.datapath._copyrun"
    return _native.copy_runs_guarded(_vector(dst), _vector(src), _vector(nbytes), STREAM_MIN_BYTES)


def _vector(values: I64 | list[int]) -> I64 | array.array[int]:
    """``values`` as a contiguous int64 buffer, without a copy where it is one; integers
    that int64 cannot hold exactly are refused."""
    if isinstance(values, list):
        return array.array("q", values)
    if values.dtype != np.int64 or not values.flags.c_contiguous:
        return np.ascontiguousarray(values.astype(np.int64, casting="safe", copy=False))
    return values


__all__ = [
    "NATIVE",
    "STREAM_MIN_BYTES",
    "Groups",
    "copy_groups",
    "copy_runs",
    "copy_runs_guarded",
    "group_runs",
    "runs_as_groups",
]


_log = logging.getLogger(__name__)
MADV_POPULATE_WRITE = 23  # Linux 5.14


def populate_async(address: int, nbytes: int) -> threading.Thread:
    """Fill this process's page tables for ``nbytes`` mapped at ``address``, in the
    background (``MADV_POPULATE_WRITE`` releases the GIL; a page that is gone fails the
    call with EFAULT, never a signal). Best effort: a 128-page client load took 25 ms
    before, 10.5 ms after, measured."""

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(address, nbytes, MADV_POPULATE_WRITE) != 0:
            _log.debug("madvise(MADV_POPULATE_WRITE): errno %d", ctypes.get_errno())

    thread = threading.Thread(target=run, name="kvoffload-populate", daemon=True)
    thread.start()
    return thread

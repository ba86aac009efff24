"""Which runs of a GPU transfer the copy kernel moves, and in what tiles: pure logic.

A GPU lane moves a transfer's runs either with the DMA engines (one descriptor per run:
``cuMemcpyBatchAsync``, or a ``cuMemcpyAsync`` loop) or with the gather kernel
(``gather.cu``: warps copy tiles through unified addressing). DMA descriptors cost about
the same whatever their size, so small runs leave the link idle; the kernel moves small
runs at link speed but occupies SMs. A start-up calibration on each device
(``calibrate.py``) times both methods, per direction, over a grid of run sizes and run
counts; ``choose`` picks per (direction, run size, run count).

Rules:
- Everything here is pure (numpy only) and unit-tested without a GPU.
- Only runs whose two addresses and length are multiples of ``ALIGN_BYTES`` may go to
  the kernel (its fast path; the calibration measured nothing else).
- Runs are grouped by size class (powers of two); each class goes to the method the
  calibration predicts faster for that many runs of that size. A prediction
  interpolates the measured times: linearly in the run count (extrapolated along the
  last measured segment), geometrically between the two nearest measured sizes.
- A kernel launch takes at most ``MAX_TILES`` tiles; a tile is at most ``tile_bytes``;
  a launch has ``WARPS_PER_CTA`` warps per CTA, one tile per warp at a time, and at
  most the calibrated number of CTAs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]

ALIGN_BYTES = 16
THREADS_PER_CTA = 256
WARPS_PER_CTA = THREADS_PER_CTA // 32
TILE_BYTES = 16 << 10
MAX_TILES = 1 << 15
# The calibration's grid: run sizes and run counts timed for each method and direction.
SIZES = (512, 2048, 8192, 32768, 131072, 524288, 2 << 20)
COUNTS = (1, 16, 256, 4096)
MODES = ("auto", "always", "off")
MEMO_ENTRIES = 4096  # predictions a device keeps


@dataclass(frozen=True)
class Timings:
    """Seconds one method took for ``counts[j]`` runs of ``sizes[i]`` bytes (NaN: not
    measured, as where the scratch buffers cannot hold that many runs)."""

    sizes: tuple[int, ...]
    counts: tuple[int, ...]
    seconds: npt.NDArray[np.float64]  # (len(sizes), len(counts))

    def predict(self, size: float, count: int) -> float:
        """Predicted seconds for ``count`` runs of ``size`` bytes."""
        logs = np.log2(np.asarray(self.sizes, dtype=np.float64))
        x = float(np.log2(max(size, 1.0)))
        hi = int(np.clip(np.searchsorted(logs, x), 1, len(logs) - 1)) if len(logs) > 1 else 0
        lo = max(hi - 1, 0)
        a, b = self._in_row(lo, count), self._in_row(hi, count)
        if hi == lo or logs[hi] == logs[lo]:
            return a
        frac = float(np.clip((x - logs[lo]) / (logs[hi] - logs[lo]), 0.0, 1.0))
        return float(np.exp((1 - frac) * np.log(a) + frac * np.log(b)))

    def _in_row(self, i: int, count: int) -> float:
        row = self.seconds[i]
        ok = ~np.isnan(row)
        c = np.asarray(self.counts, dtype=np.float64)[ok]
        t = row[ok]
        if c.size == 0:
            return float("inf")
        if c.size == 1:
            return float(t[0] * max(count, 1) / c[0])
        if count <= c[-1]:
            value = float(np.interp(count, c, t))
        else:  # beyond the last measured count: the last segment's slope
            slope = (t[-1] - t[-2]) / (c[-1] - c[-2])
            value = float(t[-1] + max(slope, 0.0) * (count - c[-1]))
        return max(value, 1e-9)


@dataclass(frozen=True)
class DeviceChoice:
    """One device's calibrated choice: per direction (``to_host``) the timings of both
    methods and the CTAs a launch may use."""

    kernel: dict[bool, Timings]
    dma: dict[bool, Timings]
    max_ctas: dict[bool, int]
    tile_bytes: int = TILE_BYTES
    # per direction, the smallest size class (bytes) at which DMA is predicted faster
    # for 256 runs: the crossover the stats report
    crossover_bytes: dict[bool, int] = field(default_factory=dict)

    # predictions already made: a lane asks the same few questions job after job
    _memo: dict[tuple[bool, float, int], bool] = field(
        default_factory=dict, compare=False, repr=False
    )

    def kernel_faster(self, to_host: bool, size: float, count: int) -> bool:
        key = (to_host, size, count)
        faster = self._memo.get(key)
        if faster is None:
            if len(self._memo) >= MEMO_ENTRIES:
                self._memo.clear()
            k, d = self.kernel[to_host], self.dma[to_host]
            faster = self._memo[key] = k.predict(size, count) < d.predict(size, count)
        return faster


def aligned(dst: I64, src: I64, nbytes: I64) -> Bools:
    out: Bools = ((dst | src | nbytes) & (ALIGN_BYTES - 1)) == 0
    return out


def kernel_runs(
    choice: DeviceChoice | None, to_host: bool, dst: I64, src: I64, nbytes: I64
) -> Bools:
    """Which runs go to the kernel: ``choice`` None means every aligned run ("always")."""
    ok = aligned(dst, src, nbytes) & (nbytes > 0)
    n_ok = int(np.count_nonzero(ok))
    if choice is None or n_ok == 0:
        return ok
    sizes = nbytes if n_ok == nbytes.size else nbytes[ok]
    lo, hi = int(sizes.min()), int(sizes.max())
    if lo.bit_length() == hi.bit_length():  # one size class (pages, fragments): one choice
        mean = float(lo) if lo == hi else float(sizes.mean())
        return ok if choice.kernel_faster(to_host, mean, n_ok) else np.zeros(ok.size, dtype=bool)
    size_class = np.zeros(nbytes.size, dtype=np.int64)
    size_class[ok] = np.floor(np.log2(nbytes[ok])).astype(np.int64)
    out = np.zeros(nbytes.size, dtype=bool)
    for c in np.unique(size_class[ok]).tolist():
        members = ok & (size_class == c)
        count = int(members.sum())
        mean = float(nbytes[members].mean())
        if choice.kernel_faster(to_host, mean, count):
            out |= members
    return out


def crossover(choice_kernel: Timings, choice_dma: Timings, count: int = 256) -> int:
    """The smallest grid size from which on DMA is predicted no slower (0: never)."""
    for size in choice_kernel.sizes:
        if all(
            choice_dma.predict(s, count) <= choice_kernel.predict(s, count)
            for s in choice_kernel.sizes
            if s >= size
        ):
            return size
    return 0


def tiles(dst: I64, src: I64, nbytes: I64, tile_bytes: int) -> tuple[I64, I64, I64]:
    """Runs cut into tiles of at most ``tile_bytes`` (a multiple of ALIGN_BYTES), in
    order; every byte once, each tile at its run's matching offset on both sides."""
    if nbytes.size == 0 or int(nbytes.max()) <= tile_bytes:
        return dst, src, nbytes
    pieces = (nbytes + tile_bytes - 1) // tile_bytes
    idx = np.repeat(np.arange(nbytes.size), pieces)
    k = np.arange(idx.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    shift = k * tile_bytes
    return dst[idx] + shift, src[idx] + shift, np.minimum(nbytes[idx] - shift, tile_bytes)


def grid_ctas(num_tiles: int, max_ctas: int) -> int:
    """CTAs of one launch: enough for a warp per tile, at most ``max_ctas``."""
    return max(1, min(max_ctas, -(-num_tiles // WARPS_PER_CTA)))


def fill(out: npt.NDArray[np.uint64], dst: I64, src: I64, nbytes: I64) -> None:
    """Write the kernel's tile records (dst, src, nbytes), as gather.cu's ``Tile``,
    into ``out`` (a launch's descriptor buffer) in place."""
    out[:, 0], out[:, 1], out[:, 2] = dst, src, nbytes

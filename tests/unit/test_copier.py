"""CpuCopier: small jobs are copied at once on the caller's thread, large ones by the
copier threads; both complete through the sink, bytes exact."""

from __future__ import annotations

import select

import numpy as np

from kvoffloadd.copies.copier import CpuCopier


def addrs(a: np.ndarray, offsets: list[int]) -> np.ndarray:
    return np.asarray([a.ctypes.data + o for o in offsets], dtype=np.int64)


def test_small_jobs_complete_inline_and_large_ones_on_threads() -> None:
    copier = CpuCopier(2)
    try:
        src = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        n = np.asarray([4096, 4096], dtype=np.int64)
        copier.submit(1, addrs(dst, [0, 8192]), addrs(src, [4096, 0]), n)
        done = copier.drain()  # already there: no thread was involved
        assert [(c.token, c.success, c.nbytes) for c in done] == [(1, True, 8192)]
        assert (dst[:4096] == src[4096:8192]).all() and (dst[8192:12288] == src[:4096]).all()
        big = np.asarray([src.size], dtype=np.int64)
        copier.submit(2, addrs(dst, [0]), addrs(src, [0]), big)
        got = []
        while not got:
            assert select.select([copier.wake_fd], [], [], 10)[0], "large copy never finished"
            got = copier.drain()
        assert got[0].token == 2 and got[0].success and (dst == src).all()
    finally:
        copier.close()

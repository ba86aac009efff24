"""The heap measure the leak tests use counts what the test's calls hold, whatever
other threads allocate meanwhile."""

from __future__ import annotations

import threading

from heap import OwnHeap


def _deep(n: int, out: list[bytes]) -> None:
    if n:
        _deep(n - 1, out)
    else:
        out.append(bytes(100_000))


def test_own_allocations_count_even_deep_down_and_other_threads_do_not() -> None:
    kept: list[bytes] = []
    stray: list[bytes] = []
    with OwnHeap() as heap:
        _deep(8, kept)  # as deep as the index's calls under a test go
        # what a leftover client's keeper does: allocate on a thread of its own, from
        # code of another file (a lambda here would be this file's code)
        worker = threading.Thread(target=stray.extend, args=(map(bytes, [300_000]),))
        worker.start()
        worker.join()
        grown = heap.grown_bytes()
    assert 100_000 <= grown < 110_000, grown
    assert len(stray[0]) == 300_000

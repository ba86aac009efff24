"""What a test's own calls leave allocated, counted by tracemalloc.

``tracemalloc``'s process-wide totals count every thread's allocations, so a thread
left behind by an earlier test (a client's keeper retrying its handshake, say) shows
up in a test that measures a leak. ``OwnHeap`` counts only the allocations with the
measuring test's file in their traceback: those its own calls made, on its thread.
"""

from __future__ import annotations

import inspect
import tracemalloc
from types import TracebackType

FRAMES = 16  # deep enough to reach the test's frame from the allocations it measures


class OwnHeap:
    """``with OwnHeap() as heap: ...; heap.grown_bytes()``: bytes allocated since the
    block began, by calls made from the calling test's file, and still held."""

    def __init__(self) -> None:
        caller = inspect.stack()[1].filename
        self._filters = [tracemalloc.Filter(True, caller, all_frames=True)]
        self._base = 0

    def _held(self) -> int:
        snapshot = tracemalloc.take_snapshot().filter_traces(self._filters)
        return sum(t.size for t in snapshot.traces)

    def __enter__(self) -> OwnHeap:
        tracemalloc.start(FRAMES)
        self._base = self._held()
        return self

    def grown_bytes(self) -> int:
        return self._held() - self._base

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        tracemalloc.stop()

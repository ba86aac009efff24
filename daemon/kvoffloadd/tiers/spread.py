"""A tier's threads: its I/O threads (``[[tiers]] threads``, ``JobThreads``) run its
jobs; its promotion threads (``tier_threads``, ``TierThreads``) take the blocks of a
promotion spread over them, each copied into its region slot and its MAC verified there.

Rules:
- Every tier thread is a daemon thread, started with its tier (the loop thread spawns
  none), and closing waits a bounded time for it: one stuck in I/O (a hung filesystem,
  a C library that never returns) is left behind and ``close`` says so; it never holds
  up the daemon's stop or its exit.
- ``JobThreads`` run a tier's jobs in the order they were submitted; ``close`` drops
  the jobs not yet started. A tier's job catches its own faults and always posts its
  result; one that raises all the same is logged, and never finishing, leaves its
  tier stalled (tiering.py) until the daemon restarts.
- Each tier has its own threads, so a hung tier (a dead disk) holds only its own;
  a tier's I/O threads (``[[tiers]] threads``) are apart from these.
- Work is handed over as a *spread*: ``n`` blocks and a function of a block's index.
  Idle threads take the next blocks of the oldest spread, ``take_blocks`` at a time
  (one 2 MiB block; several small ones, so a take is worth waking a thread for), so
  every thread works on one job until its blocks are all taken. A spread may be
  released bit by bit (``Spread.release``) as a tier's I/O thread receives its blocks.
- A block's result is what its function answered, or ``None`` when it raised (logged
  once per spread) or never ran (the threads stopped): a block that failed on any
  thread fails closed. ``done`` gets every result, once, on the thread that finished
  the last block (or the caller's, for a spread of no blocks).
- ``TierThreads.close`` fails the spreads' blocks not yet taken.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
Job = tuple[Callable[..., None], tuple[Any, ...]]
TAKE_BYTES = 1 << 20  # a thread takes at least this many bytes of small blocks at once


def join_all(threads: Sequence[threading.Thread], timeout_s: float) -> bool:
    """Wait at most ``timeout_s`` in all for ``threads`` (one never started counts as
    stopped); False if one is still alive."""
    deadline = time.monotonic() + timeout_s
    for t in threads:
        if t.is_alive():
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


class JobThreads:
    """``count`` threads that run one tier's jobs (named after it)."""

    def __init__(self, count: int, name: str) -> None:
        self.name = name
        self._cv = threading.Condition(threading.Lock())
        self._queue: deque[Job] = deque()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._serve, name=f"kvoffload-{name}-{i}", daemon=True)
            for i in range(count)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        with self._cv:
            if not self._stopping:
                self._queue.append((fn, args))
                self._cv.notify()

    def close(self, timeout_s: float) -> bool:
        """Drop the jobs not started; False if a thread is still busy after
        ``timeout_s`` (stuck in I/O: left behind)."""
        with self._cv:
            self._stopping = True
            self._queue.clear()
            self._cv.notify_all()
        return join_all(self._threads, timeout_s)

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                fn, args = self._queue.popleft()
            try:
                fn(*args)
            except Exception:  # a tier fault stays inside the tier
                log.exception("tier %s: a job failed", self.name)


def take_blocks(n: int, block_bytes: int, threads: int) -> int:
    """Blocks one thread takes at a time from a spread of ``n``: enough for
    ``TAKE_BYTES``, but never so many that a thread would be left without any."""
    per_take = max(1, TAKE_BYTES // max(1, block_bytes))
    fair = -(-n // max(1, threads))  # ceil(n / threads)
    return max(1, min(per_take, fair))


class Spread(Generic[T]):
    """One job's blocks on a tier's threads (made by ``TierThreads.spread``)."""

    def __init__(
        self,
        owner: TierThreads,
        n: int,
        step: int,
        work: Callable[[int], T],
        done: Callable[[list[T | None]], None],
    ) -> None:
        self._owner = owner
        self.n = n
        self.step = step
        self.work = work
        self.done = done
        self.results: list[T | None] = [None] * n
        self.taken = 0  # blocks handed to threads so far
        self.ready = 0  # blocks that may be taken (``release``)
        self.left = n  # blocks not finished
        self.logged = False

    def release(self, ready: int) -> None:
        """Blocks below ``ready`` may be taken from now on."""
        self._owner.release(self, ready)


class Started(Generic[T]):
    """A spread its tier thread releases and waits for (``TierThreads.started``)."""

    def __init__(
        self, owner: TierThreads, n: int, block_bytes: int, work: Callable[[int], T]
    ) -> None:
        self._finished = threading.Event()
        self._results: list[T | None] = []
        self._spread = owner.spread(n, block_bytes, work, self._done, ready=0)

    def _done(self, results: list[T | None]) -> None:
        self._results = results
        self._finished.set()

    def release(self, ready: int) -> None:
        """Blocks below ``ready`` may be taken from now on."""
        self._spread.release(ready)

    def wait(self) -> list[T | None]:
        """Every block's result, once all are released and run (or failed)."""
        self._finished.wait()
        return self._results


class TierThreads:
    """``count`` threads that run spreads for one tier (named after it)."""

    def __init__(self, count: int, name: str) -> None:
        if count < 1:
            raise ValueError(f"tier_threads: {count} is below 1")
        self.count = count
        self.name = name
        self._cv = threading.Condition(threading.Lock())
        self._queue: deque[Spread[Any]] = deque()  # spreads with blocks ready to take
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._serve, name=f"kvoffload-{name}-promote{i}")
            for i in range(count)
        ]
        for t in self._threads:
            t.daemon = True  # a thread stuck in a hung filesystem must not hold up the exit
            t.start()

    def spread(
        self,
        n: int,
        block_bytes: int,
        work: Callable[[int], T],
        done: Callable[[list[T | None]], None],
        ready: int | None = None,
    ) -> Spread[T]:
        """Run ``work(i)`` for each block ``i < n`` on the threads; ``done`` gets the
        results. ``ready``: blocks that may start now (all by default; ``release`` the
        rest)."""
        sp = Spread(self, n, take_blocks(n, block_bytes, self.count), work, done)
        if n == 0:
            done([])
            return sp
        self.release(sp, n if ready is None else ready)
        return sp

    def run(self, n: int, block_bytes: int, work: Callable[[int], T]) -> list[T | None]:
        """``spread``, waited for: from a tier's own thread, never one of these."""
        started = self.started(n, block_bytes, work)
        started.release(n)
        return started.wait()

    def started(self, n: int, block_bytes: int, work: Callable[[int], T]) -> Started[T]:
        """A ``spread`` with no block ready yet, for a tier's own thread to ``release``
        bit by bit (as it learns where each block is) and ``wait`` for."""
        return Started(self, n, block_bytes, work)

    def release(self, sp: Spread[Any], ready: int) -> None:
        with self._cv:
            ready = min(ready, sp.n)
            if ready <= sp.ready:
                return
            failed = ready - sp.ready if self._stopping else 0
            if failed:
                sp.ready = sp.taken = ready
            else:
                if sp.taken == sp.ready:  # not queued: nothing was waiting to be taken
                    self._queue.append(sp)
                sp.ready = ready
                self._cv.notify(-(-(ready - sp.taken) // sp.step))
        if failed:
            self._finish(sp, failed)

    def close(self, timeout_s: float) -> bool:
        """Stop the threads: blocks not yet taken fail. False if a thread is still busy
        after ``timeout_s`` (stuck in I/O: left behind)."""
        with self._cv:
            self._stopping = True
            dropped = [(sp, sp.ready - sp.taken) for sp in self._queue]
            self._queue.clear()
            for sp, _ in dropped:
                sp.taken = sp.ready
            self._cv.notify_all()
        for sp, count in dropped:
            self._finish(sp, count)
        return join_all(self._threads, timeout_s)

    # ------------------------------------------------------------ the threads

    def _next(self) -> tuple[Spread[Any], int, int] | None:
        """The next blocks to run, waiting for them; None once stopping."""
        with self._cv:
            while not self._queue:
                if self._stopping:
                    return None
                self._cv.wait()
            sp = self._queue[0]
            first = sp.taken
            sp.taken = min(sp.ready, first + sp.step)
            if sp.taken == sp.ready:
                self._queue.popleft()  # back in the queue if more are released
            return sp, first, sp.taken - first

    def _serve(self) -> None:
        while (item := self._next()) is not None:
            sp, first, count = item
            for i in range(first, first + count):
                try:
                    sp.results[i] = sp.work(i)
                except Exception as exc:  # a block that raised fails closed
                    if not sp.logged:
                        sp.logged = True
                        log.warning("tier %s: a block failed on its thread: %r", self.name, exc)
            self._finish(sp, count)

    def _finish(self, sp: Spread[Any], count: int) -> None:
        with self._cv:
            sp.left -= count
            last = sp.left == 0
        if last:
            sp.done(sp.results)

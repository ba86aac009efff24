"""Who the loop serves next: fair queueing of connections by the loop time they use.

Every connection with work waits in one queue. The loop serves one unit of work at a
time (one request, or one slice of a large engine batch). Each connection has a *start
tag*: the loop time it has used, on a clock that starts where the queue is when the
connection becomes busy (the start tag of the unit served last), never below, so time
it did not use while idle is not banked. It is served in order of its start tag plus
the unit's *estimated* cost (``estimate_s``, from the bytes it waits to have handled),
and charged what the unit really took. So a connection with a small request is served
before any number of connections with large ones that became busy at the same time,
and within one unit of anyone else's otherwise: another client's round trip is bounded
by the costliest single unit, not by the number of busy connections (DESIGN.md
invariant 15). A loop turn serves units until it has spent ``TURN_S`` (budgets.py) in
total, then polls for input, completions and timers.

Rules:
- Pure bookkeeping on the loop thread, O(log n) per unit.
- A connection is in the queue at most once; ``drop`` forgets it (closed).
"""

from __future__ import annotations

import heapq
import itertools

BASE_COST_S = 20e-6  # a request's estimated cost, plus per byte of it:
COST_PER_BYTE_S = 20e-9  # (a 1 MiB engine batch: about 20 ms)


def estimate_s(nbytes: int) -> float:
    """What handling ``nbytes`` of requests is expected to cost the loop."""
    return BASE_COST_S + nbytes * COST_PER_BYTE_S


class TurnQueue:
    def __init__(self) -> None:
        # (start tag + estimated cost, order, connection, start tag)
        self._heap: list[tuple[float, int, int, float]] = []
        self._queued: set[int] = set()
        self._finish: dict[int, float] = {}  # connection -> tag its next unit starts at
        self._order = itertools.count()
        self.vtime = 0.0  # start tag of the unit served last

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, conn: int) -> bool:
        return conn in self._queued

    def wake(self, conn: int, nbytes: int = 0) -> None:
        """``conn`` has ``nbytes`` of work: queue it (no-op if queued already)."""
        if conn in self._queued:
            return
        tag = max(self._finish.get(conn, 0.0), self.vtime)
        self._queued.add(conn)
        heapq.heappush(self._heap, (tag + estimate_s(nbytes), next(self._order), conn, tag))

    def next(self) -> int | None:
        """The connection to serve now (taken out of the queue), or None."""
        while self._heap:
            _, _, conn, tag = heapq.heappop(self._heap)
            if conn in self._queued:
                self._queued.discard(conn)
                self.vtime = tag
                self._finish[conn] = tag
                return conn
        return None

    def served(self, conn: int, cost_s: float, more: int) -> None:
        """``conn``'s unit took ``cost_s`` of the loop; ``more``: the bytes of work it
        has left (0: none)."""
        if conn not in self._finish:
            return  # dropped meanwhile
        self._finish[conn] += cost_s
        if more:
            self.wake(conn, more)

    def drop(self, conn: int) -> None:
        self._queued.discard(conn)  # its heap entry is skipped when popped
        self._finish.pop(conn, None)
        if not self._queued:
            self._heap.clear()

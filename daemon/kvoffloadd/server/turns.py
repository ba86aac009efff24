"""Who the loop serves next: small requests first, and the loop's time shared fairly.

Every connection with work waits in one queue. The loop serves one unit of work at a
time (one request, one slice of a large engine batch, or the clean-up of a connection
that left), never more than ``TURN_S`` (budgets.py) in one turn before it polls again
for input, completions and timers.

A unit is *light* when its estimated cost (``estimate_s``: from the bytes it has to
handle) is below ``LIGHT_S``, else *heavy*. Light and heavy units wait apart and take
turns by the loop time each class used in this turn: whenever heavy units have used
more of the turn than light ones, a waiting light unit goes next. So a client sending
small requests (a ping, an engine's usual step batch, a lookup) waits for at most one
heavy unit, however many connections flood the loop with large ones, and heavy units
still get half the loop while light ones keep coming (DESIGN.md invariant 15).

Within a class, connections are served by start-time fair queueing: each has a start
tag (the loop time it has used, on a clock that starts where the class is when the
connection becomes busy, never below: time it did not use while idle is not banked)
and goes in the order of its tag plus the unit's estimated cost, then is charged what
the unit really took.

Rules:
- Pure bookkeeping on the loop thread, O(log n) per unit.
- A connection is in the queue at most once; ``drop`` forgets it (closed).
"""

from __future__ import annotations

import heapq
import itertools

BASE_COST_S = 20e-6  # a request's estimated cost, plus per byte of it:
COST_PER_BYTE_S = 20e-9  # (a 1 MiB engine batch: about 20 ms)
LIGHT_S = 1e-3  # units estimated below this are light


def estimate_s(nbytes: int) -> float:
    """What handling ``nbytes`` of requests is expected to cost the loop."""
    return BASE_COST_S + nbytes * COST_PER_BYTE_S


class _FairQueue:
    """Start-time fair queueing of the connections of one class."""

    def __init__(self) -> None:
        # (start tag + estimated cost, order, connection, start tag)
        self._heap: list[tuple[float, int, int, float]] = []
        self._order = itertools.count()
        self.vtime = 0.0  # start tag of the unit served last

    def push(self, conn: int, finish: float, cost_s: float) -> None:
        tag = max(finish, self.vtime)
        heapq.heappush(self._heap, (tag + cost_s, next(self._order), conn, tag))

    def pop(self, queued: dict[int, int]) -> tuple[int, float] | None:
        """The next connection still queued here, and its start tag."""
        me = id(self)
        while self._heap:
            _, _, conn, tag = heapq.heappop(self._heap)
            if queued.get(conn) == me:
                self.vtime = tag
                return conn, tag
        return None

    def __bool__(self) -> bool:
        return bool(self._heap)


class TurnQueue:
    def __init__(self) -> None:
        self._light, self._heavy = _FairQueue(), _FairQueue()
        self._queued: dict[int, int] = {}  # connection -> id of the class it waits in
        self._finish: dict[int, float] = {}  # connection -> tag its next unit starts at
        self._class_of_last: dict[int, _FairQueue] = {}
        self.light_s = self.heavy_s = 0.0  # loop time each class used in this turn

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, conn: int) -> bool:
        return conn in self._queued

    def new_turn(self) -> None:
        self.light_s = self.heavy_s = 0.0

    def wake(self, conn: int, nbytes: int = 0) -> None:
        """``conn`` has ``nbytes`` of work: queue it (no-op if queued already)."""
        if conn in self._queued:
            return
        cost_s = estimate_s(nbytes)
        q = self._light if cost_s < LIGHT_S else self._heavy
        self._queued[conn] = id(q)
        q.push(conn, self._finish.get(conn, 0.0), cost_s)

    def next(self) -> int | None:
        """The connection to serve now (taken out of the queue), or None."""
        light_first = self.light_s <= self.heavy_s
        for q in (self._light, self._heavy) if light_first else (self._heavy, self._light):
            got = q.pop(self._queued)
            if got is not None:
                conn, tag = got
                del self._queued[conn]
                self._finish[conn] = tag
                self._class_of_last[conn] = q
                return conn
        return None

    def served(self, conn: int, cost_s: float, more: int) -> None:
        """``conn``'s unit took ``cost_s`` of the loop; ``more``: the bytes of work it
        has left (0: none)."""
        q = self._class_of_last.pop(conn, None)
        if q is self._light:
            self.light_s += cost_s
        else:
            self.heavy_s += cost_s
        if conn not in self._finish:
            return  # dropped meanwhile
        self._finish[conn] += cost_s
        if more:
            self.wake(conn, more)

    def drop(self, conn: int) -> None:
        self._queued.pop(conn, None)  # its heap entry is skipped when popped
        self._finish.pop(conn, None)
        self._class_of_last.pop(conn, None)

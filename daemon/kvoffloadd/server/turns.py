"""Who the loop serves next: the uid, then the connection, that used the least of it lately.

Every connection with work waits in one queue. The loop serves one unit of work at a
time (one request, one slice of a large engine batch, or the release of what a
connection that left held), never more than ``TURN_S`` (budgets.py) in one turn before
it polls again for input, completions and timers.

The next unit is the one of the connection whose uid, and then which itself, has used
the least loop time lately (least attained service): what each unit took is added to
its connection's and its uid's *usage*, which decay by half every ``HALF_LIFE_S``, and
a connection waits in the order of its uid's usage plus its own plus the unit's
estimated cost (``estimate_s``: from the bytes it has to handle, so among connections
that have used nothing yet the smallest request goes first). So a tenant's clients go
before any uid's that has been keeping the loop busy, however many connections it
floods the loop with, large requests or small (DESIGN.md invariant 15: opening more
connections buys no more of the loop); uids that keep it busy share it equally, and so
do the connections of one uid.

A uid that comes (back) with work starts no further than ``LEAD_S`` behind the least
usage of the uids active now (waiting, or served within ``ACTIVE_S``): a client that has
been pinging without pause for seconds has a large usage, and a newcomer starting from
nothing would otherwise be served alone until it had used as much, for as long as
hundreds of milliseconds. So a newcomer goes first for ``LEAD_S`` at most, and then the
two take turns.

Rules:
- Pure bookkeeping on the loop thread: O(log n) per unit, plus a look at each uid with
  work waiting, and at each uid seen when a uid comes with work (a node has few).
- A connection is in the queue at most once; ``drop`` forgets it (closed).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable

BASE_COST_S = 20e-6  # a request's estimated cost, plus per byte of it:
COST_PER_BYTE_S = 20e-9  # (a 1 MiB engine batch: about 20 ms)
HALF_LIFE_S = 0.5  # a connection's usage halves in this long
LEAD_S = 0.01  # how far behind the active uids' least usage a uid coming with work starts
ACTIVE_S = 0.05  # a uid served this recently is active (its client is between requests)


def estimate_s(nbytes: int) -> float:
    """What handling ``nbytes`` of requests is expected to cost the loop."""
    return BASE_COST_S + nbytes * COST_PER_BYTE_S


class TurnQueue:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._order = itertools.count()
        # uid -> its connections with work: (their usage + estimate, order, connection)
        self._waiting: dict[int, list[tuple[float, int, int]]] = {}
        self._queued: set[int] = set()
        self._usage: dict[int, tuple[float, float]] = {}  # conn -> (usage_s, as of)
        self._uid_usage: dict[int, tuple[float, float]] = {}  # uid -> (usage_s, as of)
        self._uid_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, conn: int) -> bool:
        return conn in self._queued

    def _decayed(self, entry: tuple[float, float] | None) -> float:
        if entry is None or not entry[0]:
            return 0.0
        used, at = entry
        return float(used * 2.0 ** ((at - self._clock()) / HALF_LIFE_S))

    def usage_s(self, conn: int) -> float:
        """The loop time ``conn`` has used lately (decayed to now)."""
        return self._decayed(self._usage.get(conn))

    def wake(self, conn: int, nbytes: int = 0, uid: int | None = None) -> None:
        """``conn`` (of ``uid``, given once) has ``nbytes`` of work: queue it (no-op
        if queued already)."""
        if uid is not None:
            self._uid_of.setdefault(conn, uid)
        if conn in self._queued:
            return
        self._queued.add(conn)
        key = self.usage_s(conn) + estimate_s(nbytes)
        uid = self._uid_of.get(conn, -1)
        if uid not in self._waiting:
            self._start_near_the_active(uid)
        heap = self._waiting.setdefault(uid, [])
        heapq.heappush(heap, (key, next(self._order), conn))

    def _start_near_the_active(self, uid: int) -> None:
        """``uid`` comes with work: raise its usage to ``LEAD_S`` below the least of the
        other active uids', if it is lower."""
        now = self._clock()
        floor = min(
            (
                self._decayed(entry)
                for other, entry in self._uid_usage.items()
                if other != uid and (other in self._waiting or now - entry[1] < ACTIVE_S)
            ),
            default=0.0,
        )
        if floor - LEAD_S > self._decayed(self._uid_usage.get(uid)):
            self._uid_usage[uid] = (floor - LEAD_S, now)

    def next(self) -> int | None:
        """The connection to serve now (taken out of the queue), or None: of the uids
        with work, the one that used the least lately (decay keeps their order, so
        each is weighed now), then its connection that did."""
        while self._waiting:
            uid = min(self._waiting, key=lambda u: (self._decayed(self._uid_usage.get(u)), u))
            heap = self._waiting[uid]
            _, _, conn = heapq.heappop(heap)
            if not heap:
                del self._waiting[uid]
            if conn in self._queued:
                self._queued.discard(conn)
                return conn
        return None

    def served(self, conn: int, cost_s: float, more: int, uid: int | None = None) -> None:
        """``conn`` (of ``uid``, if not woken before)'s unit took ``cost_s`` of the
        loop; ``more``: the bytes of work it has left (0: none)."""
        if uid is not None:
            self._uid_of.setdefault(conn, uid)
        now = self._clock()
        self._usage[conn] = (self.usage_s(conn) + cost_s, now)
        uid = self._uid_of.get(conn, -1)
        self._uid_usage[uid] = (self._decayed(self._uid_usage.get(uid)) + cost_s, now)
        if more:
            self.wake(conn, more)

    def drop(self, conn: int) -> None:
        self._queued.discard(conn)  # its heap entry is skipped when popped
        self._usage.pop(conn, None)
        self._uid_of.pop(conn, None)

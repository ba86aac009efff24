"""Who the loop serves next: the uid, then the connection, that used the least of it lately.

Every connection with work waits in one queue. The loop serves one unit of work at a
time (one request, one slice of a large engine batch, or the release of what a
connection that left held) until ``TURN_S`` (budgets.py) is spent in the turn, then at
most the unit in progress and one more, and polls again for input, completions and
timers.

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

A connection that comes back with work starts no further than ``CONN_LEAD_S`` ahead of
where its uid's queue stands (the usage, plus estimate, of the unit of that uid served
last), and one new to the loop as far behind it. Starting at nothing, a new connection
would be served alone until it had used as much as the uid's busy ones had, and a
process that opens 30 connections of an engine's uid would hold that engine's next
request behind 30 times its usage (110 ms measured): they take turns at once instead.
The lead lets a light client of a busy uid (a ping among 30 connections that keep the
loop busy) go next, not after a round of theirs; newcomers start behind, or each would
take a lead's worth before everyone else.

A uid that comes (back) with work starts no further than ``LEAD_S`` behind the least
usage of the uids active now (waiting, or served within ``ACTIVE_S``): a client that has
been pinging without pause for seconds has a large usage, and a newcomer starting from
nothing would otherwise be served alone until it had used as much, for as long as
hundreds of milliseconds. So a newcomer goes first for ``LEAD_S`` at most, and then the
two take turns. Work of no connection (``HOUSEKEEPING_UID``: releasing what connections
that left held) is no newcomer: it starts level with the active uids, not ahead, so a
burst of leavers does not hold a client's next request for a lead's worth of releases.

Decay costs nothing per unit: halving everyone's usage every ``HALF_LIFE_S`` orders
them as doubling the weight of new usage every ``HALF_LIFE_S`` does, so usage is kept
in units weighed ``2 ** (t / HALF_LIFE_S)`` at the time ``t`` it was used (the weight
refreshed at most every ``WEIGH_EVERY_S``), and only compared or divided by the current
weight; all of it is rescaled once the weight passes ``RESCALE_AT``.

Rules:
- Pure bookkeeping on the loop thread: O(log n) per unit, plus a look at each uid with
  work waiting, and at each uid seen when a uid comes with work (a node has few); a
  rescale, every ~``HALF_LIFE_S * log2(RESCALE_AT)``, is O(connections + uids) and
  forgets uids whose usage has decayed to nothing.
- A connection is in the queue at most once; ``drop`` forgets it (closed).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable

BASE_COST_S = 20e-6  # a request's estimated cost, plus per byte of it:
COST_PER_BYTE_S = 20e-9  # (a 1 MiB engine batch: about 20 ms)
HALF_LIFE_S = 0.5  # a connection's usage halves in this long
LEAD_S = 0.01  # how far behind the active uids' least usage a uid coming with work starts
CONN_LEAD_S = 0.001  # how far ahead of its uid's queue a connection coming with work starts
ACTIVE_S = 0.05  # a uid served this recently is active (its client is between requests)
WEIGH_EVERY_S = 0.001  # how stale the weight of new usage may be (0.14% at most)
RESCALE_AT = 2.0**32  # the weight at which all usage is rescaled (every 16 s)
FORGET_S = 1e-9  # usage decayed below this is nothing
HOUSEKEEPING_UID = -1  # the uid of work no connection is queued for (no lead)


def estimate_s(nbytes: int) -> float:
    """What handling ``nbytes`` of requests is expected to cost the loop."""
    return BASE_COST_S + nbytes * COST_PER_BYTE_S


class TurnQueue:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._order = itertools.count()
        # uid -> its connections with work: (their usage + estimate, order, connection),
        # weighed as usage is
        self._waiting: dict[int, list[tuple[float, int, int]]] = {}
        # the connections queued: read-only to callers, for the loop to test for
        # work without a call (``bool(queue)`` is a Python call, this set's is not)
        self.queued: set[int] = set()
        self._usage: dict[int, float] = {}  # conn -> usage, weighed
        self._uid_usage: dict[int, float] = {}  # uid -> usage, weighed
        self._uid_served_at_s: dict[int, float] = {}  # uid -> when a unit of it last ended
        self._uid_of: dict[int, int] = {}
        # uid -> the key (usage + estimate, weighed) of its unit served last, or where
        # a unit served without the queue ended, if later: where its queue stands
        self._uid_clock: dict[int, float] = {}
        self._popped = -1  # the connection ``next`` returned, until it is ``served``
        self._epoch_s = clock()  # when the weight was 1
        self._weight = 1.0
        self._weighed_at_s = self._epoch_s

    def __len__(self) -> int:
        return len(self.queued)

    def __contains__(self, conn: int) -> bool:
        return conn in self.queued

    def _weigh(self, now_s: float) -> float:
        """The weight of usage at ``now_s`` (rescaling everything past ``RESCALE_AT``)."""
        w = float(2.0 ** ((now_s - self._epoch_s) / HALF_LIFE_S))
        if w >= RESCALE_AT:
            self._usage = {c: u / w for c, u in self._usage.items() if u / w >= FORGET_S}
            self._uid_usage = {
                uid: u / w for uid, u in self._uid_usage.items() if u / w >= FORGET_S
            }
            self._uid_served_at_s = {
                uid: t for uid, t in self._uid_served_at_s.items() if uid in self._uid_usage
            }
            self._uid_clock = {
                uid: t / w for uid, t in self._uid_clock.items() if uid in self._uid_usage
            }
            for uid, heap in self._waiting.items():  # a monotone map keeps each a heap
                self._waiting[uid] = [(key / w, n, c) for key, n, c in heap]
            self._epoch_s, w = now_s, 1.0
        self._weight, self._weighed_at_s = w, now_s
        return w

    def usage_s(self, conn: int) -> float:
        """The loop time ``conn`` has used lately (decayed to now)."""
        w = self._weigh(self._clock())  # first: it may rescale what it divides
        return self._usage.get(conn, 0.0) / w

    def wake(self, conn: int, nbytes: int = 0, uid: int | None = None) -> None:
        """``conn`` (of ``uid``, given once) has ``nbytes`` of work: queue it (no-op
        if queued already)."""
        if uid is not None:
            self._uid_of.setdefault(conn, uid)
        if conn in self.queued:
            return
        self.queued.add(conn)
        now_s = self._clock()
        w = self._weigh(now_s)
        uid = self._uid_of.get(conn, HOUSEKEEPING_UID)
        clock = self._uid_clock.get(uid, 0.0)
        used = self._usage.get(conn)
        if used is None:  # new to the loop: a lead behind where its uid's queue stands
            self._usage[conn] = used = clock + CONN_LEAD_S * w
        elif clock - CONN_LEAD_S * w > used:  # idle while its uid's queue moved on
            self._usage[conn] = used = clock - CONN_LEAD_S * w
        key = used + estimate_s(nbytes) * w
        if uid not in self._waiting:
            self._start_near_the_active(uid, now_s, w)
        heap = self._waiting.setdefault(uid, [])
        heapq.heappush(heap, (key, next(self._order), conn))

    def _start_near_the_active(self, uid: int, now_s: float, w: float) -> None:
        """``uid`` comes with work at ``now_s`` (usage weighed ``w``): raise its usage to
        ``LEAD_S`` below the least of the other active uids' (``HOUSEKEEPING_UID``: to
        that least), if it is lower."""
        uid_usage, served_at = self._uid_usage, self._uid_served_at_s
        floor = min(
            (
                used
                for other, used in uid_usage.items()
                if other != uid
                and (other in self._waiting or now_s - served_at.get(other, -math.inf) < ACTIVE_S)
            ),
            default=0.0,
        )
        start = floor - (0.0 if uid == HOUSEKEEPING_UID else LEAD_S * w)
        if start > uid_usage.get(uid, 0.0):
            uid_usage[uid] = start

    def next(self) -> int | None:
        """The connection to serve now (taken out of the queue), or None: of the uids
        with work, the one that used the least lately (all weighed alike, so compared
        as they are), then its connection that did."""
        waiting, uid_usage = self._waiting, self._uid_usage
        while waiting:
            if len(waiting) == 1:
                uid = next(iter(waiting))
            else:
                uid = min(waiting, key=lambda u: (uid_usage.get(u, 0.0), u))
            heap = waiting[uid]
            key, _, conn = heapq.heappop(heap)
            if not heap:
                del waiting[uid]
            if conn in self.queued:
                self.queued.discard(conn)
                self._uid_clock[uid] = key
                self._popped = conn
                return conn
        return None

    def served(
        self,
        conn: int,
        cost_s: float,
        more: int,
        uid: int | None = None,
        now_s: float | None = None,
        gone: bool = False,
    ) -> None:
        """``conn`` (of ``uid``, if not woken before)'s unit took ``cost_s`` of the
        loop, ending at ``now_s`` (default: the clock's now); ``more``: the bytes of
        work it has left (0: none). ``gone``: the connection closed during the unit
        (``drop`` ran): its uid pays, and nothing of the connection is kept."""
        if uid is None:
            uid = self._uid_of.get(conn, HOUSEKEEPING_UID)
        elif not gone and conn not in self._uid_of:
            self._uid_of[conn] = uid
        if now_s is None:
            now_s = self._clock()
        w = self._weight
        if now_s - self._weighed_at_s >= WEIGH_EVERY_S:
            w = self._weigh(now_s)
        used = cost_s * w
        uid_usage = self._uid_usage
        uid_usage[uid] = uid_usage.get(uid, 0.0) + used
        self._uid_served_at_s[uid] = now_s
        if gone:
            self._popped = -1
            return
        usage = self._usage
        usage[conn] = ended = usage.get(conn, 0.0) + used
        if conn != self._popped and ended > self._uid_clock.get(uid, 0.0):
            self._uid_clock[uid] = ended  # served without the queue (inline)
        self._popped = -1
        if more:
            self.wake(conn, more)

    def drop(self, conn: int) -> None:
        self.queued.discard(conn)  # its heap entry is skipped when popped
        self._usage.pop(conn, None)
        self._uid_of.pop(conn, None)

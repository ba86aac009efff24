"""Store/evict events of one namespace, fanned out to every connection that opened it.

Rules:
- Each subscriber (a client connection) has its own bounded queue, so several engines
  sharing a namespace each see every event — their own stores, other engines' stores
  and every eviction — exactly once. An event object is shared by all queues.
- A queue that overflows drops its oldest events and remembers it: the next ``take``
  says so, and the subscriber rebuilds its view from a key snapshot
  (``SyncKeys``) instead of trusting a feed with holes.
- ``subscribe`` restarts a queue empty; the service calls it together with taking a
  key snapshot, which makes snapshot + later events exact.
- Loop thread only, like the index that owns it.
"""

from __future__ import annotations

from collections import deque

from kvoffload.plans import OffloadEvent

MAX_PENDING_EVENTS = 65536


class _Queue:
    __slots__ = ("events", "lost")

    def __init__(self) -> None:
        self.events: deque[OffloadEvent] = deque()
        self.lost = False


class EventFeed:
    def __init__(self, max_pending: int = MAX_PENDING_EVENTS) -> None:
        self._max_pending = max_pending
        self._queues: dict[int, _Queue] = {}
        self.dropped_total = 0
        self.seq = 0  # events emitted so far: a subscriber that took them all is at seq

    def subscribe(self, subscriber: int) -> None:
        """Start (or restart) a subscriber's queue, empty and complete."""
        self._queues[subscriber] = _Queue()

    def unsubscribe(self, subscriber: int) -> None:
        self._queues.pop(subscriber, None)

    def emit(self, event: OffloadEvent) -> None:
        self.seq += 1
        for q in self._queues.values():
            if len(q.events) >= self._max_pending:
                q.events.popleft()
                q.lost = True
                self.dropped_total += 1
            q.events.append(event)

    def pending(self, subscriber: int) -> bool:
        q = self._queues.get(subscriber)
        return q is not None and (bool(q.events) or q.lost)

    def take(self, subscriber: int) -> tuple[list[OffloadEvent], bool]:
        """Events since the last take, and whether some were dropped in between.

        A connection that never subscribed is subscribed now (and gets nothing yet)."""
        q = self._queues.get(subscriber)
        if q is None:
            self.subscribe(subscriber)
            return [], False
        events, lost = list(q.events), q.lost
        q.events.clear()
        q.lost = False
        return events, lost

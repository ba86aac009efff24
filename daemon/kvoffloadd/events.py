"""Store/evict events of one namespace, fanned out to every connection that opened it.

Rules:
- Each subscriber (a client connection) has its own bounded queue, so several engines
  sharing a namespace each see every event — their own stores, other engines' stores
  and every eviction — exactly once. An event object is shared by all queues.
- A queue is bounded in bytes (``MAX_PENDING_EVENT_BYTES``: keys, slots and a fixed
  overhead per event), not only in events, so a subscriber that never takes cannot
  hold more. One that overflows drops its oldest events and remembers it: the next
  ``take`` says so, and the subscriber rebuilds its view from a key snapshot
  (``SyncKeys``) instead of trusting a feed with holes.
- ``subscribe`` restarts a queue empty; the service calls it together with taking a
  key snapshot, which makes snapshot + later events exact.
- Loop thread only, like the index that owns it.
"""

from __future__ import annotations

from collections import deque

from kvoffload.plans import OffloadEvent

MAX_PENDING_EVENTS = 65536
MAX_PENDING_EVENT_BYTES = 4 << 20
EVENT_OVERHEAD_BYTES = 96


def event_bytes(e: OffloadEvent) -> int:
    keys = e.keys
    return EVENT_OVERHEAD_BYTES + (len(keys[0]) + 8) * len(keys) if keys else EVENT_OVERHEAD_BYTES


class _Queue:
    __slots__ = ("bytes", "events", "lost")

    def __init__(self) -> None:
        self.events: deque[tuple[OffloadEvent, int]] = deque()
        self.bytes = 0
        self.lost = False


class EventFeed:
    def __init__(
        self, max_pending: int = MAX_PENDING_EVENTS, max_bytes: int = MAX_PENDING_EVENT_BYTES
    ) -> None:
        self._max_pending = max_pending
        self._max_bytes = max_bytes
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
        size = event_bytes(event)
        for q in self._queues.values():
            while q.events and (
                len(q.events) >= self._max_pending or q.bytes + size > self._max_bytes
            ):
                q.bytes -= q.events.popleft()[1]
                q.lost = True
                self.dropped_total += 1
            q.events.append((event, size))
            q.bytes += size

    def pending_bytes(self) -> int:
        return sum(q.bytes for q in self._queues.values())

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
        events, lost = [e for e, _ in q.events], q.lost
        q.events.clear()
        q.bytes = 0
        q.lost = False
        return events, lost

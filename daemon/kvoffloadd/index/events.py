"""Store/evict events of one namespace, fanned out to every connection that opened it.

Rules:
- One log per namespace, and a cursor per subscriber (a client connection): several
  engines sharing a namespace each see every event — their own stores, other
  engines' stores and every eviction — exactly once, and what the daemon keeps does
  not grow with the number of subscribers (an idle subscriber costs one cursor).
- An event is kept in its wire form (``EventMsg``: keys and slots packed), packed once
  when it happens: what it costs the daemon is its packed bytes plus a fixed overhead
  (``event_bytes``), whatever reads it and however often.
- The log is bounded in events and bytes (``MAX_PENDING_EVENTS``,
  ``MAX_PENDING_EVENT_BYTES``), and all logs together by a ``FeedBudget``: past it,
  the largest log drops its older half. Events every subscriber has taken are dropped
  too (``compact``, from the cron). A dropped event's memory goes at once.
- A subscriber whose cursor is older than the log's oldest event lost events: its
  next ``take`` says so, and it rebuilds its view from a key snapshot (``SyncKeys``)
  instead of trusting a feed with holes.
- ``subscribe`` starts a cursor at the current event; the service calls it together
  with taking a key snapshot, which makes snapshot + later events exact.
- Loop thread only, like the index that owns it.
"""

from __future__ import annotations

import itertools
from collections import deque

from kvoffload.plans import OffloadEvent
from kvoffload.protocol.messages import EventMsg
from kvoffload.protocol.packing import pack_ids, pack_keys, unpack_ids, unpack_keys

MAX_PENDING_EVENTS = 65536
MAX_PENDING_EVENT_BYTES = 4 << 20
FEED_BUDGET_BYTES = 64 << 20  # all namespaces' logs together
EVENT_OVERHEAD_BYTES = 256  # an EventMsg, its two bytes objects and its place in the log


def event_bytes(e: EventMsg) -> int:
    """What an event kept in the log costs the daemon."""
    return EVENT_OVERHEAD_BYTES + len(e.keys) + len(e.slots)


def packed(event: OffloadEvent) -> EventMsg:
    """An event in its wire form (all keys of a namespace have one length)."""
    slots = pack_ids(event.slots) if event.slots else b""
    return EventMsg(*pack_keys(event.keys), event.removed, slots)


def unpacked(msg: EventMsg) -> OffloadEvent:
    slots = unpack_ids(msg.slots).tolist() if msg.slots else None
    return OffloadEvent(unpack_keys(msg.keys, msg.key_bytes), msg.removed, slots)


class FeedBudget:
    """The bytes all namespaces' event logs hold together."""

    def __init__(self, max_bytes: int = FEED_BUDGET_BYTES) -> None:
        self.max_bytes = max_bytes
        self.total_bytes = 0
        self._feeds: set[EventFeed] = set()
        self.trims_total = 0

    def add(self, feed: EventFeed) -> None:
        self._feeds.add(feed)

    def remove(self, feed: EventFeed) -> None:
        self._feeds.discard(feed)
        self.total_bytes -= feed.pending_bytes()

    def charge(self, n: int) -> None:
        self.total_bytes += n
        if self.total_bytes > self.max_bytes and self._feeds:
            largest = max(self._feeds, key=EventFeed.pending_bytes)
            self.trims_total += 1
            largest.trim(largest.pending_bytes() // 2)


class EventFeed:
    def __init__(
        self,
        max_pending: int = MAX_PENDING_EVENTS,
        max_bytes: int = MAX_PENDING_EVENT_BYTES,
        budget: FeedBudget | None = None,
    ) -> None:
        self._max_pending = max_pending
        self._max_bytes = max_bytes
        self._budget = budget
        self._log: deque[tuple[EventMsg, int]] = deque()  # live events, oldest first
        self._first = 1  # seq of the oldest live event
        self._bytes = 0
        self._cursors: dict[int, int] = {}  # subscriber -> seq it has taken up to
        self.dropped_total = 0  # events subscribers lost
        self.seq = 0  # events emitted so far: a subscriber that took them all is at seq
        if budget is not None:
            budget.add(self)

    def close(self) -> None:
        """The namespace is gone: give the budget back."""
        if self._budget is not None:
            self._budget.remove(self)
            self._budget = None
        self._log.clear()
        self._bytes = 0

    def subscribe(self, subscriber: int) -> None:
        """Start (or restart) a subscriber at the current event, complete from now."""
        self._cursors[subscriber] = self.seq

    def unsubscribe(self, subscriber: int) -> None:
        self._cursors.pop(subscriber, None)

    def emit(self, event: OffloadEvent) -> None:
        self.seq += 1
        if not self._cursors:  # nobody will read it
            self._drop(len(self._log))
            self._first = self.seq + 1
            return
        msg = packed(event)
        size = event_bytes(msg)
        self._log.append((msg, size))
        self._bytes += size
        if self._budget is not None:
            self._budget.charge(size)
        if len(self._log) > self._max_pending or self._bytes > self._max_bytes:
            self.trim(self._max_bytes)

    def trim(self, keep_bytes: int) -> None:
        """Drop the oldest events until at most ``keep_bytes`` (and the event count)
        are kept; subscribers that had not taken them lose them."""
        freed, n, live = 0, 0, len(self._log)
        for _, size in self._log:
            if self._bytes - freed <= keep_bytes and live - n <= self._max_pending:
                break
            freed += size
            n += 1
        self._drop(n)

    def compact(self) -> None:
        """Drop the events every subscriber has taken (the cron calls this)."""
        if not self._cursors:
            self._drop(len(self._log))
            return
        taken = min(self._cursors.values()) - self._first + 1  # events all have read
        self._drop(max(0, min(taken, len(self._log))))

    def _drop(self, n: int) -> None:
        """Forget the ``n`` oldest events (their memory goes now)."""
        freed = 0
        for _ in range(n):
            freed += self._log.popleft()[1]
        self._first += n
        self._bytes -= freed
        if self._budget is not None and freed:
            self._budget.charge(-freed)

    def pending_bytes(self) -> int:
        return self._bytes

    def pending(self, subscriber: int) -> bool:
        cursor = self._cursors.get(subscriber)
        return cursor is not None and cursor < self.seq

    def take(self, subscriber: int) -> tuple[list[EventMsg], bool]:
        """Events since the last take, and whether some were dropped in between.

        A connection that never subscribed is subscribed now (and gets nothing yet)."""
        cursor = self._cursors.get(subscriber)
        if cursor is None:
            self.subscribe(subscriber)
            return [], False
        lost = cursor < self._first - 1
        if lost:
            self.dropped_total += self._first - 1 - cursor
            cursor = self._first - 1
        start = cursor - (self._first - 1)
        events = [e for e, _ in itertools.islice(self._log, start, None)]
        self._cursors[subscriber] = self.seq
        return events, lost

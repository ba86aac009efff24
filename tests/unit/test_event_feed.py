"""The event feed: one log per namespace, a cursor per subscriber, budgets in bytes."""

from __future__ import annotations

from kvoffload.plans import OffloadEvent
from kvoffloadd.index.events import EventFeed, FeedBudget, event_bytes, packed, unpacked

KEYS = [b"k" * 40] * 100  # one event: 100 keys of 40 bytes
SIZE = event_bytes(packed(OffloadEvent(KEYS, removed=False)))


def test_idle_subscribers_cost_a_cursor_each_not_a_queue() -> None:
    """Issue scenario: 400 subscribers that never take grew the heap 837 MiB (a 4 MiB
    queue each). The log is one per namespace: its bytes do not grow with them."""
    feed = EventFeed(max_bytes=64 * SIZE)
    for sub in range(400):
        feed.subscribe(sub)
    for i in range(1000):
        feed.emit(OffloadEvent(KEYS, removed=bool(i % 2)))
    assert feed.pending_bytes() <= 64 * SIZE
    events, lost = feed.take(0)
    assert lost and len(events) == 64 and feed.dropped_total == 1000 - 64


def test_every_subscriber_sees_every_event_once_and_taken_events_go() -> None:
    feed = EventFeed()
    feed.subscribe(1)
    feed.emit(OffloadEvent([b"a"], removed=False))
    feed.subscribe(2)  # from now on
    feed.emit(OffloadEvent([b"b"], removed=True))
    assert [unpacked(e).keys for e in feed.take(1)[0]] == [[b"a"], [b"b"]]
    assert [unpacked(e).keys for e in feed.take(2)[0]] == [[b"b"]]
    assert not feed.pending(1) and feed.take(1) == ([], False)
    feed.compact()
    assert feed.pending_bytes() == 0
    feed.unsubscribe(1)
    feed.unsubscribe(2)
    feed.emit(OffloadEvent([b"c"], removed=False))  # nobody reads it: not kept
    assert feed.pending_bytes() == 0 and feed.seq == 3
    assert feed.take(3) == ([], False)  # a first take subscribes


def test_all_logs_together_stay_within_the_budget() -> None:
    budget = FeedBudget(max_bytes=100 * SIZE)
    feeds = [EventFeed(budget=budget) for _ in range(4)]
    for f in feeds:
        f.subscribe(1)
    for i in range(400):
        feeds[i % 4].emit(OffloadEvent(KEYS, removed=False))
    assert budget.total_bytes <= 100 * SIZE and budget.trims_total > 0
    assert budget.total_bytes == sum(f.pending_bytes() for f in feeds)
    feeds[0].close()
    assert budget.total_bytes == sum(f.pending_bytes() for f in feeds[1:])


def test_what_the_log_counts_is_what_it_holds_and_dropped_events_go_at_once() -> None:
    """A subscriber that never read grew the daemon 113 MiB over 64 store+evict cycles
    of 8,192 keys: the log counted 24 bytes per key where Python held ~100, and kept
    dropped events until more than 1,024 had gone. Events are kept packed now."""
    from heap import OwnHeap

    keys = [b"%036d" % i for i in range(8192)]  # vLLM-length keys
    feed = EventFeed()
    feed.subscribe(1)
    with OwnHeap() as heap:
        for i in range(64):
            feed.emit(
                OffloadEvent(keys, removed=bool(i % 2), slots=None if i % 2 else list(range(8192)))
            )
        held = heap.grown_bytes()
        assert feed.pending_bytes() <= 4 << 20  # the log's bound
        assert held <= 1.25 * feed.pending_bytes() + (64 << 10), (held, feed.pending_bytes())
        feed.trim(0)
        after = heap.grown_bytes()
    assert after < 64 << 10, f"{after} bytes of dropped events still held"

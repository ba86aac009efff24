"""The loop's turns: who is served next, large batches in slices, and the loop's own
figures in stats (turn lengths, the frozen start-up objects)."""

from __future__ import annotations

import gc

import msgspec
import pytest

from kvoffload.protocol import messages as m
from kvoffload.protocol.messages import pack_ids
from kvoffloadd.server.turns import TurnQueue
from kvoffloadd.service.engines import split_batch
from kvoffloadd.service.stats import LoopTurns


def test_turns_give_percentiles_and_the_longest() -> None:
    turns = LoopTurns()
    for us in range(1, 101):
        turns.record(us / 1e6)
    s = turns.summary()
    assert s["turns_total"] == 100 and s["turn_max_us"] == 100.0
    assert s["turn_p50_us"] == 51.0 and s["turn_p99_us"] == 100.0


def test_a_stats_call_never_walks_the_frozen_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """gc.get_freeze_count() walks every frozen object (a stats call took 407 us with
    it, 62 without): main() counts them once, the summary only reports the count."""

    def walked() -> int:
        raise AssertionError("a stats call walked the frozen objects")

    monkeypatch.setattr(gc, "get_freeze_count", walked)
    turns = LoopTurns()
    turns.frozen_objects = 32_000
    assert turns.summary()["gc_frozen_objects"] == 32_000


def test_the_turn_histogram_is_cumulative_with_a_sum() -> None:
    turns = LoopTurns()
    for s in (0.00005, 0.002, 0.002, 0.3, 5.0):
        turns.record(s)
    buckets, total = turns.histogram()
    counts = dict(buckets)
    assert counts[0.0001] == 1 and counts[0.0025] == 3 and counts[0.25] == 3
    assert counts[1.0] == 4 and counts[float("inf")] == 5
    assert total == pytest.approx(5.30405)
    assert turns.summary()["turn_seconds_buckets"][-1] == ["+Inf", 5]


def test_a_small_request_waits_for_at_most_one_large_unit_however_many_there_are() -> None:
    """128 connections keep sending large batches (100 ms a unit); one keeps pinging
    (0.1 ms a ping, sent again as soon as answered: more than its fair share of the
    loop). Each ping waits for the large unit in progress at most, never for a round
    of them; and while pings keep coming, large units still get half the loop."""
    q = TurnQueue()
    q.new_turn()
    for c in range(1, 129):
        q.wake(c, 1 << 20)
    ping = 1000
    q.wake(ping, 20)
    assert q.next() == ping  # woken with the others: served first
    q.served(ping, 0.0001, more=0)
    light_s = heavy_s = 0.0
    for unit in range(2000):
        if unit % 40 == 0:
            q.new_turn()
        q.wake(ping, 20)  # the next ping is already waiting
        c = q.next()
        assert c is not None
        if c == ping:
            q.served(c, 0.0001, more=0)
            light_s += 0.0001
            continue
        q.served(c, 0.1, more=1 << 20)
        heavy_s += 0.1
        assert q.next() == ping, f"unit {unit}: a second large unit went before the ping"
        q.served(ping, 0.0001, more=0)
        light_s += 0.0001
    assert heavy_s > 0.9 * (heavy_s + light_s)  # pings are cheap: the rest is large work


def test_a_flood_of_small_requests_leaves_large_ones_half_the_loop() -> None:
    q = TurnQueue()
    q.new_turn()
    q.wake(1, 1 << 20)
    for c in range(100, 1100):
        q.wake(c, 20)
    used = {"light": 0.0, "heavy": 0.0}
    for _ in range(4000):
        c = q.next()
        assert c is not None
        kind, cost = ("heavy", 0.005) if c == 1 else ("light", 0.0001)
        used[kind] += cost
        q.served(c, cost, more=(1 << 20) if c == 1 else 20)
    assert used["heavy"] >= 0.45 * (used["heavy"] + used["light"])


def test_a_large_engine_batch_is_applied_in_slices_in_field_order() -> None:
    kb = 8
    keys = [b"%07d" % i + b"k" for i in range(5000)]
    packed = b"".join(keys)
    r = m.StepBatch(
        0, 3, kb, claim_keys=packed[: 3000 * kb], claim_slots=pack_ids(range(3000)),
        pin_keys=packed, touch_keys=packed[:8], ack_seq=17, want_leases=64,
    )  # fmt: skip
    parts = split_batch(r, max_keys=2048)
    sizes = [
        sum(len(getattr(p, f)) for f in ("claim_keys", "pin_keys", "touch_keys")) // kb
        for p in parts
    ]
    assert max(sizes) <= 2048 and sum(sizes) == 3000 + 5000 + 1
    assert b"".join(p.claim_keys for p in parts) == r.claim_keys
    assert b"".join(p.claim_slots for p in parts) == r.claim_slots
    assert b"".join(p.pin_keys for p in parts) == r.pin_keys
    assert [bool(p.claim_keys) for p in parts] == sorted(
        (bool(p.claim_keys) for p in parts), reverse=True
    )  # claims first
    assert parts[-1].touch_keys and parts[-1].ack_seq == 17 and parts[-1].want_leases == 64
    assert all(p.ack_seq == -1 and p.want_leases == -1 for p in parts[:-1])
    # small, answered or malformed batches stay whole
    assert split_batch(m.StepBatch(0, 3, kb, pin_keys=packed[:80])) == [
        m.StepBatch(0, 3, kb, pin_keys=packed[:80])
    ]
    answered = msgspec.structs.replace(r, rid=5)
    assert split_batch(answered) == [answered]
    bad = msgspec.structs.replace(r, claim_slots=b"\0" * 8)
    assert split_batch(bad) == [bad]

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


def test_a_small_request_goes_before_any_number_of_large_ones_and_waits_at_most_one() -> None:
    """128 connections each send a 1 MiB batch (100 ms a unit); one sends pings of 20
    bytes (0.1 ms). Woken with the others it is served first; woken while they run it
    waits for the unit in progress only, never a round of them."""
    q = TurnQueue()
    heavy = list(range(1, 129))
    for c in heavy:
        q.wake(c, 1 << 20)
    light = 1000
    q.wake(light, 20)
    assert q.next() == light
    q.served(light, 0.0001, more=0)
    for round_ in range(1, 400):
        c = q.next()
        assert c is not None and c != light
        q.served(c, 0.1, more=1 << 20)
        if round_ % 7 == 0:
            q.wake(light, 20)
            assert q.next() == light, f"round {round_}: a heavy unit went first"
            q.served(light, 0.0001, more=0)


def test_heavy_connections_share_the_loop_evenly_and_time_idle_is_not_banked() -> None:
    q = TurnQueue()
    used = dict.fromkeys((1, 2, 3), 0.0)
    for c in used:
        q.wake(c, 100)
    for _ in range(3000):
        c = q.next()
        assert c is not None
        cost = {1: 0.001, 2: 0.01, 3: 0.05}[c]
        used[c] += cost
        q.served(c, cost, more=100)
    assert max(used.values()) - min(used.values()) <= 0.05 + 1e-9  # one unit apart
    # 4 idled while the others ran: it starts at the queue's time, not ahead by all it
    # did not use, so it cannot take the loop for as long as the others had it.
    q.wake(4, 100)
    served_4 = 0
    for _ in range(50):
        c = q.next()
        assert c is not None
        served_4 += c == 4
        q.served(c, 0.01 if c == 4 else {1: 0.001, 2: 0.01, 3: 0.05}[c], more=100)
    assert 1 <= served_4 <= 12  # its share of 50 units, not all of them
    q.drop(4)
    assert 4 not in q and len(q) == 3


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

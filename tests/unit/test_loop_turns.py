"""The loop's turns: who is served next, large batches in slices, and the loop's own
figures in stats (turn lengths, the frozen start-up objects)."""

from __future__ import annotations

import gc

import msgspec
import pytest

from kvoffload.protocol import messages as m
from kvoffload.protocol.packing import pack_ids
from kvoffloadd.server.turns import HALF_LIFE_S, LEAD_S, TurnQueue
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


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_units(q: TurnQueue, clock: Clock, cost_of: dict[int, float], units: int) -> list[int]:
    """Serve ``units`` units, each taking its connection's cost; who was served, in order."""
    served = []
    for _ in range(units):
        c = q.next()
        assert c is not None
        clock.now += cost_of[c]
        q.served(c, cost_of[c], more=1 << 20)
        served.append(c)
    return served


ATTACKER, TENANT = 65534, 1000


def test_a_small_request_waits_for_at_most_one_large_unit_however_many_there_are() -> None:
    """128 connections of one uid keep sending large batches (100 ms a unit); another
    tenant's client keeps pinging (0.1 ms a ping, sent again as soon as answered). Woken
    with the others it goes first; woken while they run, it waits for the unit in
    progress only."""
    clock = Clock()
    q = TurnQueue(clock)
    for conn in range(1, 129):
        q.wake(conn, 1 << 20, ATTACKER)
    ping = 1000
    q.wake(ping, 20, TENANT)
    assert q.next() == ping
    q.served(ping, 0.0001, more=0)
    for unit in range(2000):
        c = q.next()
        assert c is not None and c != ping
        clock.now += 0.1
        q.served(c, 0.1, more=1 << 20)
        if unit % 7 == 0:
            q.wake(ping, 20)
            assert q.next() == ping, f"unit {unit}: a second large unit went before the ping"
            clock.now += 0.0001
            q.served(ping, 0.0001, more=0)


def test_a_burst_of_connections_woken_at_once_does_not_go_before_a_ping() -> None:
    """85 connections of one uid woken at once, their batches going on in slices of
    16 KiB that took 3 ms each: a ping of another uid arriving after the first round
    began waited for all of that round (265 ms) while their first places were taken by
    their bytes; a uid is weighed by what it used when a unit is picked."""
    clock = Clock()
    q = TurnQueue(clock)
    for c in range(1, 86):
        q.wake(c, 16 << 10, ATTACKER)
    run_units(q, clock, dict.fromkeys(range(1, 86), 0.003), 5)
    q.served(1000, 0.035, more=0)  # the pinging tenant has used the loop too
    q.wake(1000, 20, TENANT)
    assert q.next() == 1000


def test_uids_share_the_loop_whatever_their_connections_and_connections_within_a_uid() -> None:
    clock = Clock()
    q = TurnQueue(clock)
    for c in range(1, 101):  # one uid, 100 busy connections
        q.wake(c, 100, ATTACKER)
    q.wake(500, 100, TENANT)  # another uid, one
    cost = dict.fromkeys([*range(1, 101), 500], 0.002)
    served = run_units(q, clock, cost, 20000)
    tenant = served.count(500)
    assert 0.4 < tenant / len(served) < 0.6, f"the single connection got {tenant} units"
    per_conn = [served.count(c) for c in range(1, 101)]
    assert max(per_conn) <= 2 * min(per_conn)  # none starves, none takes over
    q.drop(500)
    assert 500 not in q and len(q) == 100


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


PING, PING_S = 1000, 25e-6  # the tenant's pinging connection, and its unit (round trip: 2x)


def busy_pinger(clock: Clock) -> TurnQueue:
    """A queue in which a tenant's client (``PING``) has pinged without pause for ten
    seconds: half the loop's time, a large usage."""
    q = TurnQueue(clock)
    for _ in range(200_000):
        q.wake(PING, 20, TENANT)
        assert q.next() == PING
        clock.now += 2 * PING_S
        q.served(PING, PING_S, more=0)
    assert q.usage_s(PING) > 0.3
    return q


def ping_waits_behind(q: TurnQueue, clock: Clock, others: list[int]) -> float:
    """``others`` (woken already) have 1 ms units without end; the tenant's next ping
    comes: the longest it waits for one over 5,000 units."""
    q.wake(PING, 20)
    woken, worst_s = clock.now, 0.0
    for _ in range(5000):
        c = q.next()
        assert c in (PING, *others)
        cost_s = PING_S if c == PING else 0.001
        clock.now += cost_s
        q.served(c, cost_s, more=0 if c == PING else 1 << 20)
        if c == PING:
            worst_s = max(worst_s, clock.now - woken)
            q.wake(PING, 20)
            woken = clock.now
    return worst_s


def test_a_newcomer_goes_first_for_a_short_lead_only_past_a_client_busy_for_long() -> None:
    """A tenant's client has pinged without pause for ten seconds; then a uid that had
    used nothing floods four connections with 1 ms units. Starting from nothing it
    would be served alone until it had used as much (about 200 ms); it starts
    ``LEAD_S`` behind instead, and then the two take turns."""
    clock = Clock()
    q = busy_pinger(clock)
    for c in range(1, 5):  # woken while the tenant's next ping is on its way
        q.wake(c, 1 << 20, ATTACKER)
    worst_s = ping_waits_behind(q, clock, [1, 2, 3, 4])
    assert worst_s < LEAD_S + 0.005, f"the tenant waited {worst_s * 1e3:.0f} ms"


def test_releasing_what_leavers_held_takes_turns_with_the_active_uids_from_the_start() -> None:
    """The same busy tenant; then 1,000 connections leave and what they held is released
    in 1 ms units queued for no connection (``HOUSEKEEPING_UID``). That work is no
    newcomer: it gets no lead, so the tenant's ping waits for one unit of it at most
    (with a lead: 10 ms, on top of the wait to be read behind 1,000 hang-ups)."""
    clock = Clock()
    q = busy_pinger(clock)
    reaper = 0
    q.wake(reaper, 64 << 10)  # no uid: the loop's own work
    worst_s = ping_waits_behind(q, clock, [reaper])
    assert worst_s < 0.001 + 2 * PING_S, f"the tenant waited {worst_s * 1e3:.1f} ms"


def test_connections_new_to_the_loop_take_turns_with_their_uids_busy_one_at_once() -> None:
    """An engine's connection has kept the loop busy for a second (a large usage); then
    a process of the same uid opens 30 connections with 1 ms units of work. Starting at
    nothing, each would be served until it had used as much as the engine had (the
    engine waited 1.8 s); they start where the uid's queue stands, so the engine waits
    for a round or two of them at most: the 31 connections of the uid share it."""
    clock = Clock()
    q = TurnQueue(clock)
    engine, unit_s = 1000, 0.001
    for _ in range(1000):  # busy: a 0.5 ms unit every millisecond
        q.wake(engine, 1 << 10, TENANT)
        assert q.next() == engine
        clock.now += unit_s
        q.served(engine, unit_s / 2, more=0)
    assert q.usage_s(engine) > 0.1
    for conn in range(1, 31):
        q.wake(conn, 1 << 10, TENANT)
    q.wake(engine, 1 << 10)
    waits = []
    woken = clock.now
    for _ in range(3000):
        c = q.next()
        assert c is not None
        clock.now += unit_s
        q.served(c, unit_s, more=0 if c == engine else 1 << 10)
        if c == engine:
            waits.append(clock.now - woken)
            q.wake(engine, 1 << 10)
            woken = clock.now
    # each newcomer's lead (CONN_LEAD_S, a unit here) and a unit: two rounds, once
    assert waits[0] <= 62 * unit_s, f"the engine waited {waits[0] * 1e3:.0f} ms"
    assert max(waits[1:]) <= 31 * unit_s  # then one round of the others' units
    assert len(waits) >= 3000 // 31 - 2  # its share: one unit in 31


def test_a_light_client_of_a_busy_uid_goes_next() -> None:
    """31 connections of one uid keep the loop busy with 1.5 ms units (replies they never
    read); a client of the same uid pings, 30 us a ping. It waits for a unit or two of
    theirs, not for a round of them (47-113 ms measured through the daemon)."""
    clock = Clock()
    q = TurnQueue(clock)
    ping = 1000
    q.served(ping, 30e-6, more=0, uid=TENANT)  # it has pinged before
    for conn in range(1, 32):
        q.wake(conn, 1 << 10, TENANT)
    waited, woken_at = [], 0
    for unit in range(3000):
        if unit % 7 == 0 and ping not in q:
            q.wake(ping, 20)
            woken_at = unit
        c = q.next()
        assert c is not None
        cost_s = 30e-6 if c == ping else 0.0015
        clock.now += cost_s
        q.served(c, cost_s, more=0 if c == ping else 1 << 10)
        if c == ping:
            waited.append(unit - woken_at)
    assert len(waited) > 300 and max(waited) <= 2, f"the ping waited {max(waited)} units"


def test_usage_decays_the_same_across_a_rescale_and_what_decayed_to_nothing_is_forgotten() -> None:
    """Usage is kept weighed by a weight that doubles every half-life and is rescaled
    past ``RESCALE_AT`` (every ~16 s): what it reads, and whom it serves first, are as if
    everyone's usage had halved every half-life."""
    clock = Clock()
    q = TurnQueue(clock)
    q.served(1, 1.0, more=0, uid=TENANT)
    clock.now = 15 * HALF_LIFE_S * 2
    q.served(2, 1.0, more=0, uid=ATTACKER)
    assert q.usage_s(1) == pytest.approx(2.0**-30)
    clock.now = 17 * HALF_LIFE_S * 2  # the weight is 2 ** 34 now: rescaled
    assert q.usage_s(2) == pytest.approx(2.0**-4)
    assert q.usage_s(1) == 0.0  # 2 ** -34 s: nothing
    q.served(2, 0.5, more=0)
    assert q.usage_s(2) == pytest.approx(2.0**-4 + 0.5)
    q.wake(2, 20)
    q.wake(1, 20)
    assert [q.next(), q.next(), q.next()] == [1, 2, None]


def test_a_connection_gone_during_its_unit_leaves_nothing_but_its_uids_charge() -> None:
    """A connection dropped while its unit ran (drop came first) is charged to its uid,
    and the queue keeps nothing of it: connect, Hello, hang up, a million times over,
    holds no memory in the loop's book."""
    clock = Clock()
    q = TurnQueue(clock)
    for conn in range(1, 1001):
        q.drop(conn)  # the unit's send failed: the server dropped it
        clock.now += 0.0001
        q.served(conn, 0.0001, 0, ATTACKER, gone=True)
    assert not q._usage and not q._uid_of and not q.queued
    assert q._uid_usage[ATTACKER] > 0.09  # the uid paid for every unit

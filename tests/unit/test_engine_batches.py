"""The index's engine-facing operations: leases, claims, one-way commits, pins by key.

Engines never wait for the daemon, so everything they send must be applicable in any
order the daemon happens to read it, and nothing they send can fail them. Each test
is one scenario on the index alone (no sockets, no sleeps).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from test_index_story import ks

from kvoffload.plans import OffloadEvent
from kvoffload.protocol.errors import NotFoundError, NotLeasedError
from kvoffload.protocol.messages import KVLayout
from kvoffloadd.index.events import unpacked
from kvoffloadd.index.index import NamespaceIndex
from kvoffloadd.index.leases import new_token
from kvoffloadd.region.allocator import ExtentPool
from kvoffloadd.region.slots import SlotPool

A, B = 1, 2  # two engines (connections) sharing the namespace
TA, TB = new_token(), new_token()


def make_index(blocks: int = 8, world_size: int = 1, grace_s: float = 60.0) -> NamespaceIndex:
    pool = ExtentPool(num_extents=1, extent_bytes=blocks * 4096)
    layout = KVLayout(tensor_page_bytes=[4096 // world_size], world_size=world_size)
    idx = NamespaceIndex(0, "e", layout, "fp", SlotPool(pool, 0, 4096), mirror_grace_s=grace_s)
    for conn in (A, B):
        idx.events.subscribe(conn)
        idx.add_mirror(conn)
    return idx


def stored_events(idx: NamespaceIndex, conn: int) -> list[tuple[list[bytes], list[int] | None]]:
    events, _ = idx.take_feed(conn)
    return [(e.keys, e.slots) for e in map(unpacked, events) if not e.removed]


def test_a_claimed_lease_commits_once_written_and_the_event_says_where() -> None:
    idx = make_index()
    slots = idx.lease(TA, 3)
    assert len(slots) == 3 and idx.leases.unclaimed(TA) == 3
    assert idx.claim(TA, A, ks(1, 2), slots[:2]) == 0
    assert idx.lookup(ks(1)) == 0  # claimed is not stored (invariant 1)
    idx.mark_written(slots[:2], area=0)
    idx.commit(TA, A, ks(1, 2), True)
    assert idx.lookup(ks(1, 2)) == 2
    assert stored_events(idx, B) == [(ks(1, 2), slots[:2])]
    assert idx.leases.unclaimed(TA) == 1


def test_a_commit_that_arrives_before_the_copy_waits_for_it() -> None:
    """The scheduler's commit and the worker's copy come on two connections, in either
    order: the store becomes visible when both are in, and only then."""
    idx = make_index(world_size=2)
    slots = idx.lease(TA, 1)
    idx.claim(TA, A, ks(1), slots)
    idx.mark_written(slots, area=0)
    idx.commit(TA, A, ks(1), True)
    assert idx.lookup(ks(1)) == 0 and idx.statistics().commits_waiting == 1
    idx.mark_written(slots, area=1)
    assert idx.lookup(ks(1)) == 1 and idx.statistics().commits_waiting == 0


def test_a_copy_written_before_its_claim_counts() -> None:
    """The worker's copy into a leased slot may land before the scheduler's claim."""
    idx = make_index()
    slots = idx.lease(TA, 1)
    idx.mark_written(slots, area=0)
    idx.claim(TA, A, ks(1), slots)
    idx.commit(TA, A, ks(1), True)
    assert idx.lookup(ks(1)) == 1


def test_a_void_copy_is_never_committed_and_frees_its_slot() -> None:
    idx = make_index()
    slots = idx.lease(TA, 2)
    idx.claim(TA, A, ks(1, 2), slots)
    idx.commit(TA, A, ks(1, 2), True)  # committed first, copies pending
    idx.void(slots[:1])  # the copy of 1 failed (or ended after its deadline)
    idx.mark_written(slots[1:], area=0)
    assert idx.lookup(ks(1)) == 0 and idx.lookup(ks(2)) == 1
    assert idx.statistics().store_failures_total == 1
    assert idx.slots.num_used == 1  # 1's slot is free again


def test_a_commit_whose_copy_never_lands_expires() -> None:
    idx = make_index()
    idx.commit_timeout_s = 5.0
    slots = idx.lease(TA, 1)
    idx.claim(TA, A, ks(1), slots)
    idx.commit(TA, A, ks(1), True)
    assert idx.expire_commits(now_s=0.0) == 0
    assert idx.expire_commits(now_s=1e12) == 1
    assert idx.lookup(ks(1)) == 0 and idx.slots.num_used == 0


def test_commits_expire_oldest_first_and_a_commit_made_again_goes_last() -> None:
    """Expiry stops at the first commit not due, so commits are kept in deadline order:
    committing a waiting store again moves it behind the others (it would otherwise
    hold every later commit of the namespace back for as long as it is renewed)."""
    idx = make_index()
    idx.commit_timeout_s = 5.0
    slots = idx.lease(TA, 2)
    idx.claim(TA, A, ks(1, 2), slots)
    t0 = time.monotonic()
    idx.commit(TA, A, ks(1), True)
    idx.commit(TA, A, ks(2), True)
    idx.commit(TA, A, ks(1), True)  # again, later: its deadline moves on
    assert idx.expire_commits(now_s=t0 + 1e6, most=1) == 1  # the oldest deadline: 2's
    assert list(idx._waiting) == [slots[0]]  # 1's, renewed, still waits
    assert idx.expire_commits(now_s=t0 + 1e6) == 1


def test_two_engines_storing_one_key_at_once_end_with_one_copy() -> None:
    idx = make_index()
    sa, sb = idx.lease(TA, 1), idx.lease(TB, 1)
    idx.claim(TA, A, ks(7), sa)
    idx.claim(TB, B, ks(7), sb)  # B's mirror had not seen A's claim: a shadow copy
    for s in (sa, sb):
        idx.mark_written(s, area=0)
    idx.commit(TB, B, ks(7), True)  # the shadow goes
    idx.commit(TA, A, ks(7), True)
    assert idx.lookup(ks(7)) == 1
    assert idx.slots.num_used == 1 and idx.statistics().duplicate_stores_total == 1
    assert stored_events(idx, A) == [(ks(7), sa)]


def test_one_batch_claiming_a_key_twice_keeps_one_copy_and_refuses_slots_not_leased() -> None:
    """A batch is applied as if claim by claim: the second claim of a key is a shadow
    copy, a slot claimed twice or not leased is refused, and every slot comes back."""
    idx = make_index()
    slots = idx.lease(TA, 3)
    assert idx.claim(TA, A, ks(1, 1, 2, 3), [slots[0], slots[1], slots[0], slots[2]]) == 1
    assert idx.leases.unclaimed(TA) == 0 and idx.leases.shadow_count(TA) == 1
    idx.mark_written(slots, area=0)
    idx.commit(TA, A, ks(1, 3), True)
    assert idx.lookup(ks(1)) == 1 and idx.lookup(ks(3)) == 1 and idx.lookup(ks(2)) == 0
    assert idx.statistics().duplicate_stores_total == 1
    assert idx.slots.num_used == 2  # key 1 once, key 3; the shadow's slot is free again
    assert stored_events(idx, B) == [(ks(1, 3), [slots[0], slots[2]])]


def test_only_the_lease_holder_may_claim_or_write_its_slots() -> None:
    """Invariant 9: a lease belongs to the connection it was handed to."""
    idx = make_index()
    slots = idx.lease(TA, 2)
    assert idx.claim(TB, B, ks(1), slots[:1]) == 1  # refused, counted
    with pytest.raises(NotLeasedError):
        idx.check_store_slots(np.array(slots), B, TB)
    with pytest.raises(NotLeasedError):
        idx.check_store_slots(np.array(slots), B, 0)
    idx.check_store_slots(np.array(slots), A, TA)
    idx.claim(TA, A, ks(1), slots[:1])
    idx.check_store_slots(np.array(slots[:1]), A, TA)  # claimed: still A's to write


def test_blocking_stores_check_the_writer_too() -> None:
    """Without a token (the blocking API) only the client that prepared may write."""
    idx = make_index()
    plan = idx.prepare_store(ks(1), A)
    assert plan is not None
    with pytest.raises(NotLeasedError):
        idx.check_store_slots(np.array(plan.slots), B, 0)
    idx.check_store_slots(np.array(plan.slots), A, 0)


def test_a_gone_connection_frees_its_leases_and_fails_its_claims() -> None:
    idx = make_index()
    slots = idx.lease(TA, 3)
    idx.claim(TA, A, ks(1), slots[:1])
    idx.mark_written(slots[:1], area=0)
    assert idx.release_client(A, TA) == (1, 0, True)
    assert idx.slots.num_used == 0 and idx.leases.unclaimed(TA) == 0
    idx.commit(TA, A, ks(1), True)  # a late commit of a dead connection does nothing
    assert idx.lookup(ks(1)) == 0


def test_leasing_evicts_outside_requests_but_never_pinned_blocks() -> None:
    idx = make_index(blocks=4)
    slots = idx.lease(TA, 4)
    idx.claim(TA, A, ks(1, 2, 3, 4), slots)
    idx.mark_written(slots, area=0)
    idx.commit(TA, A, ks(1, 2, 3, 4), True)
    idx.pin(ks(1), A)
    # everything evictable goes, 1 is pinned; the space frees once both mirrors saw it
    assert idx.lease(TA, 4) == []
    assert idx.lookup(ks(2)) == idx.lookup(ks(3)) == idx.lookup(ks(4)) == 0
    idx.ack(A, idx.events.seq)
    idx.ack(B, idx.events.seq)
    assert len(idx.lease(TA, 4)) == 3 and idx.lookup(ks(1)) == 1


def test_a_local_pin_reaches_the_daemon_before_the_ack_so_the_slot_stays() -> None:
    """B pinned key 1 from its mirror while the daemon evicted it. B's batch carries
    the pin before the ack of the eviction: the grave stays until B unpins."""
    idx = make_index(blocks=4)
    slots = idx.lease(TA, 4)
    idx.claim(TA, A, ks(1, 2, 3, 4), slots)
    idx.mark_written(slots, area=0)
    idx.commit(TA, A, ks(1, 2, 3, 4), True)
    idx.ack(A, idx.events.seq)
    idx.ack(B, idx.events.seq)
    idx.evict(ks(1))  # pressure: 1 is evicted while B's mirror still says HIT
    idx.pin(ks(1), B)  # B's batch: the pin...
    idx.ack(B, idx.events.seq)  # ...then the ack
    idx.ack(A, idx.events.seq)
    assert idx.resolve_load(ks(1), slots[:1]) == slots[:1]  # the old bytes, still there
    assert slots[0] in idx.graves.by_slot
    idx.unpin(ks(1), B)
    assert slots[0] not in idx.graves.by_slot  # freed once unpinned and seen


def test_a_load_by_key_finds_the_key_where_it_is_now() -> None:
    idx = make_index()
    first = idx.lease(TA, 1)
    idx.claim(TA, A, ks(1), first)
    idx.mark_written(first, 0)
    idx.commit(TA, A, ks(1), True)
    idx.graves.drop_mirror(A)
    idx.graves.drop_mirror(B)
    idx.evict(ks(1))  # gone, slot free
    assert idx.lookup(ks(1)) == 0
    with pytest.raises(NotFoundError):
        idx.resolve_load(ks(1), first)
    again = idx.lease(TB, 2)
    idx.claim(TB, B, ks(1), again[1:])  # stored again elsewhere
    idx.mark_written(again[1:], 0)
    idx.commit(TB, B, ks(1), True)
    assert idx.resolve_load(ks(1), first) == again[1:]


def test_pins_and_unpins_of_unknown_keys_are_counted_not_raised() -> None:
    idx = make_index()
    idx.pin(ks(9), A)
    idx.unpin(ks(9), A)
    assert idx.statistics().pins_missed_total == 1


def test_a_subscriber_that_never_takes_holds_a_bounded_number_of_bytes() -> None:
    """Issue scenario: a client opens the namespace and never takes its events while
    stores and evictions go on; its queue stays within its byte budget, marked lost."""
    from kvoffloadd.index.events import EventFeed

    feed = EventFeed(max_bytes=64 << 10)
    feed.subscribe(A)
    feed.subscribe(B)
    keys = [b"k" * 40] * 100  # 100 keys of 40 bytes per event
    for i in range(1000):
        feed.emit(OffloadEvent(keys, removed=bool(i % 2)))
        if i % 10 == 0:
            feed.take(B)  # B keeps up
    assert feed.pending_bytes() <= 2 * (64 << 10)
    events, lost = feed.take(A)
    assert lost and 0 < len(events) < 1000
    assert feed.take(B)[1] is False  # the one that keeps up never loses any


def test_one_key_claimed_into_every_leased_slot_holds_each_and_frees_all() -> None:
    """Issue scenario: a client claims one key into every slot it leased (all but the
    first are duplicates). Each duplicate is held and counted against what it may
    have in flight, its commit frees them all, and so does its leaving."""
    idx = make_index(blocks=16)
    idx.max_writing_per_client = 8
    free0 = idx.slots.num_free
    slots = idx.lease(TA, 8)
    assert len(slots) == 8
    assert idx.claim(TA, A, ks(1) * 8, slots) == 0  # the first writes, 7 duplicates
    assert idx.leases.shadow_count(TA) == 7 and idx.lease(TA, 4, A) == []  # no more
    assert idx.writing_room(A, TA) == 0
    idx.mark_written(slots[:1], 0)
    idx.commit(TA, A, ks(1), True)  # the one copy stays, every duplicate goes
    assert idx.leases.shadow_count() == 0 and idx.lookup(ks(1)) == 1
    assert idx.slots.num_free == free0 - 1
    more = idx.lease(TA, 8, A)
    assert idx.claim(TA, A, ks(1) * len(more), more) == 0
    assert idx.leases.shadow_count(TA) == len(more)
    assert idx.release_client(A, TA) == (0, 0, True)
    assert idx.leases.shadow_count() == 0 and idx.slots.num_free == free0 - 1
    assert idx.statistics().writing_blocks == 0 and not idx.leases.token_of


def test_a_million_pins_of_one_key_go_in_one_step_and_past_the_cap_are_missed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue scenario: 9.8 M pins of one key, then a disconnect, stalled the loop for
    seconds (one unpin per pin). Pins are now dropped one step per key, and what a
    client may hold is capped (the rest are missed, as pins of keys gone)."""
    from kvoffloadd.ledger import Limits, Line

    idx = make_index()
    idx.pin_ledger = ledger = Line("pins", Limits(1_000_000, 4_000_000, 16_000_000))
    ledger.join(A, 1000)
    slots = idx.lease(TA, 1)
    idx.claim(TA, A, ks(1), slots)
    idx.mark_written(slots, 0)
    idx.commit(TA, A, ks(1), True)
    for _ in range(16):
        idx.pin(ks(1) * 65536, A)
    assert ledger.held(A) == 1_000_000 and idx.pinned_by(A) == 1_000_000
    assert idx.statistics().pins_missed_total == 16 * 65536 - 1_000_000
    calls: list[int] = []
    unpin = type(idx)._unpin

    def counted_unpin(self: NamespaceIndex, *a: Any) -> None:
        calls.append(1)
        unpin(self, *a)

    monkeypatch.setattr(type(idx), "_unpin", counted_unpin)
    assert idx.release_client(A, TA) == (0, 1_000_000, True)
    assert len(calls) == 1 and ledger.held(A) == 0
    assert idx.statistics().pinned_blocks == 0


def test_pins_held_past_the_timeout_are_dropped_oldest_first() -> None:
    """A client cannot keep a block (and the extent it lies in) pinned for good."""
    idx = make_index()
    idx.pin_timeout_s = 60.0
    now = 1000.0
    idx.clock = lambda: now
    slots = idx.lease(TA, 2)
    idx.claim(TA, A, ks(1, 2), slots)
    idx.mark_written(slots, 0)
    idx.commit(TA, A, ks(1, 2), True)
    idx.pin(ks(1) * 3, A)
    idx.prepare_load(ks(2), B)
    assert idx.expire_pins(now + 30) == 0 and idx.statistics().pinned_blocks == 2
    idx.unpin(ks(2), B)
    now = 1040.0
    idx.prepare_load(ks(2), B)  # pinned again, later: its own age
    assert idx.expire_pins(1061.0) == 3  # A's three pins of key 1
    assert idx.pinned_by(A) == 0 and idx.pinned_by(B) == 1
    assert idx.evict(ks(1)) == 1  # evictable again
    assert idx.statistics().pins_expired_total == 3


def test_pinning_and_unpinning_in_a_loop_holds_nothing_once_unpinned() -> None:
    """What the daemon keeps to age pins follows the pins held, not how often a client
    pins: a client pinning and unpinning one key as fast as it can grows nothing."""
    from heap import OwnHeap

    idx = make_index()
    slots = idx.lease(TA, 1)
    idx.claim(TA, A, ks(1), slots)
    idx.mark_written(slots, 0)
    idx.commit(TA, A, ks(1), True)
    idx.pin(ks(1), A)  # warm the containers up
    idx.unpin(ks(1), A)
    with OwnHeap() as heap:
        for _ in range(10_000):
            idx.pin(ks(1), A)
            idx.unpin(ks(1), A)
        grown_bytes = heap.grown_bytes()
    assert idx.pinned_by(A) == 0
    assert grown_bytes < 32 * 1024, f"{grown_bytes} bytes kept for 10,000 pins gone"


def test_engines_of_a_full_region_find_their_refills_free_every_step() -> None:
    """Eight engines store a step's worth each into a full region. The space a refill
    evicts frees only once every mirror has seen the eviction, so the channel must
    evict ahead for every holder's next refill, not one's: otherwise the later engines
    of a step find their pools dry and fall back to blocking stores that fail."""
    from kvoffload.protocol import messages as m
    from kvoffload.protocol.packing import pack_ids, pack_keys, unpack_ids
    from kvoffloadd.ledger import Ledger
    from kvoffloadd.service.engines import EngineChannel
    from kvoffloadd.service.session import Session

    engines, want = 8, 4  # the namespace's lease budget is 256 // 8 = 32: 4 each
    idx = make_index(blocks=256)
    for conn in (A, B):
        idx.graves.drop_mirror(conn)
    channel = EngineChannel({0: idx}, 1 << 20, Ledger())
    sessions = [Session(10 + i, 0, 0, 0) for i in range(engines)]  # one uid, as on a node
    idx.uid_of = lambda client: 0  # as the service wires it: the connection's uid
    for s in sessions:
        s.leases[0] = new_token()
        s.namespaces.add(0)
        s.writable.add(0)  # engines that store here
        idx.events.subscribe(s.session_id)
        idx.add_mirror(s.session_id)
    pool: dict[int, list[int]] = {s.session_id: [] for s in sessions}
    n, short = 0, []
    for step in range(40):  # past the first 256 // 32 = 8 steps the region is full
        for s in sessions:
            slots, pool[s.session_id] = pool[s.session_id], []
            keys = [b"k%07d" % (n + i) for i in range(len(slots))]
            n += len(slots)
            claimed, kb = pack_keys(keys) if keys else (b"", 8)
            idx.mark_written(slots, area=0)  # the worker's copies landed
            channel.apply(
                s,
                idx,
                m.StepBatch(
                    0,
                    0,
                    kb,
                    claimed,
                    pack_ids(slots),
                    commit_keys=claimed,
                    ack_seq=idx.events.seq,
                    want_leases=want,
                ),
            )
            for push in s.pushes:
                pool[s.session_id] += unpack_ids(push.slots).tolist()
            s.pushes.clear()
            if step >= 2 and len(pool[s.session_id]) < want:
                short.append((step, s.session_id, len(pool[s.session_id])))
    assert idx.statistics().evicted_blocks_total > 0, "the region never filled"
    assert short == [], f"(step, engine, slots) of refills short of {want}: {short[:8]}"


def test_a_storing_engine_beside_an_idle_mirror_finds_its_refills_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine stores into a full region while another engine's mirror is attached
    but idle (no requests: it reads and acks nothing). Every eviction then waits out
    the grace period in a grave, so the channel must evict a grace period's worth of
    stores ahead: evicting only for the next refills left the storing engine's pool dry
    for most of each grace period (its stores refused as no space)."""
    from kvoffload.protocol import messages as m
    from kvoffload.protocol.packing import pack_ids, pack_keys, unpack_ids
    from kvoffloadd.ledger import Ledger
    from kvoffloadd.service.engines import EngineChannel
    from kvoffloadd.service.session import Session

    now = [1000.0]  # the graves' clock
    monkeypatch.setattr("kvoffloadd.index.storeindex.time.monotonic", lambda: now[0])
    step_s, per_step, want = 0.1, 4, 4  # 40 blocks/s, 1 s of grace: 44 ahead of 64
    idx = make_index(blocks=512, grace_s=1.0)  # lease budget 512 // 8 = 64
    idx.clock = lambda: now[0]
    idx.graves.drop_mirror(A)  # B stays: a mirror that never acks
    channel = EngineChannel({0: idx}, 1 << 20, Ledger())
    s = Session(10, 0, 0, 0)
    idx.uid_of = lambda client: 0
    s.leases[0] = new_token()
    s.namespaces.add(0)
    s.writable.add(0)
    idx.events.subscribe(s.session_id)
    idx.add_mirror(s.session_id)
    pool: list[int] = []
    full_at, short = None, []
    for step in range(260):  # the region is full after 512 / 4 = 128 steps
        now[0] += step_s
        slots, pool = pool[:per_step], pool[per_step:]
        keys = [b"k%07d" % (step * per_step + i) for i in range(len(slots))]
        claimed, kb = pack_keys(keys) if keys else (b"", 8)
        idx.mark_written(slots, area=0)
        batch = m.StepBatch(0, 0, kb, claimed, pack_ids(slots), commit_keys=claimed,
                            ack_seq=idx.events.seq, want_leases=want)  # fmt: skip
        channel.apply(s, idx, batch)
        for push in s.pushes:
            pool += unpack_ids(push.slots).tolist()
        s.pushes.clear()
        if full_at is None and idx.statistics().evicted_blocks_total:
            full_at = step
        if full_at is not None and step > full_at + 20 and len(pool) < per_step:
            short.append((step, len(pool)))
    assert full_at is not None and full_at < 200, "the region never filled"
    assert len(idx.graves) > 0, "no eviction waited for the idle mirror"
    assert short == [], f"(step, slots) of {len(short)} refills short of {per_step}: {short[:8]}"


class _NoWalk(dict):  # type: ignore[type-arg]
    """The writers of a namespace, which a leaving client must not walk."""

    def items(self):  # type: ignore[no-untyped-def]
        raise AssertionError("walked every writer of the namespace")

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("walked every writer of the namespace")


def test_a_leaving_client_fails_its_own_stores_without_walking_everyone_elses() -> None:
    """1,000 connections closing while 46,848 blocks were in flight stalled the loop
    ~1 s: each leaver walked every in-flight block of the namespace."""
    idx = make_index(blocks=64)
    a = idx.prepare_store(ks(1, 2), A)
    b = idx.prepare_store(ks(3, 4, 5), B)
    assert a is not None and b is not None
    idx._writers = _NoWalk(idx._writers)
    assert idx.release_client(A) == (2, 0, True)
    assert idx.writing_by(A) == 0 and idx.writing_by(B) == 3


def test_a_leavers_release_goes_in_slices_of_a_bounded_size() -> None:
    """A connection leaving with thousands of stores in flight is released a slice at a
    time (the loop serves others between slices), and completely."""
    idx = make_index(blocks=8192)
    plan = idx.prepare_store([b"%07d" % i + b"k" for i in range(5000)], A)
    assert plan is not None and idx.writing_by(A) == 5000
    got = [idx.release_client(A, budget=2048) for _ in range(3)]
    assert [done for *_, done in got] == [False, False, True]
    assert sum(w for w, *_ in got) == 5000 and idx.writing_by(A) == 0
    assert idx.slots.num_used == 0

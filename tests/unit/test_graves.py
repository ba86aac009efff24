"""Evicted blocks stay loadable until every other engine's key mirror has seen the
eviction (graves.py): a mirror's HIT never turns into a failed prepare_load."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_index_story import CopyingIndex, ks

from kvoffload.protocol.errors import NotFoundError, NotLeasedError
from kvoffload.protocol.messages import KVLayout
from kvoffloadd.index.events import unpacked
from kvoffloadd.region.allocator import ExtentPool
from kvoffloadd.region.slots import SlotPool

A, B = 1, 2  # two engines, both with key mirrors


def make_index(grace_s: float = 60.0) -> CopyingIndex:
    pool = ExtentPool(num_extents=1, extent_bytes=4 * 4096)
    idx = CopyingIndex(
        0, "g", KVLayout([4096]), "fp", SlotPool(pool, 0, 4096), mirror_grace_s=grace_s
    )
    for conn in (A, B):
        idx.events.subscribe(conn)
        idx.add_mirror(conn)
    return idx


def store(idx: CopyingIndex, client: int, *ids: int) -> list[int] | None:
    plan = idx.prepare_store(ks(*ids), client)
    if plan is None:
        return None
    idx.complete_store(ks(*ids), True, client)
    return plan.slots


def test_a_hit_that_raced_an_eviction_still_loads_the_old_slot() -> None:
    idx = make_index()
    slots = store(idx, A, 1, 2, 3, 4)
    assert slots is not None
    idx.take_feed(A), idx.take_feed(B)  # both mirrors know 1..4
    # A needs room: 1 is evicted, announced, but B's mirror has not seen that yet
    assert store(idx, A, 5) is None  # the space frees once B has seen the eviction
    assert idx.lookup(ks(1)) == 0 and unpacked(idx.take_feed(A)[0][-1]).keys == ks(1)
    # B looked 1 up as a hit before its refresh: the load pins the old, intact slot
    assert idx.prepare_load(ks(1), B) == [slots[0]]
    idx.check_load_slots(np.array([slots[0]]))
    idx.take_feed(B)  # B's mirror catches up, but its pin keeps the slot
    assert idx.prepare_store(ks(5), A) is None
    idx.complete_load(ks(1), B)  # last pin gone, everyone has seen it: slot reusable
    assert store(idx, A, 5) == [slots[0]]
    with pytest.raises(NotFoundError):
        idx.prepare_load(ks(1), B)  # gone for good now


def test_the_evicting_engine_does_not_wait_for_itself() -> None:
    idx = make_index()
    idx.graves.drop_mirror(B)  # only A has a mirror: its own evictions free at once
    assert store(idx, A, 1, 2, 3, 4) is not None
    plan = idx.prepare_store(ks(5), A)
    assert plan is not None and plan.evicted_keys == ks(1)
    assert len(idx.graves) == 0


def test_graves_free_after_the_grace_period_and_with_a_gone_mirror() -> None:
    idx = make_index(grace_s=0.05)
    assert store(idx, A, 1, 2, 3, 4) is not None
    assert store(idx, A, 5) is None and len(idx.graves) == 1
    time.sleep(0.06)  # B never refreshed: its grace is over
    assert store(idx, A, 5) is not None and len(idx.graves) == 0
    idx2 = make_index()
    assert store(idx2, A, 1, 2, 3, 4) is not None and store(idx2, A, 5) is None
    idx2.take_feed(A)  # A has seen the eviction its failed call made
    assert len(idx2.graves) == 1
    idx2.release_client(B)  # B went away: nobody left to wait for
    assert len(idx2.graves) == 0 and store(idx2, A, 5) is not None


def test_a_key_stored_again_is_loaded_from_its_new_slot_and_pins_are_checked() -> None:
    idx = make_index()
    slots = store(idx, A, 1, 2, 3, 4)
    assert slots is not None
    assert idx.evict(ks(2)) == 1  # admin eviction: buried too
    idx.take_feed(A), idx.take_feed(B)
    assert store(idx, A, 2) is not None  # stored again, in the freed slot
    new = idx.prepare_load(ks(2), B)
    idx.complete_load(ks(2), B)
    assert idx.lookup(ks(2)) == 1 and new != [] and len(idx.graves) == 0
    with pytest.raises(NotLeasedError):
        idx.complete_load(ks(2), B)  # no pin left, from the grave or otherwise


def test_stores_do_not_evict_more_than_they_need_while_graves_are_pending() -> None:
    idx = make_index()
    assert store(idx, A, 1, 2, 3, 4) is not None
    assert store(idx, A, 5) is None and store(idx, A, 5) is None
    assert idx.lookup(ks(2, 3, 4)) == 3  # the second try waited for the grave, took nothing


def test_a_client_that_dies_drops_its_grave_pins() -> None:
    """Invariant 5 for graves: pins go with their client, and the slot frees."""
    idx = make_index()
    slots = store(idx, A, 1, 2, 3, 4)
    assert slots is not None and store(idx, A, 5) is None
    assert idx.prepare_load(ks(1), B) == [slots[0]]
    idx.take_feed(A), idx.take_feed(B)
    assert len(idx.graves) == 1  # pinned by B's load
    assert idx.release_client(B) == (0, 1, True)
    assert len(idx.graves) == 0
    with pytest.raises(NotLeasedError):
        idx.check_load_slots(np.array([slots[0]]))  # nobody may read it any more


def test_a_grave_pinned_past_its_grace_and_the_pin_timeout_is_freed() -> None:
    """A pin on an evicted block does not keep its slot for good either."""
    idx = make_index(grace_s=1.0)
    idx.pin_timeout_s = 5.0
    slots = store(idx, A, 1, 2, 3, 4)
    assert slots is not None
    idx.evict(ks(1))  # buried: B's mirror may still hit it
    idx.prepare_load(ks(1), B)  # B pins the grave
    now = time.monotonic()
    assert idx.expire_pins(now + 3.0) == 0 and len(idx.graves) == 1
    assert idx.expire_pins(now + 7.0) == 1
    assert len(idx.graves) == 0 and idx.pinned_by(B) == 0
    assert idx.slots.num_free == 1


class CountingSlots(dict[int, object]):
    """A graveyard's ``by_slot`` that counts the graves looked up in it."""

    looked = 0

    def __getitem__(self, slot: int) -> object:
        self.looked += 1
        return super().__getitem__(slot)

    def get(self, slot: int, default: object = None) -> object:
        self.looked += 1
        return super().get(slot, default)


def test_expiring_grave_pins_costs_what_it_drops_however_many_graves_are_pinned() -> None:
    """Each housekeeping call looked at every pinned grave of the namespace to find the
    few past their deadline: a peer holding half a million pinned graves made every
    call cost half a million looks. Pinned graves now wait in a heap by deadline: a
    call looks at those it drops (at most ``most``), the earliest first, and pinning
    and unpinning one grave again and again keeps one entry for it."""
    from kvoffloadd.index.graves import Graveyard
    from kvoffloadd.index.policies import Block

    g = Graveyard(grace_s=1.0)
    g.add_mirror(A, 0)
    for i in range(20_000):
        block = Block(i)
        block.ref = 0
        g.bury(b"k%d" % i, block, seq=i + 1, exempt=None, now_s=0.0 if i < 100 else 50.0)
        g.pin(B if i % 2 else A, i)
    slots = CountingSlots(g.by_slot)
    g.by_slot = slots  # type: ignore[assignment]
    assert g.expire_pins(now_s=30.0, timeout_s=60.0) == [] and slots.looked == 0
    assert g.pins_due(now_s=62.0, timeout_s=60.0)
    assert sorted(g.expire_pins(now_s=62.0, timeout_s=60.0, most=30)) == [(A, 15), (B, 15)]
    assert slots.looked <= 2 * 30 and g.by_slot[0].block.ref == 0 and g.by_slot[30].block.ref == 1
    slots.looked = 0
    assert sorted(g.expire_pins(now_s=62.0, timeout_s=60.0)) == [(A, 35), (B, 35)]
    assert slots.looked <= 2 * 70 and not g.pins_due(now_s=62.0, timeout_s=60.0)
    assert len(g.pinned_by(A)) == len(g.pinned_by(B)) == 9_950  # the later ones stay
    for _ in range(1000):  # one grave pinned and unpinned again and again
        g.unpin(A, 100)
        g.pin(A, 100)
    assert len(g._due) <= 20_000
    for i in range(100, 20_000):  # every pin goes; the heap's stale entries do too
        g.unpin(B if i % 2 else A, i)
    block = Block(20_000)
    block.ref = 0
    g.bury(b"last", block, seq=20_001, exempt=None, now_s=50.0)
    g.pin(A, 20_000)
    assert len(g._due) <= 2 * 1 + 64


def test_acks_cost_what_they_free_however_many_graves_and_mirrors() -> None:
    """200 acking mirrors and a silent one over 4,096 graves: an ack looks at the
    oldest grave and the two least advanced mirrors only (never graves x mirrors), and
    what mirrors' positions the graveyard keeps stays bounded."""
    from kvoffloadd.index.graves import Graveyard
    from kvoffloadd.index.policies import Block

    g = Graveyard(grace_s=60.0)
    for conn in range(201):
        g.add_mirror(conn, 0)
    for i in range(4096):
        block = Block(i)
        block.ref = 0
        g.bury(b"k%d" % i, block, seq=i + 1, exempt=None, now_s=0.0)
    looked = []
    original = Graveyard._least_acked

    def counted(self: Graveyard) -> tuple[int, int | None, int]:
        looked.append(1)
        return original(self)

    Graveyard._least_acked = counted  # type: ignore[method-assign]
    try:
        for step in range(50):
            for conn in range(1, 201):  # mirror 0 never acks
                g.ack(conn, 4096 + step)
                assert g.free_now(1.0) == []  # mirror 0 has seen none of them
        assert len(looked) == 50 * 200 and len(g._heap) <= 2 * 201 + 64
        g.drop_mirror(0)  # the silent one leaves: everything goes at once
        assert len(g.free_now(1.0)) == 4096 and len(g) == 0
    finally:
        Graveyard._least_acked = original  # type: ignore[method-assign]


def test_a_grave_exempt_from_the_slowest_mirror_waits_for_the_next_slowest() -> None:
    from kvoffloadd.index.graves import Graveyard
    from kvoffloadd.index.policies import Block

    g = Graveyard(grace_s=60.0)
    g.add_mirror(1, 0)
    g.add_mirror(2, 0)
    block = Block(7)
    block.ref = 0
    g.bury(b"k", block, seq=5, exempt=1, now_s=0.0)  # evicted by 1, which knows
    assert g.free_now(1.0) == []  # 2 has not seen it
    g.ack(2, 5)
    assert [x.block.slot for x in g.free_now(1.0)] == [7]
    # a pinned grave that every mirror saw waits for its last pin, then goes
    b2 = Block(8)
    b2.ref = 0
    g.bury(b"j", b2, seq=6, exempt=None, now_s=0.0)
    g.pin(3, 8)
    g.ack(1, 6)
    g.ack(2, 6)
    assert g.free_now(1.0) == []
    g.unpin(3, 8)
    assert [x.block.slot for x in g.free_now(1.0)] == [8]
    # after its grace a grave goes whatever the mirrors saw
    b3 = Block(9)
    b3.ref = 0
    g.bury(b"i", b3, seq=99, exempt=None, now_s=0.0)
    assert g.free_now(30.0) == [] and [x.block.slot for x in g.free_now(61.0)] == [9]

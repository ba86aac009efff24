"""The vLLM CPU offloading-manager test story, ported to the daemon's index.

Same inputs, same lookups, same slot ids, evicted keys and events as vLLM's own
``test_cpu_manager`` (research/vllm_kv_offload.md section 9), for every policy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from kvoffload.plans import StorePlan
from kvoffload.protocol.errors import InvalidArgumentError, NotFoundError, NotLeasedError
from kvoffload.protocol.messages import KVLayout
from kvoffloadd.index.index import NamespaceIndex, OffloadEvent
from kvoffloadd.index.policies import POLICIES
from kvoffloadd.region.allocator import ExtentPool
from kvoffloadd.region.slots import SlotPool

CLIENT = 1


def k(i: int) -> bytes:
    return str(i).encode().rjust(4, b"\0") + (0).to_bytes(4, "big")


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


class CopyingIndex(NamespaceIndex):
    """The index as the daemon drives it: every prepared slot is copied before completion."""

    def prepare_store(self, keys: Sequence[bytes], client: int, token: int = 0) -> StorePlan | None:
        plan = super().prepare_store(keys, client, token)
        if plan is not None:
            self.mark_written(plan.slots, area=0)
        return plan


def make_index(policy: str, num_blocks: int = 4) -> NamespaceIndex:
    pool = ExtentPool(num_extents=1, extent_bytes=num_blocks * 4096)
    slots = SlotPool(pool, owner=0, slot_bytes=4096)
    layout = KVLayout(tensor_page_bytes=[4096])
    idx = CopyingIndex(0, "story", layout, "fp", slots, policy=policy)
    idx.events.subscribe(0)  # the engine under test, as the service does on open
    return idx


def stored(*ids: int) -> OffloadEvent:
    return OffloadEvent(ks(*ids), removed=False)


def removed(*ids: int) -> OffloadEvent:
    return OffloadEvent(ks(*ids), removed=True)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_manager_story(policy: str) -> None:
    """Scenario: vLLM's 4-block manager test, step by step."""
    idx = make_index(policy)

    # store [1, 2]: fresh slots 0, 1; nothing evicted
    plan = idx.prepare_store(ks(1, 2), CLIENT)
    assert plan is not None
    assert (plan.keys_to_store, plan.slots, plan.evicted_keys) == (ks(1, 2), [0, 1], [])
    # not visible before completion, and no events yet (invariant 1)
    assert idx.lookup(ks(1, 2)) == 0
    assert idx.take_events() == []

    idx.complete_store(ks(1, 2), True, CLIENT)
    assert idx.take_events() == [stored(1, 2)]
    assert idx.lookup(ks(1)) == 1
    assert idx.lookup(ks(1, 2)) == 2
    assert idx.lookup(ks(1, 2, 3)) == 2

    # store [2, 3, 4, 5]: 2 is already stored; fresh 2, 3 and 1's slot 0 after evicting
    # 1, handed out ascending (contiguous runs for the copy planner)
    plan = idx.prepare_store(ks(2, 3, 4, 5), CLIENT)
    assert plan is not None
    assert (plan.keys_to_store, plan.slots, plan.evicted_keys) == (ks(3, 4, 5), [0, 2, 3], ks(1))
    assert idx.take_events() == [removed(1)]

    # full: only 2 is evictable but 2 blocks are needed
    assert idx.prepare_store(ks(1, 6), CLIENT) is None

    idx.complete_store(ks(3, 4, 5), True, CLIENT)
    assert idx.take_events() == [stored(3, 4, 5)]

    # pinned blocks are never evicted (invariant 2)
    assert idx.prepare_load(ks(2, 3), CLIENT) == [1, 0]
    assert idx.prepare_store(ks(6, 7, 8), CLIENT) is None
    idx.complete_load(ks(2, 3), CLIENT)

    plan = idx.prepare_store(ks(6, 7, 8), CLIENT)
    assert plan is not None
    assert (plan.keys_to_store, plan.slots, plan.evicted_keys) == (
        ks(6, 7, 8),
        [0, 1, 2],
        ks(2, 3, 4),
    )
    idx.complete_store(ks(6, 7, 8), True, CLIENT)

    # touch makes 5, 6, 7 recent, so 8 goes
    idx.touch(ks(5, 6, 7))
    plan = idx.prepare_store(ks(9), CLIENT)
    assert plan is not None
    assert (plan.slots, plan.evicted_keys) == ([2], ks(8))

    # a failed completion drops only blocks not yet ready
    idx.complete_store(ks(7, 9), False, CLIENT)
    assert idx.lookup(ks(7)) == 1
    assert idx.lookup(ks(9)) == 0

    assert idx.take_events() == [removed(2, 3, 4), stored(6, 7, 8), removed(8)]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_touch_protects_recent_block(policy: str) -> None:
    """Scenario (vLLM regression): store [1, 2], touch [1], store [2, 3, 4, 5].

    2 is least recent but is one of the call's own keys, so 1 must go instead.
    """
    idx = make_index(policy)
    idx.prepare_store(ks(1, 2), CLIENT)
    idx.complete_store(ks(1, 2), True, CLIENT)
    idx.touch(ks(1))
    plan = idx.prepare_store(ks(2, 3, 4, 5), CLIENT)
    assert plan is not None
    assert plan.evicted_keys == ks(1)
    assert idx.lookup(ks(2)) == 1


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_prepare_store_of_stored_keys_is_empty_plan(policy: str) -> None:
    idx = make_index(policy)
    idx.prepare_store(ks(1), CLIENT)
    idx.complete_store(ks(1), True, CLIENT)
    plan = idx.prepare_store(ks(1), CLIENT)
    assert plan is not None
    assert (plan.keys_to_store, plan.slots, plan.evicted_keys) == ([], [], [])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_writing_block_is_never_evicted(policy: str) -> None:
    """Invariant 2: a block with ref -1 is not evictable, so a full region says no space."""
    idx = make_index(policy)
    assert idx.prepare_store(ks(1, 2, 3, 4), CLIENT) is not None
    assert idx.prepare_store(ks(5), CLIENT) is None
    idx.complete_store(ks(1), True, CLIENT)
    plan = idx.prepare_store(ks(5), CLIENT)
    assert plan is not None
    assert plan.evicted_keys == ks(1)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_eviction_is_all_or_nothing(policy: str) -> None:
    """Invariant 2: when n evictions cannot all be made, none is."""
    idx = make_index(policy)
    idx.prepare_store(ks(1, 2, 3, 4), CLIENT)
    idx.complete_store(ks(1, 2, 3, 4), True, CLIENT)
    idx.prepare_load(ks(1, 2), CLIENT)
    idx.take_events()
    assert idx.prepare_store(ks(5, 6, 7), CLIENT) is None
    assert idx.take_events() == []
    assert idx.lookup(ks(1, 2, 3, 4)) == 4


def test_double_load_needs_two_completes() -> None:
    idx = make_index("lru")
    idx.prepare_store(ks(1, 2, 3, 4), CLIENT)
    idx.complete_store(ks(1, 2, 3, 4), True, CLIENT)
    idx.prepare_load(ks(1), CLIENT)
    idx.prepare_load(ks(1), CLIENT)
    idx.complete_load(ks(1), CLIENT)
    assert idx.prepare_store(ks(5, 6, 7, 8), CLIENT) is None
    idx.complete_load(ks(1), CLIENT)
    assert idx.prepare_store(ks(5, 6, 7, 8), CLIENT) is not None


def test_prepare_load_keeps_key_order_and_rejects_missing() -> None:
    idx = make_index("lru")
    idx.prepare_store(ks(1, 2, 3), CLIENT)
    idx.complete_store(ks(1, 2), True, CLIENT)
    assert idx.prepare_load(ks(2, 1), CLIENT) == [1, 0]
    with pytest.raises(NotFoundError):
        idx.prepare_load(ks(1, 3), CLIENT)  # 3 is still being written
    with pytest.raises(NotFoundError):
        idx.prepare_load(ks(9), CLIENT)


def test_owners_are_enforced_and_dead_client_released() -> None:
    """Invariant 5: a dead client's stores fail and its pins go, at once."""
    idx = make_index("lru")
    idx.prepare_store(ks(1, 2), CLIENT)
    idx.complete_store(ks(1), True, CLIENT)
    with pytest.raises(NotLeasedError):
        idx.complete_store(ks(2), True, client=2)
    idx.prepare_load(ks(1), client=2)
    with pytest.raises(NotLeasedError):
        idx.complete_load(ks(1), CLIENT)
    assert idx.release_client(CLIENT) == (1, 0, True)
    assert idx.release_client(2) == (0, 1, True)
    assert idx.lookup(ks(2)) == 0
    # everything is evictable again: four new keys fit after evicting 1
    plan = idx.prepare_store(ks(5, 6, 7, 8), CLIENT)
    assert plan is not None
    assert plan.evicted_keys == ks(1)


def test_store_cannot_complete_before_every_rank_copied() -> None:
    """Invariant 1/3: success=True over a slot nobody (or not every rank) wrote is refused."""
    pool = ExtentPool(num_extents=1, extent_bytes=4 * 4096)
    layout = KVLayout(tensor_page_bytes=[2048], world_size=2)
    idx = NamespaceIndex(0, "tp2", layout, "fp", SlotPool(pool, 0, 4096))
    plan = idx.prepare_store(ks(1), CLIENT)
    assert plan is not None
    with pytest.raises(InvalidArgumentError):
        idx.complete_store(ks(1), True, CLIENT)
    idx.mark_written(plan.slots, area=0)
    with pytest.raises(InvalidArgumentError):
        idx.complete_store(ks(1), True, CLIENT)
    assert idx.lookup(ks(1)) == 0
    idx.mark_written(plan.slots, area=1)
    idx.complete_store(ks(1), True, CLIENT)
    assert idx.lookup(ks(1)) == 1


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_lookup_counts_the_leading_ready_keys_only(policy: str) -> None:
    """Scenario: lookups whose keys are all ready, ready up to a gap, or ready behind a
    key still being written count exactly the leading ready keys."""
    idx = make_index(policy, num_blocks=8)
    idx.prepare_store(ks(1, 2, 3), CLIENT)
    idx.complete_store(ks(1, 2, 3), True, CLIENT)
    idx.prepare_store(ks(4), CLIENT)  # being written: not visible (invariant 1)

    assert idx.lookup(ks(1, 2, 3)) == 3
    assert idx.lookup(ks(3, 1, 2, 1)) == 4  # repeats count, as in vLLM
    assert idx.lookup(ks(1, 2, 9, 3)) == 2
    assert idx.lookup(ks(1, 4, 2)) == 1
    assert idx.lookup(ks(9, 1)) == 0
    assert idx.lookup([]) == 0
    assert idx.ready_prefix(ks(1, 2, 4)) == 2
    s = idx.statistics()
    assert (s.lookups_total, s.lookup_keys_total, s.hit_keys_total) == (6, 16, 10)
    assert s.lookup_misses_total == 3


@pytest.mark.parametrize("success", [True, False])
def test_stores_of_several_clients_end_in_one_batch(success: bool) -> None:
    """Committed stores of two clients whose copies land (or never do) together end in
    one batch: each client's writes and its uid's blocks in flight are given back."""
    pool = ExtentPool(num_extents=1, extent_bytes=8 * 4096)
    idx = NamespaceIndex(
        0, "two", KVLayout(tensor_page_bytes=[4096]), "fp", SlotPool(pool, 0, 4096)
    )
    idx.uid_of = {1: 1000, 2: 1000, 3: 2000}.__getitem__  # clients 1 and 2: one uid
    plans = {c: idx.prepare_store(ks(10 * c, 10 * c + 1), c) for c in (1, 2, 3)}
    assert dict(idx._inflight_by_uid) == {1000: 4, 2000: 2}
    for c in (1, 2, 3):
        idx.commit(0, c, ks(10 * c, 10 * c + 1), success=True)  # not copied yet: waiting
    assert [idx.writing_by(c) for c in (1, 2, 3)] == [2, 2, 2]
    slots = [s for p in plans.values() if p is not None for s in p.slots]
    if success:
        idx.mark_written(slots, area=0)  # one job's copies land: all six are whole
    else:
        assert idx.expire_commits(time.monotonic() + 3600) == 6  # never copied
    assert [idx.writing_by(c) for c in (1, 2, 3)] == [0, 0, 0]
    assert not idx._inflight_by_uid and not idx._writers and not idx._writes_of
    stats = idx.statistics()
    assert stats.writing_blocks == 0
    assert stats.stored_blocks == (6 if success else 0)
    assert idx.slots.num_free == 8 - stats.stored_blocks
    assert idx.lookup(ks(10, 11, 20, 21, 30, 31)) == (6 if success else 0)

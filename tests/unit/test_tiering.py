"""Tiering on the loop thread (tiering.py) against an in-memory tier whose jobs finish
only when the test says so: cascades, promotions, pins during transfers, failures."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from test_index_story import CopyingIndex, ks

from kvoffload.protocol.messages import KEY_ABSENT, KEY_PROMOTING, KEY_READY, KVLayout
from kvoffloadd.index.index import NamespaceIndex
from kvoffloadd.region.allocator import ExtentPool
from kvoffloadd.region.slots import SlotPool
from kvoffloadd.tiers.base import SecondaryTier, TierJob, TierNamespace, TierResult, WakeFd
from kvoffloadd.tiers.tiering import (
    MAX_PROMOTION_JOB_BLOCKS,
    TIER_CLIENT,
    Tiering,
    promotion_parts,
)

PAGE = 4096
ENGINE = 7


class FakeTier(SecondaryTier):
    """Blocks in a dict; submitted jobs wait in ``pending`` until ``finish``."""

    kind = "fake"

    def __init__(self, name: str, wake: Any) -> None:
        super().__init__(name, 1 << 30, wake)
        self.blocks: dict[tuple[str, bytes], bytes] = {}
        self.pending: list[tuple[bool, TierJob]] = []
        self.jobs_seen: list[tuple[bool, list[bytes]]] = []

    def lookup(self, ns: TierNamespace, keys: Sequence[bytes]) -> list[bool]:
        return [(ns.tier_id, k) in self.blocks for k in keys]

    def submit_store(self, job: TierJob) -> None:
        self.pending.append((True, job))
        self.jobs_seen.append((True, list(job.keys)))

    def submit_load(self, job: TierJob) -> None:
        self.pending.append((False, job))
        self.jobs_seen.append((False, list(job.keys)))

    def finish(self, fail: Sequence[bytes] = ()) -> None:
        """Run every pending job, as the tier's threads would."""
        for store, job in self.pending:
            ok = []
            for key, buf in zip(job.keys, job.buffers):
                e = (job.ns.tier_id, key)
                good = key not in fail and (store or e in self.blocks)
                if good and store:
                    self.blocks[e] = bytes(buf)
                elif good:
                    buf[:] = self.blocks[e]
                ok.append(good)
            self.finished.post("job", TierResult(job.job_id, ok, 0, 0.0))
        self.pending = []

    def get_finished(self) -> list[TierResult]:
        return [r for _, r in self.finished.take()]

    def statistics(self) -> dict[str, Any]:
        return self.base_statistics(len(self.blocks), 0, True)

    def close(self) -> None:
        assert self.tier_threads.close(10.0)


@pytest.fixture
def world() -> Iterator[tuple[NamespaceIndex, Tiering, FakeTier, FakeTier, np.ndarray]]:
    buf = np.zeros(4 * PAGE, dtype=np.uint8)
    pool = ExtentPool(num_extents=1, extent_bytes=4 * PAGE)
    index = CopyingIndex(0, "t", KVLayout([PAGE]), "fp", SlotPool(pool, 0, PAGE))
    index.events.subscribe(0)
    wake = WakeFd()
    fast, slow = FakeTier("fast", wake), FakeTier("slow", wake)
    tiering = Tiering([fast, slow], wake, buf, max_inflight_blocks=2, batch_blocks=8)
    tiering.namespace_opened(index)
    yield index, tiering, fast, slow, buf
    tiering.close()


def write(index: NamespaceIndex, buf: np.ndarray, *ids: int) -> None:
    """An engine stores blocks ``ids``; block i is filled with byte i."""
    plan = index.prepare_store(ks(*ids), ENGINE)
    assert plan is not None
    for i, slot in zip(ids, plan.slots):
        buf[slot * PAGE : (slot + 1) * PAGE] = i
    index.complete_store(ks(*ids), True, ENGINE)


def settle(tiering: Tiering, *tiers: FakeTier, fail: Sequence[bytes] = ()) -> None:
    for t in tiers:
        t.finish(fail)
    tiering.on_wake()


def test_a_store_cascades_to_every_tier_with_its_slot_pinned_meanwhile(world: Any) -> None:
    index, tiering, fast, slow, buf = world
    write(index, buf, 1, 2)
    assert fast.jobs_seen == [(True, ks(1, 2))] and slow.jobs_seen == [(True, ks(1, 2))]
    assert index.pinned_by(TIER_CLIENT) == 4  # two tiers x two blocks, until they read them
    write(index, buf, 3, 4)  # the region is full; 1 and 2 are being cascaded
    assert index.prepare_store(ks(5, 6, 7), ENGINE) is None  # only 3, 4 are evictable
    assert tiering.statistics()["fast"]["cascade_backlog_blocks"] == 2
    settle(tiering, fast, slow)  # 1, 2 are in; 3, 4 go out (two blocks in flight per tier)
    assert fast.jobs_seen[-1] == (True, ks(3, 4)) and index.pinned_by(TIER_CLIENT) == 4
    settle(tiering, fast, slow)
    assert index.pinned_by(TIER_CLIENT) == 0
    assert {k for _, k in fast.blocks} == set(ks(1, 2, 3, 4))
    assert fast.blocks[(next(iter(fast.blocks))[0], ks(1)[0])] == bytes([1]) * PAGE


def test_a_block_the_tier_holds_is_not_written_again(world: Any) -> None:
    index, tiering, fast, slow, buf = world
    write(index, buf, 1)
    settle(tiering, fast, slow)
    index.evict(ks(1))
    assert tiering.lookup(index, ks(1)) is None  # promoted from the fast tier
    settle(tiering, fast, slow)
    assert tiering.lookup(index, ks(1)) == 1
    assert [s for s, _ in fast.jobs_seen] == [True, False]  # no second store
    assert [s for s, _ in slow.jobs_seen] == [True]


def test_a_miss_promotes_the_leading_run_in_one_job_and_answers_later(world: Any) -> None:
    index, tiering, fast, slow, buf = world
    write(index, buf, 1, 2, 3)
    settle(tiering, fast, slow)
    index.evict()
    buf[:] = 0
    assert tiering.lookup(index, ks(1, 2, 3, 9)) is None
    assert fast.jobs_seen[-1] == (False, ks(1, 2, 3))  # one batched load, fastest tier
    assert not slow.pending
    # while promoted, the slots are being written: not evictable, lookups say later
    assert index.prepare_store(ks(8, 9), ENGINE) is None
    assert tiering.probe(index, ks(1, 9)) == [KEY_PROMOTING, KEY_ABSENT]
    settle(tiering, fast, slow)
    assert tiering.lookup(index, ks(1, 2, 3, 9)) == 3
    assert tiering.probe(index, ks(1, 2, 3, 9, 1)) == [KEY_READY] * 3 + [KEY_ABSENT]
    for i, slot in zip((1, 2, 3), index.slots_of(ks(1, 2, 3))):
        assert (buf[slot * PAGE : (slot + 1) * PAGE] == i).all()
    events = index.take_events(0)
    assert events[-1].keys == ks(1, 2, 3) and not events[-1].removed


@pytest.mark.parametrize(
    ("n", "jobs", "sizes"),
    [
        (128, 1, [128]),  # a disk tier: one job, spread over its promotion threads
        (128, 4, [32, 32, 32, 32]),  # a job per Redis connection
        (6, 4, [2, 2, 1, 1]),
        (3, 4, [1, 1, 1]),
        (1, 1, [1]),
        (0, 4, []),
        (MAX_PROMOTION_JOB_BLOCKS + 1, 1, [129, 128]),
        (1000, 2, [250, 250, 250, 250]),
    ],
)
def test_a_lookups_keys_go_to_a_tier_in_as_many_jobs_as_it_runs_at_once(
    n: int, jobs: int, sizes: list[int]
) -> None:
    parts = promotion_parts(n, jobs)
    assert [len(p) for p in parts] == sizes
    assert [i for p in parts for i in p] == list(range(n))  # in order, each key once


def test_a_tier_with_several_connections_gets_a_promotion_in_parallel_jobs(world: Any) -> None:
    index, tiering, fast, slow, buf = world
    write(index, buf, 1, 2, 3)
    settle(tiering, fast, slow)
    index.evict()
    fast.promotion_jobs = 2
    assert tiering.lookup(index, ks(1, 2, 3)) is None
    assert fast.jobs_seen[-2:] == [(False, ks(1, 2)), (False, ks(3))]
    settle(tiering, fast, slow)
    assert tiering.lookup(index, ks(1, 2, 3)) == 3


def test_a_failed_promotion_frees_its_slot_and_the_key_misses(world: Any) -> None:
    index, tiering, fast, slow, buf = world
    write(index, buf, 1, 2)
    settle(tiering, fast, slow)
    index.evict()
    free_before = index.slots.num_free
    assert tiering.lookup(index, ks(1, 2)) is None
    del fast.blocks[(next(iter(fast.blocks))[0], ks(2)[0])]  # lost under the tier
    settle(tiering, fast, slow, fail=ks(2))
    assert tiering.lookup(index, ks(1)) == 1
    assert index.slots.num_free == free_before - 1
    stats = tiering.statistics()["fast"]
    assert stats["promoted_blocks_total"] == 1 and stats["promotion_failures_total"] == 1
    # the slow tier still has 2: the next lookup promotes it from there
    assert tiering.lookup(index, ks(1, 2)) is None
    assert slow.jobs_seen[-1] == (False, ks(2))


def test_a_block_evicted_before_its_cascade_starts_is_skipped(world: Any) -> None:
    index, tiering, fast, slow, buf = world
    write(index, buf, 1, 2)  # max_inflight_blocks = 2 per tier
    write(index, buf, 3)  # waits in the backlog
    index.evict(ks(3))
    settle(tiering, fast, slow)
    settle(tiering, fast, slow)
    assert {k for _, k in fast.blocks} == set(ks(1, 2))
    assert tiering.statistics()["fast"]["cascade_dropped_total"] == 1


def test_without_space_for_the_promotion_the_lookup_misses(world: Any) -> None:
    index, tiering, fast, slow, buf = world
    write(index, buf, 1)
    settle(tiering, fast, slow)
    index.evict()
    write(index, buf, 2, 3, 4, 5)
    index.prepare_load(ks(2, 3, 4, 5), ENGINE)  # everything pinned: nothing to evict
    assert tiering.lookup(index, ks(1)) == 0
    assert tiering.probe(index, ks(1)) == [KEY_ABSENT]


def test_without_space_the_first_key_to_promote_misses_even_after_ready_ones(
    world: Any,
) -> None:
    index, tiering, fast, slow, buf = world
    write(index, buf, 1, 3)
    settle(tiering, fast, slow)
    index.evict(ks(1, 3))
    write(index, buf, 2, 4, 5, 6)
    index.prepare_load(ks(2, 4, 5, 6), ENGINE)  # region full and pinned
    # 1 is on a tier, 2 is ready, 3 is on a tier: nothing can be promoted
    assert tiering.probe(index, ks(1, 2, 3)) == [KEY_ABSENT]
    assert tiering.lookup(index, ks(2, 3)) == 1


def test_an_unhealthy_tier_gets_no_cascades(world: Any) -> None:
    index, tiering, fast, slow, buf = world
    slow.healthy = False
    write(index, buf, 1)
    assert slow.jobs_seen == [] and fast.jobs_seen == [(True, ks(1))]
    assert tiering.statistics()["slow"]["cascade_dropped_total"] == 1
    assert index.pinned_by(TIER_CLIENT) == 1  # only the fast tier's copy pins it


def test_a_tier_whose_job_hangs_is_stalled_until_it_finishes(world: Any) -> None:
    """A hung tier (a dead disk, a stuck server) stays inside its tier: after
    job_timeout_s its keys miss and it gets no new work; its slots stay pinned (a tier
    thread may still touch them) and it is used again once its late jobs finish."""
    index, tiering, fast, slow, buf = world
    fast.blocks[(tiering._ns[0][1].tier_id, ks(9)[0])] = bytes(PAGE)
    write(index, buf, 1)  # cascades to both tiers; slow never finishes
    fast.finish()
    tiering.on_wake()
    start = min(j.started_s for j in tiering._jobs.values())
    tiering.check_stalls(start + tiering.job_timeout_s / 2)
    assert not tiering.statistics()["slow"]["stalled"]
    tiering.check_stalls(start + tiering.job_timeout_s + 1)
    stats = tiering.statistics()["slow"]
    assert stats["stalled"] and not stats["healthy"] and stats["stalls_total"] == 1
    assert index.pinned_by(TIER_CLIENT) == 1  # the hung copy's slot stays pinned
    write(index, buf, 2)  # no new cascade for the stalled tier
    assert slow.jobs_seen == [(True, ks(1))]
    slow.blocks[(tiering._ns[0][1].tier_id, ks(8)[0])] = bytes(PAGE)
    assert tiering.probe(index, ks(8)) == [KEY_ABSENT]  # its keys miss
    assert tiering.probe(index, ks(9)) == [KEY_PROMOTING]  # other tiers still serve
    slow.finish()
    tiering.on_wake()
    tiering.check_stalls(start + tiering.job_timeout_s + 2)
    assert not tiering.statistics()["slow"]["stalled"]
    assert tiering.probe(index, ks(8)) == [KEY_PROMOTING]

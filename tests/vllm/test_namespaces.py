"""The scheduler's manager over several namespaces (KV cache groups, pipeline stages),
and how often it talks to the daemon: logic only, over fake namespaces."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from kvoffload.engine.view import EngineView
from kvoffload.namespace import Snapshot
from kvoffload.plans import StorePlan
from kvoffload.protocol import messages as m
from kvoffload.protocol.packing import pack_ids, pack_keys
from kvoffload.vllm.manager import KVOffloadManager, SlotsSpec

CTX = ReqContext(req_id="r")
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def key(i: int, group: int = 0) -> bytes:
    made: bytes = make_offload_key(b"block-%04d" % i, group)
    return made


class FakeClient:
    """One connection: what was written, how often it was read."""

    def __init__(self) -> None:
        self.queued: list[m.Request] = []
        self.posted: list[m.Request] = []
        self.writes = self.reads = self.adopts = 0

    def adopt(self) -> None:
        self.adopts += 1

    def poll(self) -> None:  # as the client's: write what is queued, then read
        self.flush()
        self.reads += 1

    def post(self, msg: m.Request) -> bool:
        self.queued.append(msg)
        self.posted.append(msg)
        return True

    def flush(self) -> None:
        if self.queued:
            self.writes += 1
        self.queued = []


class FakeNamespace:
    tiers = 0

    def __init__(self, client: FakeClient, ns_id: int, ready: Sequence[bytes] = ()) -> None:
        self.client, self.ns_id, self.lease = client, ns_id, 100 + ns_id
        self.name = f"ns{ns_id}"
        self.view: EngineView | None = None
        self.connected = True
        self.space = True  # the daemon can plan a store (blocking fallback)
        self.snap = Snapshot(list(ready), list(range(len(ready))), 1)

    def attach_view(self, view: EngineView) -> bool:
        self.view = view
        return self.connected

    def snapshot(self) -> Snapshot:
        return self.snap

    def post(self, msg: m.Request, flush: bool = True) -> bool:
        self.client.post(msg)
        if flush:
            self.client.flush()
        return True

    def send_and_wait(self, msg: m.StepBatch) -> bool:
        return True

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        if not self.space:
            return None
        return StorePlan(list(keys), [500 + self.ns_id * 100 + i for i in range(len(keys))], [])

    def grant(self, *slots: int) -> None:
        assert self.view is not None
        self.view.on_push(m.LeaseGrant(0, self.ns_id, pack_ids(list(slots))))

    def stored(self, keys: list[bytes], slots: list[int], seq: int, removed: bool = False) -> None:
        assert self.view is not None
        packed, kb = pack_keys(keys)
        event = m.EventMsg(packed, kb, removed, b"" if removed else pack_ids(slots))
        self.view.on_push(m.FeedPush(0, self.ns_id, seq, [event]))


def manager(
    groups: int = 1, stages: int = 2, interval_s: float = 0.0
) -> tuple[KVOffloadManager, list[list[FakeNamespace]], FakeClient]:
    client = FakeClient()
    nss = [[FakeNamespace(client, g * stages + s) for s in range(stages)] for g in range(groups)]
    mgr = KVOffloadManager(
        nss,  # type: ignore[arg-type]  # fakes of Namespace
        list(range(groups)),
        batch_interval_s=interval_s,
        enable_events=True,
    )
    for per in nss:
        for ns in per:
            ns.grant(*range(ns.ns_id * 100, ns.ns_id * 100 + 40))
    client.writes = client.reads = client.adopts = 0  # the views' start-up is not a step
    client.posted.clear()
    return mgr, nss, client


def test_a_key_is_a_hit_only_when_every_stage_holds_it() -> None:
    mgr, ((s0, s1),), _ = manager()
    s0.stored([key(1), key(2)], [1, 2], 2)
    s1.stored([key(2)], [9], 2)
    assert [mgr.lookup(k, CTX) for k in (key(1), key(2), key(3))] == [MISS, HIT, MISS]
    spec = mgr.prepare_load([key(2)], CTX)
    assert isinstance(spec, SlotsSpec) and spec.stage_slots == [[2], [9]]
    assert spec.block_ids.tolist() == [2]


def test_a_store_plans_a_slot_in_each_stage_but_where_the_stage_holds_the_key() -> None:
    mgr, ((s0, s1),), _ = manager()
    s1.stored([key(1)], [77], 2)  # stage 1 kept it, stage 0 did not
    out = mgr.prepare_store([key(1), key(2)], CTX)
    assert out is not None and out.keys_to_store == [key(1), key(2)]
    spec = out.store_spec
    assert isinstance(spec, SlotsSpec)
    assert spec.stage_slots[1][0] == -1 and min(spec.stage_slots[0]) >= 0
    assert spec.leases == [[s0.lease], [s1.lease]]
    assert [mgr.lookup(k, CTX) for k in (key(1), key(2))] == [PENDING, PENDING]


def test_no_space_in_one_stage_stores_nothing_and_the_other_lets_its_slots_go() -> None:
    mgr, ((s0, s1),), client = manager()
    s1.view.leases.clear()  # type: ignore[union-attr]
    s1.space = False
    assert mgr.prepare_store([key(1)], CTX) is None  # vLLM counts it, asks again later
    assert mgr.lookup(key(1), CTX) == MISS
    mgr.on_schedule_end(None)
    (batch,) = [x for x in client.posted if isinstance(x, m.StepBatch) and x.claim_keys]
    assert batch.ns == s0.ns_id
    assert batch.claim_keys == batch.fail_keys == key(1)  # claimed, and given up at once


def test_a_stage_that_is_away_stores_nothing_of_its_group() -> None:
    mgr, ((_, s1),), _ = manager()
    s1.view.lost()  # type: ignore[union-attr]
    out = mgr.prepare_store([key(1)], CTX)
    assert out is not None and out.keys_to_store == []  # nothing to do: vLLM moves on


def test_keys_go_to_their_groups_namespaces() -> None:
    mgr, ((g0,), (g1,)), _ = manager(groups=2, stages=1)
    out = mgr.prepare_store([key(1, 0), key(2, 0), key(1, 1)], CTX)
    assert out is not None
    assert out.store_spec.leases == [[g0.lease, g1.lease]]
    g1.stored([key(1, 1)], [5], 2)
    assert mgr.lookup(key(1, 1), CTX) == HIT and mgr.lookup(key(1, 0), CTX) == PENDING
    assert key(1, 0) in g0.view.writing and key(1, 1) not in g0.view.writing  # type: ignore[union-attr]


def test_events_say_stored_once_every_stage_holds_a_key_and_removed_once_one_lost_it() -> None:
    mgr, ((s0, s1),), _ = manager()
    s0.stored([key(1)], [1], 2)
    assert list(mgr.take_events()) == []
    s1.stored([key(1)], [2], 2)
    assert [(e.keys, e.removed) for e in mgr.take_events()] == [([key(1)], False)]
    s0.stored([key(1)], [], 3, removed=True)
    assert [(e.keys, e.removed) for e in mgr.take_events()] == [([key(1)], True)]


@pytest.mark.parametrize("interval_s", [0.0, 3600.0])
def test_an_engine_writes_and_reads_at_most_once_per_interval(interval_s: float) -> None:
    mgr, _, client = manager(groups=2, stages=2, interval_s=interval_s)
    for _ in range(5):  # five steps, each storing in every namespace
        mgr.lookup(key(9), CTX)
        mgr.prepare_store([key(10 + client.adopts, 0), key(10 + client.adopts, 1)], CTX)
        mgr.on_schedule_end(None)
    assert client.adopts == 5  # every step adopts a connection the keeper made
    if interval_s:
        assert (client.reads, client.writes) == (1, 1)  # the first step's only
        assert client.queued == []  # (the batches wait in the views)
        mgr.has_pending_work()  # the engine idles: everything goes now
        assert client.writes == 2
    else:
        assert (client.reads, client.writes) == (5, 5)  # one read and one write a step

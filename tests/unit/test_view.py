"""The engine view's rules, against a fake namespace: what each call answers locally,
what the step's one batch carries and in which order, and how outages and reconnects
change the answers. No daemon, no sockets, no sleeps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import pytest

from kvoffload.engine.view import WISH_SENDS, EngineView, KeyState
from kvoffload.namespace import Snapshot
from kvoffload.plans import StorePlan
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import DaemonUnavailableError
from kvoffload.protocol.packing import pack_ids, pack_keys, unpack_ids, unpack_keys

HIT, MISS, PENDING = KeyState.HIT, KeyState.MISS, KeyState.HIT_PENDING


def k(*ids: int) -> list[bytes]:
    return [b"key-%04d" % i for i in ids]


class FakeNamespace:
    """What a view needs from a namespace: pushes to deliver, one-way messages sent."""

    ns_id = 3
    lease = 77

    def __init__(self, snapshot: Snapshot | None = None) -> None:
        self.view: EngineView | None = None
        self.connected = snapshot is not None
        self.snap = snapshot or Snapshot([], [], 0)
        self.inbox: list[m.Reply] = []
        self.sent: list[m.StepBatch] = []
        self.blocking: list[list[bytes]] = []
        self.polls = 0
        self.grant_on_wait: list[int] = []  # what a blocking batch brings back

    def attach_view(self, view: EngineView) -> bool:
        self.view = view
        return self.connected

    def poll(self) -> None:
        self.polls += 1
        assert self.view is not None
        pushes, self.inbox = self.inbox, []
        for msg in pushes:
            self.view.on_push(msg)

    def post(self, msg: m.Request, flush: bool = True) -> bool:
        assert isinstance(msg, m.StepBatch)
        if self.connected:
            self.sent.append(msg)
        return self.connected

    def send_and_wait(self, msg: m.StepBatch) -> bool:
        self.sent.append(msg)
        if self.grant_on_wait:
            self.grant(*self.grant_on_wait)
            self.grant_on_wait = []
            self.poll()
        return self.connected

    def snapshot(self) -> Snapshot:
        if not self.connected:
            raise DaemonUnavailableError("away")
        return self.snap

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        self.blocking.append(list(keys))
        return StorePlan(list(keys), [900 + i for i in range(len(keys))], [])

    # the daemon's side
    def grant(self, *slots: int) -> None:
        self.inbox.append(m.LeaseGrant(0, self.ns_id, pack_ids(list(slots))))

    def feed(self, seq: int, *events: tuple[list[bytes], bool, list[int]]) -> None:
        msgs = [
            m.EventMsg(*pack_keys(ks), rm, pack_ids(sl) if sl else b"") for ks, rm, sl in events
        ]
        self.inbox.append(m.FeedPush(0, self.ns_id, seq, msgs))


class Fields(TypedDict):
    """A batch's fields, keys unpacked."""

    claims: list[tuple[bytes, int]]
    pins: list[bytes]
    unpins: list[bytes]
    commits: list[bytes]
    fails: list[bytes]
    ack: int
    want: int


def fields(batch: m.StepBatch) -> Fields:
    kb = batch.key_bytes

    def keys(packed: bytes) -> list[bytes]:
        return unpack_keys(packed, kb) if packed else []

    return {
        "claims": list(zip(keys(batch.claim_keys), unpack_ids(batch.claim_slots).tolist())),
        "pins": keys(batch.pin_keys),
        "unpins": keys(batch.unpin_keys),
        "commits": keys(batch.commit_keys),
        "fails": keys(batch.fail_keys),
        "ack": batch.ack_seq,
        "want": batch.want_leases,
    }


def connected_view(**kw: int) -> tuple[EngineView, FakeNamespace]:
    ns = FakeNamespace(Snapshot(k(1, 2), [10, 11], seq=5))
    view = EngineView(ns, **kw)  # type: ignore[arg-type]
    return view, ns


def test_a_view_starts_from_the_snapshot_and_asks_for_leases_at_once() -> None:
    view, ns = connected_view(lease_blocks=16)
    assert view.ready == {k(1)[0]: 10, k(2)[0]: 11}
    assert [fields(b)["want"] for b in ns.sent] == [16]  # before any step needs them
    assert view.blocking_calls_total == 0


def test_a_step_reads_pushes_once_so_a_hit_and_its_load_agree() -> None:
    view, ns = connected_view()
    ns.feed(6, (k(1), True, []))  # evicted by the daemon meanwhile
    assert view.lookup(k(1)[0]) == MISS  # the first call of the step reads it
    ns.feed(7, (k(2), True, []))  # arrives mid-step: not applied until the next step
    assert view.lookup(k(2)[0]) == HIT
    assert view.prepare_load(k(2)) == [11]
    assert ns.polls == 1
    view.end_step()
    assert fields(ns.sent[-1])["pins"] == k(2) and fields(ns.sent[-1])["ack"] == 6


def test_stores_take_leased_slots_and_claim_them_in_the_step_batch() -> None:
    view, ns = connected_view()
    ns.grant(40, 41, 42)
    assert view.prepare_store(k(1, 3, 4, 3)) == (k(3, 4), [41, 42])  # 1 is stored already
    assert view.lookup(k(3)[0]) == PENDING
    assert view.prepare_store(k(3)) == ([], [])  # being stored: nothing to do
    view.end_step()
    assert fields(ns.sent[-1])["claims"] == [(k(3)[0], 41), (k(4)[0], 42)]
    assert view.blocking_calls_total == 0


def test_a_dry_pool_costs_one_round_trip_for_the_whole_step() -> None:
    """A burst (a prefill of many requests) empties the pool: one blocking batch asks
    for more, with the step's claims so far, and the rest of the step uses the grant."""
    view, ns = connected_view(lease_blocks=2)
    ns.grant(40, 41)
    view.lookup(b"")
    assert view.prepare_store(k(1, 10)) == (k(10), [41])
    ns.grant_on_wait = list(range(50, 60))
    assert view.prepare_store(k(11, 12)) == (k(11, 12), [58, 59])
    assert view.prepare_store(k(13)) == (k(13), [57])
    assert view.lease_fallbacks_total == view.blocking_calls_total == 1
    wait = ns.sent[-1]
    assert fields(wait)["claims"] == [(k(10)[0], 41)] and fields(wait)["want"] >= 6


def test_no_room_for_a_grant_falls_back_to_the_daemon_planning_the_store() -> None:
    view, ns = connected_view()
    assert view.prepare_store(k(8)) == (k(8), [900])
    assert ns.blocking == [k(8)] and view.blocking_calls_total == 2  # top-up, then plan
    view.end_step()
    assert fields(ns.sent[-1])["claims"] == []  # the daemon planned it: nothing to claim


def test_a_grant_smaller_than_asked_falls_back_to_the_daemon_planning_the_rest() -> None:
    """The daemon may grant less than the wish (lease shares, per-uid bounds): a store
    that finds too few slots after the top-up is planned by the daemon, counted."""
    view, ns = connected_view(lease_blocks=2)
    view.lookup(b"")
    ns.grant_on_wait = [60]  # one slot, for a store of three keys
    assert view.prepare_store(k(21, 22, 23)) == (k(21, 22, 23), [900, 901, 902])
    assert ns.blocking == [k(21, 22, 23)]
    assert view.lease_fallbacks_total == 1 and view.blocking_calls_total == 2
    assert view.leases == [60]  # kept for the next store
    assert view.prepare_store(k(24)) == (k(24), [60])
    assert view.blocking_calls_total == 2


def test_a_completed_store_is_never_a_hit_before_the_daemon_says_so() -> None:
    view, ns = connected_view()
    ns.grant(40, 41)
    view.lookup(b"")
    view.prepare_store(k(5, 6))
    view.complete_store(k(5), success=True)
    view.complete_store(k(6), success=False)
    assert view.lookup(k(5)[0]) == MISS  # its copy may have been dropped
    assert view.prepare_store(k(5)) == ([], [])  # but not stored twice meanwhile
    view.end_step()
    assert fields(ns.sent[-1])["commits"] == k(5) and fields(ns.sent[-1])["fails"] == k(6)
    ns.feed(6, (k(5), False, [41]))
    assert view.lookup(k(5)[0]) == HIT and view.ready[k(5)[0]] == 41
    assert not view.committing


def test_pins_go_before_the_ack_of_the_feed_they_were_read_from() -> None:
    """The daemon applies a batch in field order: a block this engine pinned locally
    is pinned before the ack that would free an evicted block's slot."""
    view, ns = connected_view()
    ns.feed(9, (k(7), False, [12]))
    view.lookup(b"")
    view.prepare_load(k(7))
    view.complete_load(k(1))  # not pinned here: nothing to unpin
    view.end_step()
    batch = ns.sent[-1]
    assert fields(batch)["pins"] == k(7) and fields(batch)["unpins"] == []
    assert batch.ack_seq == 9
    assert m.StepBatch.__struct_fields__.index("pin_keys") < m.StepBatch.__struct_fields__.index(
        "ack_seq"
    )


def test_nothing_is_sent_in_a_step_where_nothing_changed() -> None:
    view, ns = connected_view()
    view.end_step()
    sent = len(ns.sent)
    view.end_step()
    view.end_step()
    assert len(ns.sent) == sent


def test_the_lease_wish_follows_the_store_rate() -> None:
    view, ns = connected_view(lease_blocks=4, max_lease_blocks=100)
    ns.grant(*range(50, 80))
    view.lookup(b"")
    view.prepare_store(k(*range(100, 120)))  # 20 stores in one step
    view.end_step()
    assert fields(ns.sent[-1])["want"] == 20 * WISH_SENDS


def test_a_top_up_within_a_step_leaves_a_wish_for_the_whole_step() -> None:
    view, ns = connected_view(lease_blocks=2, max_lease_blocks=100)
    ns.grant(40, 41)
    view.lookup(b"")
    ns.grant_on_wait = list(range(50, 60))
    view.prepare_store(k(30, 31, 32))  # one more than the pool: a top-up
    view.prepare_store(k(*range(33, 40)))  # 7 more, from the grant
    view.end_step()
    assert view.lease_fallbacks_total == 1
    assert fields(ns.sent[-1])["want"] == 10 * WISH_SENDS  # the step's 10, not its last 7


def test_an_outage_answers_miss_at_once_and_stores_have_nothing_to_do() -> None:
    view, ns = connected_view()
    ns.grant(40)
    view.lookup(b"")
    view.prepare_store(k(9))
    view.prepare_load(k(2))
    ns.connected = False
    view.lost()
    view.end_step()
    assert view.lookup(k(1)[0]) == MISS and view.lookup(k(9)[0]) == MISS
    assert view.prepare_store(k(11)) == ([], [])
    assert view.blocking_calls_total == 0


def test_a_reconnect_starts_from_a_snapshot_and_pins_again() -> None:
    view, ns = connected_view()
    view.lookup(b"")
    view.prepare_load(k(1, 1, 2))
    view.end_step()
    view.lost()
    ns.sent.clear()
    view.adopt(Snapshot(k(2, 3), [20, 21], seq=1))
    assert view.ready == {k(2)[0]: 20, k(3)[0]: 21}
    assert sorted(fields(ns.sent[-1])["pins"]) == sorted(k(1, 1, 2))
    view.complete_load(k(1, 1, 2))
    view.end_step()
    assert sorted(fields(ns.sent[-1])["unpins"]) == sorted(k(1, 1, 2))


def test_a_feed_with_a_gap_resyncs_from_a_snapshot() -> None:
    view, ns = connected_view()
    ns.snap = Snapshot(k(4), [30], seq=40)
    ns.inbox.append(m.FeedPush(0, ns.ns_id, 39, [], lost=True))
    assert view.lookup(k(4)[0]) == HIT
    assert view.lookup(k(1)[0]) == MISS
    assert view.resyncs_total == 1 and view.blocking_calls_total == 1


def test_keys_of_another_length_go_in_a_batch_of_their_own() -> None:
    view, ns = connected_view()
    view.lookup(b"")
    view.prepare_load([b"short"])
    view.prepare_load([b"longer-key"])
    view.end_step()
    assert [b.key_bytes for b in ns.sent[-2:]] == [5, 10]


@pytest.mark.parametrize("events", [True, False])
def test_vllm_events_report_what_the_feed_said(events: bool) -> None:
    ns = FakeNamespace(Snapshot([], [], 0))
    view = EngineView(ns, keep_events=events)  # type: ignore[arg-type]
    ns.feed(1, (k(1, 2), False, [5, 6]), (k(1), True, []))
    view.lookup(b"")
    assert view.events == ([(k(1, 2), False), (k(1), True)] if events else [])

"""The region is shared per uid: a uid's share of leases and of extents holds across all
its namespaces, and leases nobody uses go back (invariant 11)."""

from __future__ import annotations

import time

from test_namespace_table import config, open_ns, service, session

from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import KVOffloadError
from kvoffload.protocol.packing import pack_keys, unpack_ids
from kvoffloadd.service.service import Service
from kvoffloadd.service.session import Session

HOG, STORER = 4001, 4002


def wish(svc: Service, s: Session, ns: int, n: int) -> list[int]:
    """A one-way lease wish; the slots granted."""
    s.pushes.clear()
    svc.handle(s, m.StepBatch(0, ns, 8, want_leases=n))
    return [
        slot
        for p in s.pushes
        if isinstance(p, m.LeaseGrant) and p.ns == ns
        for slot in unpack_ids(p.slots).tolist()
    ]


def test_a_uid_wishing_every_lease_of_many_namespaces_leases_one_eighth_of_the_region() -> None:
    """Issue scenario: a uid that stores nothing opened 8 namespaces and wished 2^40
    leases in each: it held the region (1/8 of each namespace's largest size) and the
    storing uid kept 10% of its blocks."""
    with service(config()) as svc:
        g = svc.region.geometry
        data = g.num_extents * g.extent_bytes
        hog = session(svc, 1, HOG)
        leased = 0
        for i in range(8):
            ns = open_ns(svc, hog, f"hog-{i}")
            leased += len(wish(svc, hog, ns, 1 << 40)) * svc.namespaces[ns].slots.slot_bytes
        assert 0 < leased <= data // 8
        assert svc.ledger["leased_bytes"].held_by_uid(HOG) == leased
        # the storing uid still leases (and so stores into) the rest
        storer = session(svc, 2, STORER)
        ns = open_ns(svc, storer, "mine")
        assert len(wish(svc, storer, ns, 1 << 40)) * 64 * 1024 > 0
        svc.close_session(hog)
        assert svc.ledger["leased_bytes"].held_by_uid(HOG) == 0


def test_leases_nobody_claims_go_back_and_the_engine_is_told() -> None:
    with service(config(lease_timeout_s=30)) as svc:
        a = session(svc, 1, HOG)
        ns = open_ns(svc, a, "idle")
        granted = wish(svc, a, ns, 16)
        assert granted and svc.namespaces[ns].leases.unclaimed(a.leases[ns]) == 16
        index = svc.namespaces[ns]
        svc.members.take_back_leases(index, time.monotonic() + 1)  # still fresh: kept
        assert index.leases.unclaimed(a.leases[ns]) == 16
        a.pushes.clear()
        svc.members.take_back_leases(index, time.monotonic() + 31)
        revoked = [p for p in a.pushes if isinstance(p, m.LeaseRevoke)]
        assert len(revoked) == 1 and sorted(unpack_ids(revoked[0].slots).tolist()) == sorted(
            granted
        )
        assert index.leases.unclaimed(a.leases[ns]) == 0 and index.slots.num_used == 0
        assert svc.ledger["leased_bytes"].held(1) == 0 and a.want_leases[ns] == 0
        # a claim of a slot taken back is refused (counted), never an error
        kp = b"k" * 8
        svc.handle(a, m.StepBatch(0, ns, 8, claim_keys=kp, claim_slots=revoked[0].slots[:8]))
        assert svc.engines.refused_claims_total == 1
        assert wish(svc, a, ns, 4)  # a new wish gets fresh ones


def test_more_namespaces_buy_a_uid_no_more_of_the_region() -> None:
    """A uid filling the region through 8 namespaces, and a second uid storing into
    one: the second takes half the region back (an equal share per uid), not the 1/9
    an equal share per namespace would leave it."""
    with service(config(region_size="24MiB")) as svc:
        hog = session(svc, 1, HOG)
        total = svc.region.geometry.num_extents
        for i in range(8):
            ns = open_ns(svc, hog, f"hog-{i}")
            fill(svc, hog, ns, f"h{i}", total)
        assert svc.region.pool.num_free == 0
        storer = session(svc, 2, STORER)
        ns = open_ns(svc, storer, "mine")
        fill(svc, storer, ns, "s", total)
        mine = svc.namespaces[ns].slots.num_extents
        assert mine >= total // 2 - 1, f"the storing uid holds {mine} of {total} extents"


def fill(svc: Service, s: Session, ns: int, tag: str, extents: int) -> None:
    """Store blocks until the namespace cannot take more (a region's worth at most)."""
    per_extent = svc.region.geometry.extent_bytes // (64 * 1024)
    for i in range(extents * per_extent):
        key = f"{tag}-{i:06d}".encode()
        kp, kb = pack_keys([key])
        try:
            r = svc.handle(s, m.PrepareStore(2, ns, kp, kb))
        except KVOffloadError:
            return
        assert isinstance(r, m.StorePlanReply)
        slots = unpack_ids(r.slots).tolist()
        svc.namespaces[ns].mark_written(slots, 0)
        svc.handle(s, m.CompleteStore(3, ns, kp, kb, True))

"""The namespace table and the region's share-out under a hostile local user: names
that cannot alias after a restart, a table nobody can fill for good, stores nobody can
hold open for good, and a crash that leaves nothing behind (invariants 10 and 11)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from kvoffload.datapath.regionfmt import MAX_NAMESPACES, SLOT_GRAVE, SLOT_READY
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import (
    InvalidArgumentError,
    LayoutMismatchError,
    NoSpaceError,
    NotFoundError,
    QuotaExceededError,
)
from kvoffload.protocol.packing import pack_keys, unpack_ids
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import CpuCopier
from kvoffloadd.index.index import NamespaceIndex
from kvoffloadd.region.region import Geometry, SharedOffloadRegion
from kvoffloadd.service.service import Service
from kvoffloadd.service.session import Session

MIB = 1 << 20
OTHER = 4242  # neither root nor the daemon's uid
LAYOUT = m.KVLayout([64 * 1024])


def config(**fields: object) -> DaemonConfig:
    base = {
        "instance": f"n{uuid.uuid4().hex[:8]}",
        "region_size": "16MiB",
        "extent_size": "1MiB",
        "limits": {"namespaces": {"per_connection": 1024}},  # a table's worth on one
    }
    return msgspec.convert(base | fields, DaemonConfig).validate()


def geometry(cfg: DaemonConfig) -> Geometry:
    return Geometry.plan(cfg.region_bytes, MIB, 4096)


@contextlib.contextmanager
def service(cfg: DaemonConfig, *, unlink: bool = True) -> Iterator[Service]:
    region = SharedOffloadRegion(cfg.region_name, geometry(cfg))
    copier = CpuCopier(1)
    try:
        yield Service(cfg, region, copier)
    finally:
        copier.close()
        region.close(unlink=unlink)


def session(svc: Service, sid: int, uid: int = 0) -> Session:
    return svc.sessions.get(sid) or svc.open_session(sid, os.getpid(), uid, uid)


def open_ns(svc: Service, s: Session, name: str) -> int:
    r = svc.handle(s, m.OpenNamespace(1, name, LAYOUT))
    assert isinstance(r, m.NamespaceOpened)
    return r.ns


def open_ns_layout(svc: Service, s: Session, name: str, layout: m.KVLayout) -> int:
    r = svc.handle(s, m.OpenNamespace(1, name, layout))
    assert isinstance(r, m.NamespaceOpened)
    return r.ns


def prepare(svc: Service, s: Session, ns: int, keys: list[bytes]) -> list[int]:
    kp, kb = pack_keys(keys)
    r = svc.handle(s, m.PrepareStore(2, ns, kp, kb))
    assert isinstance(r, m.StorePlanReply)
    slots: list[int] = unpack_ids(r.slots).tolist()
    return slots


def complete(svc: Service, s: Session, ns: int, keys: list[bytes], slots: list[int]) -> None:
    svc.namespaces[ns].mark_written(slots, 0)
    kp, kb = pack_keys(keys)
    svc.handle(s, m.CompleteStore(3, ns, kp, kb, True))


@pytest.mark.parametrize(
    "name",
    ["victim\0", "\0" * 8, "a\nb", "esc\x1b[2J", "tab\tname", "", "x" * 201, "é" * 128],
    ids=["nul-suffix", "all-nul", "newline", "escape", "tab", "empty", "201-chars", "256-bytes"],
)
def test_a_name_that_could_alias_or_not_fit_is_refused(name: str) -> None:
    """Item 7: "victim\\0" became "victim" after a warm restart (the record is
    NUL-terminated), and a name of NULs was never recovered."""
    with service(config()) as svc:
        s = session(svc, 1, OTHER)
        with pytest.raises(InvalidArgumentError, match="namespace name"):
            svc.handle(s, m.OpenNamespace(1, name, LAYOUT))
        assert not svc.namespaces and svc.region.namespace_record(0) is None
        assert open_ns(svc, s, "é" * 120 + "-名前") == 0  # printable UTF-8 that fits


def test_bad_records_and_their_extents_do_not_survive_a_restart() -> None:
    """A record whose name is unreadable or not allowed (an older daemon wrote it, or
    the region was edited) is dropped at recovery, and the extents it owned are free."""
    cfg = config()
    with service(cfg, unlink=False) as svc:
        s = session(svc, 1)
        good, bad = open_ns(svc, s, "good"), open_ns(svc, s, "bad")
        for ns in (good, bad):
            keys = [b"%d-key-%02d" % (ns, i) for i in range(20)]
            complete(svc, s, ns, keys, prepare(svc, s, ns, keys))
        pool = svc.region.pool
        used = pool.num_extents - pool.num_free
        fp, raw = svc.namespaces[bad].fingerprint, msgspec.msgpack.encode(LAYOUT)
        svc.region.register_namespace(bad, "\0" * 8, fp, raw)  # an unreadable name
        svc.region.register_namespace(2, "evil\x1b", fp, raw)  # a name not allowed
        assert pool.take(2, 65536, 0) is not None
        svc.namespaces.clear()
    with service(cfg) as svc:
        assert svc.region.recovered and set(svc.table.by_name) == {"good"}
        assert svc.region.namespace_record(2) is None
        pool = svc.region.pool
        assert pool.num_extents - pool.num_free == used // 2  # good's extents only
        assert svc.namespaces[good].lookup([b"%d-key-%02d" % (good, i) for i in range(20)])
        table = svc.region.slot_table
        assert set(table["ns"][table["state"] != 0].tolist()) == {good}


def test_a_join_opens_an_existing_namespace_only_whatever_its_layout() -> None:
    """An engine's scheduler joins the namespace its workers created from their own
    pages; a join never creates one, and a plain open still compares layouts."""
    with service(config()) as svc:
        s = session(svc, 1, OTHER)
        with pytest.raises(NotFoundError, match="does not exist"):
            svc.handle(s, m.OpenNamespace(1, "pages", m.KVLayout([]), join=True))
        assert not svc.namespaces
        ns = open_ns(svc, s, "pages")
        joined = svc.handle(
            session(svc, 2, OTHER), m.OpenNamespace(1, "pages", m.KVLayout([]), True, True)
        )
        assert isinstance(joined, m.NamespaceOpened) and joined.ns == ns
        assert joined.slot_bytes == svc.namespaces[ns].slots.slot_bytes and joined.lease
        with pytest.raises(LayoutMismatchError):
            svc.handle(s, m.OpenNamespace(1, "pages", m.KVLayout([4096])))


def test_a_uid_may_create_a_bounded_number_of_namespaces() -> None:
    """Item 8: one client filled the 256-entry table for good."""
    with service(config(max_namespaces_per_uid=3)) as svc:
        s = session(svc, 1, OTHER)
        for i in range(3):
            open_ns(svc, s, f"mine-{i}")
        with pytest.raises(QuotaExceededError, match="max_namespaces_per_uid"):
            svc.handle(s, m.OpenNamespace(1, "mine-3", LAYOUT))
        assert open_ns(svc, s, "mine-0") == 0  # reopening is not creating
        open_ns(svc, session(svc, 2, 0), "root-0")  # root and the daemon's uid: unlimited
        assert len(svc.namespaces) == 4


def test_a_full_table_drops_an_idle_namespace_and_refuses_only_when_all_are_busy() -> None:
    with service(config(max_namespaces_per_uid=0)) as svc:
        holder, idle = session(svc, 1), session(svc, 2)
        for i in range(MAX_NAMESPACES):
            open_ns(svc, holder if i % 2 else idle, f"ns-{i:03d}")
        used = open_ns(svc, idle, "ns-000")
        keys = [b"used-key"]
        complete(svc, idle, used, keys, prepare(svc, idle, used, keys))
        kp, kb = pack_keys(keys)
        svc.handle(idle, m.Lookup(4, used, kp, kb))
        svc.close_session(idle)  # the even namespaces: open by nobody, nothing in flight
        new = open_ns(svc, session(svc, 3), "newcomer")
        assert new % 2 == 0 and new != used, "the least used idle namespace goes first"
        assert svc.region.namespace_record(new) is not None
        assert svc.region.namespace_record(new)[0] == "newcomer"  # type: ignore[index]
        assert svc.table.dropped_total == 1 and "ns-000" in svc.table.by_name
        # every namespace is now held open: the table refuses, and says why
        s4 = session(svc, 4)
        for name in list(svc.table.by_name):
            open_ns(svc, s4, name)
        with pytest.raises(NoSpaceError, match="table is full"):
            svc.handle(s4, m.OpenNamespace(1, "one-too-many", LAYOUT))


def test_no_client_holds_the_region_with_stores_it_never_completes() -> None:
    """Item 10: one namespace leased the whole region with prepare_store."""
    with service(config(max_writing_fraction=0.25)) as svc:
        index = svc.namespaces[open_ns(svc, session(svc, 1, 1001), "w")]
        per_client, total = index.max_writing_per_client, index.max_writing
        assert per_client is not None and total is not None and per_client < total
        hog, second, third = session(svc, 1), session(svc, 2, 1002), session(svc, 3, 1003)
        hog_too = session(svc, 4, 1001)  # another connection of the hog's uid
        for s in (second, third, hog_too):
            open_ns(svc, s, "w")
        held = prepare(svc, hog, index.ns_id, [b"hog-%04d" % i for i in range(per_client)])
        for s in (hog, hog_too):  # the share is the uid's, however many connections
            with pytest.raises(QuotaExceededError, match="max_writing_fraction"):
                prepare(svc, s, index.ns_id, [b"hog-more"])
        rest = total - per_client
        prepare(svc, second, index.ns_id, [b"two-%04d" % i for i in range(rest)])
        with pytest.raises(QuotaExceededError):  # the namespace's total is spent too
            prepare(svc, third, index.ns_id, [b"three-01"])
        assert index.lease(token=77, n=8, client=3) == []
        complete(svc, hog, index.ns_id, [b"hog-0000"], held[:1])  # one done: room for one
        assert len(prepare(svc, third, index.ns_id, [b"three-01"])) == 1
        svc.close_session(hog)  # a gone client's stores fail and give their room back
        assert len(index.lease(token=77, n=8, client=3)) == 8


def test_a_crash_while_graves_are_held_restores_each_key_once() -> None:
    """Item 14: an evicted block kept for a key mirror (GRAVE) whose key was stored
    again elsewhere came back twice after a warm restart, and its slot leaked."""
    cfg = config()
    keys = [b"k-%04d" % i for i in range(21)]  # one slot of 22 left free
    pid = os.fork()
    if pid == 0:  # the daemon that crashes: it leaves by _exit, closing nothing
        code = 1
        try:
            region = SharedOffloadRegion(cfg.region_name, geometry(cfg))
            svc = Service(cfg, region, CpuCopier(1))
            s = session(svc, 1)
            ns = svc.handle(s, m.OpenNamespace(1, "g", m.KVLayout([MIB // 2])))
            assert isinstance(ns, m.NamespaceOpened)
            complete(svc, s, ns.ns, keys, prepare(svc, s, ns.ns, keys))
            index = svc.namespaces[ns.ns]
            index.events.subscribe(99)  # an engine whose key mirror lags behind
            index.add_mirror(99)
            assert index.evict([keys[0]]) == 1 and len(index.graves.by_slot) == 1
            complete(svc, s, ns.ns, keys[:1], prepare(svc, s, ns.ns, keys[:1]))
            states = region.slot_table["state"]
            code = (
                0 if ((states == SLOT_GRAVE).sum(), (states == SLOT_READY).sum()) == (1, 21) else 2
            )
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    with service(cfg) as svc:
        index = svc.table.by_name["g"]
        assert svc.region.recovered and index.lookup(keys) == len(keys)
        assert index.slots.num_used == len(keys) and index.slots.num_free == 1
        assert not (svc.region.slot_table["state"] == SLOT_GRAVE).any()


def test_a_uid_below_its_share_of_a_full_table_takes_an_entry_from_the_largest_holder() -> None:
    """Issue scenario: 8 uids x 32 namespaces, held open by 8 idle connections, left
    everyone else NO_SPACE. A uid below its fair share now takes the least used entry
    of the uid holding the most (only that uid's connections had it open)."""
    with service(config(max_namespaces_per_uid=0)) as svc:
        hogs = [session(svc, 10 + u, 2000 + u) for u in range(8)]
        for u, s in enumerate(hogs):
            for i in range(32 if u else 33):  # uid 2000 holds one more than the others
                if len(svc.namespaces) < MAX_NAMESPACES:
                    open_ns(svc, s, f"hog{u}-{i:02d}")
        assert len(svc.namespaces) == MAX_NAMESPACES
        newcomer = session(svc, 99, 3000)
        ns = open_ns(svc, newcomer, "mine")
        assert svc.table.by_id[ns].name == "mine" and svc.table.revoked_total == 1
        taken = [p for s in hogs for p in s.pushes if isinstance(p, m.Notice)]
        assert len(taken) == 1 and "taken back" in taken[0].message
        assert svc.pushes_due == {hogs[0].session_id}  # told at housekeeping, idle or not
        assert svc.table.by_id[ns].creator_uid == 3000 and len(hogs[0].namespaces) == 32
        # a second uid below its share takes another; root never loses its entries
        open_ns(svc, session(svc, 98, 3001), "theirs")
        assert svc.table.revoked_total == 2
        with pytest.raises(NoSpaceError, match="table is full"):  # over its share: no
            svc.handle(hogs[1], m.OpenNamespace(1, "hog1-more", LAYOUT))


class TierCopying:
    """A secondary tier whose thread copies one block of each of ``names`` now."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def busy_with(self, index: NamespaceIndex) -> int:
        return int(index.name in self.names)

    def namespace_opened(self, index: NamespaceIndex) -> None:
        pass

    def namespace_dropped(self, index: NamespaceIndex) -> None:
        pass


def test_a_namespace_a_tier_copies_in_is_never_taken_back() -> None:
    """A tier thread's cascade reads, or promotion writes, a namespace's slots with
    no engine's copy counted in them: taken back under it, its copy would land in
    extents another namespace may own next. The table takes back only entries no
    copy of anyone's runs in."""
    with service(config(max_namespaces_per_uid=0)) as svc:
        hog, other = session(svc, 10, 2000), session(svc, 11, 2001)
        for i in range(MAX_NAMESPACES):
            open_ns(svc, hog if i % 4 else other, f"ns-{i:03d}")
        hogs = {n for n, ns in svc.table.by_name.items() if ns.creator_uid == 2000}
        svc.tiering = TierCopying(hogs)  # type: ignore[assignment]
        with pytest.raises(NoSpaceError, match="has copies running"):
            svc.handle(session(svc, 99, 3000), m.OpenNamespace(1, "mine", LAYOUT))
        assert svc.table.revoked_total == 0 and set(svc.table.by_name) >= hogs
        least_used = min(hogs)
        svc.tiering = TierCopying(hogs - {least_used})  # type: ignore[assignment]
        assert svc.table.by_id[open_ns(svc, session(svc, 99), "mine")].name == "mine"
        assert svc.table.revoked_total == 1 and least_used not in svc.table.by_name


def test_a_full_table_of_roots_namespaces_is_never_taken_from() -> None:
    with service(config(max_namespaces_per_uid=0)) as svc:
        root = session(svc, 1, 0)
        for i in range(MAX_NAMESPACES):
            open_ns(svc, root, f"root-{i:03d}")
        with pytest.raises(NoSpaceError, match="every entry is root's or the daemon's"):
            svc.handle(session(svc, 2, 3000), m.OpenNamespace(1, "mine", LAYOUT))


def test_a_hole_a_reclaim_left_survives_a_warm_restart() -> None:
    """An extent given back from the middle of a namespace leaves a hole: after a warm
    restart the blocks above it keep their slots (and workers' SlotMap agrees), and the
    hole's ids come back only with a new extent."""
    cfg = config()
    keys = [b"h-%04d" % i for i in range(6)]  # 2 slots per 1 MiB extent: 3 extents
    layout = m.KVLayout([MIB // 2])
    with service(cfg, unlink=False) as svc:
        s = session(svc, 1)
        ns = open_ns_layout(svc, s, "h", layout)
        slots = prepare(svc, s, ns, keys)
        complete(svc, s, ns, keys, slots)
        index = svc.namespaces[ns]
        kp, kb = pack_keys(keys[4:])
        svc.handle(s, m.PrepareLoad(5, ns, kp, kb))  # the top extent's blocks pinned
        index.evict(keys[2:4])  # the middle extent's blocks go
        assert index.evict_extent() < 0  # the middle one, since the top is pinned
        assert index.slots.extents[1] is None
        before = {k: index.slots_of([k])[0] for k in keys[:2] + keys[4:]}
    with service(cfg) as svc:
        index = svc.table.by_name["h"]
        assert svc.region.recovered and index.slots.extents[1] is None
        assert {k: index.slots_of([k])[0] for k in before} == before
        assert index.lookup(keys[:2]) == 2 and index.lookup(keys[4:]) == 2
        from kvoffload.datapath.regionfmt import RegionTables, SlotMap

        smap = SlotMap(RegionTables(svc.region.buffer), index.ns_id, index.slots.slot_bytes)
        top = np.asarray([before[keys[4]]], dtype=np.int64)
        assert smap.offsets(top).tolist() == index.slots.region_offsets(top).tolist()
        s2 = session(svc, 2)
        refill = prepare(svc, s2, open_ns_layout(svc, s2, "h", layout), [b"n-0000", b"n-0001"])
        assert sorted(refill) == [2, 3]  # the hole's ids, now on an extent again


def test_joins_hold_entries_like_opens_and_buy_no_more_of_the_table() -> None:
    """Issue scenario: 8 uids created 31-32 entries each and another uid joined all 256
    (a join needs no layout): every entry was untouchable, and a newcomer holding
    nothing was told, untruly, that no uid held more than its share."""
    with service(config(max_namespaces_per_uid=0)) as svc:
        owners = [session(svc, 10 + u, 2000 + u) for u in range(8)]
        for i in range(MAX_NAMESPACES):
            open_ns(svc, owners[i % 8], f"own{i % 8}-{i:03d}")
        joiner = session(svc, 50, 2500)
        for name in list(svc.table.by_name):
            r = svc.handle(joiner, m.OpenNamespace(1, name, m.KVLayout([1]), join=True))
            assert isinstance(r, m.NamespaceOpened)
        newcomer = session(svc, 99, 3000)
        ns = open_ns(svc, newcomer, "mine")  # everyone holding the taken entry is over
        assert svc.table.by_id[ns].name == "mine" and svc.table.revoked_total == 1
        told = [p for p in joiner.pushes if isinstance(p, m.Notice)]
        assert len(told) == 1 and "taken back" in told[0].message
        # the newcomer now holds one of a fair share of (256 / 10): it may take more,
        # until it holds its share; then the refusal says so, truly
        for i in range(1, 25):
            open_ns(svc, newcomer, f"mine-{i}")
        with pytest.raises(NoSpaceError, match="uid 3000 holds 25 of its entries, its fair"):
            svc.handle(newcomer, m.OpenNamespace(1, "one-too-many", LAYOUT))


@pytest.mark.parametrize(
    "layout",
    [
        m.KVLayout([64 * 1024], model="m" * 2000),
        m.KVLayout([64 * 1024], model="llama", salt="s" * 1720),
    ],
    ids=["2000-char-model", "1720-char-salt"],
)
def test_a_refused_open_drops_nothing_of_anyone_else(layout: m.KVLayout) -> None:
    """Issue scenario: an open whose layout could not fit its record failed with an
    internal error after the full table had already dropped another uid's idle
    namespace and its blocks."""
    with service(config(max_namespaces_per_uid=0)) as svc:
        other = session(svc, 1, OTHER)
        for i in range(MAX_NAMESPACES):
            open_ns(svc, other, f"ns-{i:03d}")
        keys = [b"kept-key"]
        complete(svc, other, 0, keys, prepare(svc, other, 0, keys))
        svc.close_session(other)  # every namespace idle now: the first to go if room is made
        with pytest.raises(InvalidArgumentError, match="record holds"):
            svc.handle(session(svc, 2, 3000), m.OpenNamespace(1, "too-big", layout))
        assert len(svc.table.by_name) == MAX_NAMESPACES and svc.table.dropped_total == 0
        kp, kb = pack_keys(keys)
        reader = session(svc, 3, OTHER)
        ns = open_ns(svc, reader, "ns-000")
        hits = svc.handle(reader, m.Lookup(4, ns, kp, kb))
        assert isinstance(hits, m.LookupReply) and hits.hits == 1


def test_the_slot_records_a_store_writes_are_the_table_layout_field_by_field() -> None:
    """Scenario: records written as packed bytes (leased, writing, ready, freed) read
    back through the region's slot table dtype with exactly the fields recovery reads."""
    from kvoffload.datapath.regionfmt import SLOT_FREE, SLOT_LEASED, SLOT_WRITING
    from kvoffloadd.region.allocator import ExtentPool
    from kvoffloadd.region.slots import SlotPool

    cfg = config()
    region = SharedOffloadRegion(cfg.region_name, geometry(cfg))
    try:
        pool = ExtentPool(region.geometry.num_extents, MIB)
        slots = SlotPool(pool, owner=3, slot_bytes=4096)
        taken = slots.allocate(300)  # more than one extent: records in two extents
        journal = region.journal_for(3, slots)
        spe, spe_max = slots.slots_per_extent, region.geometry.slots_per_extent_max

        def rec(slot: int) -> np.void:
            ext = slots.extents[slot // spe]
            assert ext is not None
            record = region.slot_table[ext * spe_max + slot % spe]
            assert isinstance(record, np.void)
            return record

        keys = [bytes([1 + i % 255]) * (1 + i % 64) for i in range(len(taken))]
        journal.writing_many(taken, keys, lease=(1 << 63) - 5)
        for slot, key in zip(taken, keys):
            r = rec(slot)
            assert (r["state"], r["key_len"], r["pad"], r["ns"], r["seq"]) == (
                SLOT_WRITING, len(key), 0, 3, 0,
            )  # fmt: skip
            assert bytes(r["key"]) == key.ljust(64, b"\0")
            assert (r["lease"], r["crc"], bytes(r["reserved"])) == ((1 << 63) - 5, 0, bytes(4))
        journal.ready(taken[0], keys[0])
        assert rec(taken[0])["state"] == SLOT_READY and rec(taken[0])["seq"] > 0
        journal.leased(taken[1], 77)
        r = rec(taken[1])
        fields = (r["state"], r["key_len"], r["ns"], r["seq"], r["lease"])
        assert fields == (SLOT_LEASED, 0, 3, 0, 77)
        assert bytes(r["key"]) == bytes(64)
        journal.freed_many(taken[:200])
        journal.freed(taken[250])
        for slot in [*taken[:200], taken[250]]:
            assert rec(slot).tobytes() == bytes(96) and rec(slot)["state"] == SLOT_FREE
        assert rec(taken[200])["state"] == SLOT_WRITING  # only the freed ones
    finally:
        region.close()

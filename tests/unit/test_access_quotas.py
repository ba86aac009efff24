"""Access control and quotas, against a Service with a real region (no socket)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import NotFoundError, PermissionDeniedError, QuotaExceededError
from kvoffload.protocol.packing import pack_keys, unpack_ids
from kvoffloadd.access import AccessPolicy, NamespaceRule, Peer, peer_groups
from kvoffloadd.config import DaemonConfig, NamespaceQuota, TierConfig, load_config
from kvoffloadd.copies.copier import CpuCopier
from kvoffloadd.region.region import Geometry, SharedOffloadRegion
from kvoffloadd.service.service import Service
from kvoffloadd.service.session import Session

MIB = 1 << 20
OTHER = 4242  # a uid/gid that is neither root nor ours


def peer(uid: int, *gids: int) -> Peer:
    return Peer(1, uid, frozenset(gids))


def test_connect_allow_lists() -> None:
    open_policy = AccessPolicy(None, None, None, [], [])
    assert open_policy.may_connect(peer(OTHER, OTHER))
    policy = AccessPolicy([1000], [997], None, [], [])
    assert policy.may_connect(peer(1000, 5)) and policy.may_connect(peer(OTHER, 5, 997))
    assert not policy.may_connect(peer(OTHER, OTHER))
    assert policy.may_connect(peer(0, 0)) and policy.may_connect(peer(os.getuid(), 5))


def test_namespace_rules_first_match_decides_and_unmatched_is_refused() -> None:
    rules = [
        NamespaceRule(pattern="team-a-*", uids=[1000]),
        NamespaceRule(pattern="team-*", gids=[997]),
    ]
    policy = AccessPolicy(None, None, None, [], rules)
    assert policy.may_open(peer(1000, 1), "team-a-llama")
    assert not policy.may_open(peer(OTHER, 997), "team-a-llama")  # first rule decides
    assert policy.may_open(peer(OTHER, 997), "team-b-llama")
    assert not policy.may_open(peer(1000, 1), "other")
    assert AccessPolicy(None, None, None, [], []).may_open(peer(OTHER), "anything")


def test_admin_by_uid_or_group() -> None:
    assert AccessPolicy(None, None, None, [], []).may_administer(peer(os.getuid()))
    assert not AccessPolicy(None, None, None, [], []).may_administer(peer(OTHER, OTHER))
    assert AccessPolicy(None, None, [OTHER], [], []).may_administer(peer(OTHER))
    assert AccessPolicy(None, None, [], [77], []).may_administer(peer(OTHER, 1, 77))


def test_supplementary_groups_come_from_proc() -> None:
    groups = peer_groups(os.getpid(), os.getgid())
    assert os.getgid() in groups and set(os.getgroups()) <= groups
    assert peer_groups(2**22 + 12345, 5) == frozenset({5})  # no such pid


def make_service(**cfg_fields: object) -> Iterator[Service]:
    cfg = msgspec.convert(
        {"instance": f"q{uuid.uuid4().hex[:8]}", "region_size": "16MiB", "extent_size": "1MiB"}
        | cfg_fields,
        DaemonConfig,
    ).validate()
    region = SharedOffloadRegion(cfg.region_name, Geometry.plan(cfg.region_bytes, MIB, 4096))
    copier = CpuCopier(1)
    try:  # a failing test's region goes too (it is closed when the loop is left)
        yield Service(cfg, region, copier)
    finally:
        copier.close()
        region.close()


def session(svc: Service, sid: int, uid: int = 0) -> Session:
    return svc.sessions.get(sid) or svc.open_session(sid, os.getpid(), uid, uid)


def open_ns(svc: Service, s: Session, name: str) -> int:
    r = svc.handle(s, m.OpenNamespace(1, name, m.KVLayout([65536])))
    assert isinstance(r, m.NamespaceOpened)
    return r.ns


def lookup_hits(svc: Service, s: Session, ns: int, keys: list[bytes]) -> int | None:
    r = svc.handle(s, m.Lookup(4, ns, *pack_keys(keys)))
    assert isinstance(r, m.LookupReply)
    return r.hits


def test_refused_peer_gets_permission_denied_on_every_request() -> None:
    for svc in make_service(allow_uids=[1000]):
        s = session(svc, 1, uid=OTHER)
        for req in (m.Hello(1, m.PROTOCOL_VERSION), m.Ping(2)):
            with pytest.raises(PermissionDeniedError, match="allow_uids"):
                svc.handle(s, req)
        assert isinstance(svc.handle(session(svc, 2, uid=0), m.Ping(3)), m.Pong)


def test_namespace_access_is_enforced_at_open() -> None:
    rules = [{"pattern": "mine-*", "uids": [OTHER]}]
    for svc in make_service(namespace_access=rules):
        s = session(svc, 1, uid=OTHER)
        assert open_ns(svc, s, "mine-1") >= 0
        with pytest.raises(PermissionDeniedError, match="namespace_access"):
            svc.handle(s, m.OpenNamespace(1, "yours-1", m.KVLayout([65536])))
        with pytest.raises(PermissionDeniedError):
            svc.handle(session(svc, 2, uid=0), m.OpenNamespace(1, "mine-2", m.KVLayout([65536])))


READER = 4243


def test_readers_load_what_writers_store_and_store_nothing() -> None:
    """namespace_access grants reading apart from writing: a deployment says which uids
    produce the KV the others load."""
    rules = [{"pattern": "kv-*", "uids": [OTHER], "read_uids": [READER]}]
    policy = AccessPolicy(None, None, None, [], [NamespaceRule(**rules[0])])  # type: ignore[arg-type]
    assert policy.may_open(peer(READER), "kv-1") and not policy.may_write(peer(READER), "kv-1")
    assert policy.may_write(peer(OTHER), "kv-1") and not policy.may_open(peer(1), "kv-1")
    assert AccessPolicy(None, None, None, [], []).may_write(peer(READER), "anything")
    for svc in make_service(namespace_access=rules):
        writer, reader = session(svc, 1, uid=OTHER), session(svc, 2, uid=READER)
        ns = open_ns(svc, writer, "kv-1")
        assert open_ns(svc, reader, "kv-1") == ns
        keys = [b"key-0001"]
        assert isinstance(store(svc, writer, ns, keys), m.StorePlanReply)
        kp, kb = pack_keys(keys)
        hits = svc.handle(reader, m.Lookup(5, ns, kp, kb))
        assert isinstance(hits, m.LookupReply) and hits.hits == 1
        load = svc.handle(reader, m.PrepareLoad(6, ns, kp, kb))
        assert isinstance(load, m.LoadPlanReply)
        svc.handle(reader, m.CompleteLoad(7, ns, kp, kb))
        other_kp, _ = pack_keys([b"key-0002"])
        for req in (m.PrepareStore(8, ns, other_kp, kb), m.CompleteStore(9, ns, kp, kb)):
            with pytest.raises(PermissionDeniedError, match="store into namespace 'kv-1'"):
                svc.handle(reader, req)
        # an engine's batch: its claims are refused, its wish for leases is not granted
        reader.pushes.clear()
        svc.handle(reader, m.StepBatch(0, ns, kb, claim_keys=other_kp, claim_slots=b"\0" * 8,
                                       want_leases=64))  # fmt: skip
        assert not [p for p in reader.pushes if isinstance(p, m.LeaseGrant)]
        assert svc.engines.refused_claims_total == 1


def test_a_reader_cannot_create_a_namespace_and_fix_its_layout_for_the_writers() -> None:
    """Creating a namespace fixes its layout for everyone: a uid that may only read a
    name could claim it first with a layout its writers do not have, and lock them out
    of it (LAYOUT_MISMATCH) for as long as the record lasts, warm restarts included."""
    rules = [{"pattern": "kv-*", "uids": [OTHER], "read_uids": [READER]}]
    for svc in make_service(namespace_access=rules):
        writer, reader = session(svc, 1, uid=OTHER), session(svc, 2, uid=READER)
        junk = m.KVLayout([4096], model="squatted")
        with pytest.raises(NotFoundError, match="may only read it"):  # it waits for one
            svc.handle(reader, m.OpenNamespace(1, "kv-1", junk))
        assert "kv-1" not in svc.table.by_name
        ns = open_ns(svc, writer, "kv-1")  # the writer's layout
        assert open_ns(svc, reader, "kv-1") == ns  # once it exists the reader opens it


def test_readers_pin_at_most_their_part_of_a_namespace_however_often_they_repin() -> None:
    """A uid that may only read a namespace could pin every block, and unpin and pin
    them again before any pin aged out: the writers' stores then found nothing to
    evict (NO_SPACE) for as long as it kept at it. Readers now pin within their part
    of the namespace's slots (one uid a quarter, all readers half), so the writers
    always have the rest to store into."""
    second = READER + 1
    rules = [{"pattern": "kv-*", "uids": [OTHER], "read_uids": [READER, second]}]
    for svc in make_service(namespace_access=rules):
        writer, reader = session(svc, 1, uid=OTHER), session(svc, 2, uid=READER)
        ns = open_ns(svc, writer, "kv-1")
        assert open_ns(svc, reader, "kv-1") == ns
        index = svc.namespaces[ns]
        keys = [b"k%07d" % i for i in range(256)]  # more than the region holds
        for part in range(0, len(keys), 16):
            assert isinstance(store(svc, writer, ns, keys[part : part + 16]), m.StorePlanReply)
        assert index.statistics().free_blocks == 0
        owned = index.slots.num_extents * index.slots.slots_per_extent
        held = [k for k in keys if lookup_hits(svc, writer, ns, [k])]
        assert len(held) == owned > 64
        kp, kb = pack_keys(held)
        for turn in range(3):  # pin everything, drop it, pin it all again
            svc.handle(reader, m.StepBatch(0, ns, kb, pin_keys=kp))
            assert index.pinned_by(reader.session_id) == owned // 4  # one reader uid's part
            fresh = [b"w%d-%05d" % (turn, i) for i in range(16)]
            assert isinstance(store(svc, writer, ns, fresh), m.StorePlanReply)
            svc.handle(reader, m.StepBatch(0, ns, kb, unpin_keys=kp))
            assert index.pinned_by(reader.session_id) == 0
        # blocking loads are refused past the part, all or nothing; a second reader uid
        # shares the readers' half with the first
        held = [k for k in held if lookup_hits(svc, writer, ns, [k])]
        part = owned // 4
        with pytest.raises(QuotaExceededError, match="may only read it"):
            svc.handle(reader, m.PrepareLoad(5, ns, *pack_keys(held[: part + 1])))
        assert index.pinned_by(reader.session_id) == 0
        load = svc.handle(reader, m.PrepareLoad(6, ns, *pack_keys(held[:part])))
        assert isinstance(load, m.LoadPlanReply)
        other = session(svc, 3, uid=second)
        assert open_ns(svc, other, "kv-1") == ns
        svc.handle(other, m.StepBatch(0, ns, kb, pin_keys=pack_keys(held[part:])[0]))
        assert index.pinned_by(other.session_id) == owned // 2 - part
        # a writer pins as much as it likes; a reader's part is its uid's, and its
        # pins go with it
        load = svc.handle(writer, m.PrepareLoad(7, ns, *pack_keys(held[: 2 * part])))
        assert isinstance(load, m.LoadPlanReply)
        again = session(svc, 4, uid=READER)
        assert open_ns(svc, again, "kv-1") == ns
        svc.handle(again, m.StepBatch(0, ns, kb, pin_keys=kp))
        assert index.pinned_by(again.session_id) == 0
        assert svc.close_session(reader)
        svc.handle(again, m.StepBatch(0, ns, kb, pin_keys=kp))
        assert index.pinned_by(again.session_id) == part


def store(svc: Service, s: Session, ns: int, keys: list[bytes]) -> m.Reply | None:
    kp, kb = pack_keys(keys)
    r = svc.handle(s, m.PrepareStore(2, ns, kp, kb))
    if isinstance(r, m.StorePlanReply):
        svc.namespaces[ns].mark_written(unpack_ids(r.slots).tolist(), 0)
        svc.handle(s, m.CompleteStore(3, ns, kp, kb, True))
    return r


def test_region_quota_evicts_own_blocks_then_refuses_never_others() -> None:
    quotas = [{"pattern": "small", "max_region_size": "256KiB"}]  # 4 blocks of 64 KiB
    for svc in make_service(namespace_quotas=quotas):
        s = session(svc, 1)
        big, small = open_ns(svc, s, "big"), open_ns(svc, s, "small")
        store(svc, s, big, [b"big-%03d" % i for i in range(20)])
        store(svc, s, small, [b"s-%03d" % i for i in range(4)])
        r = store(svc, s, small, [b"s-%03d" % i for i in range(4, 6)])  # evicts its own
        assert isinstance(r, m.StorePlanReply) and len(pack_keys([b"s-000"])[0]) * 2 == len(
            r.evicted_keys
        )
        assert svc.namespaces[small].slots.num_used == 4
        st = svc.namespaces[small].statistics()
        assert (st.quota_blocks, st.quota_pinned_blocks) == (4, 0)
        assert svc.namespaces[big].lookup([b"big-%03d" % i for i in range(20)]) == 20
        kp, kb = pack_keys([b"s-%03d" % i for i in range(2, 6)])
        svc.handle(s, m.PrepareLoad(4, small, kp, kb))  # pin all four
        with pytest.raises(QuotaExceededError, match="quota"):
            store(svc, s, small, [b"s-new"])
        assert svc.namespaces[big].lookup([b"big-%03d" % i for i in range(20)]) == 20


def test_pinned_block_quota() -> None:
    quotas = [{"pattern": "*", "max_pinned_blocks": 3}]
    for svc in make_service(namespace_quotas=quotas):
        s = session(svc, 1)
        ns = open_ns(svc, s, "p")
        keys = [b"p-%03d" % i for i in range(5)]
        store(svc, s, ns, keys)
        kp, kb = pack_keys(keys[:3])
        svc.handle(s, m.PrepareLoad(4, ns, kp, kb))
        svc.handle(s, m.PrepareLoad(5, ns, kp, kb))  # the same blocks again: no new pins
        kp4, kb4 = pack_keys(keys[3:4])
        with pytest.raises(QuotaExceededError, match="quota of 3"):
            svc.handle(s, m.PrepareLoad(6, ns, kp4, kb4))
        svc.handle(s, m.CompleteLoad(7, ns, kp, kb))
        svc.handle(s, m.CompleteLoad(8, ns, kp, kb))
        assert isinstance(svc.handle(s, m.PrepareLoad(9, ns, kp4, kb4)), m.LoadPlanReply)


def test_config_example_documents_every_key_and_loads(tmp_path: Path) -> None:
    example = Path(__file__).parents[2] / "systemd" / "kvoffloadd.toml.example"
    text = example.read_text()
    for field in msgspec.structs.fields(DaemonConfig):
        assert any(
            f in text for f in (f"{field.name} =", f"[[{field.name}]]", f"[{field.name}.")
        ), field.name
    for field in msgspec.structs.fields(TierConfig):
        assert f"# {field.name} =" in text, f"tiers.{field.name}"
    cfg = load_config(str(example), {})
    assert cfg.namespace_quotas == [] and cfg.quota_for("x") is None
    q = NamespaceQuota(pattern="a*", max_region_size="1GiB")
    assert q.max_region_bytes == 1 << 30


def test_socket_is_0660_in_a_0750_directory(tmp_path: Path) -> None:
    import stat

    from kvoffloadd.server.listener import bind_listener

    path = tmp_path / "run" / "k.sock"
    sock = bind_listener(str(path))
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o750
    finally:
        sock.close()


def test_empty_complete_load_without_pins_is_harmless() -> None:
    for svc in make_service():
        s = session(svc, 1)
        ns = open_ns(svc, s, "e")
        assert isinstance(svc.handle(s, m.CompleteLoad(2, ns, b"", 8)), m.OkReply)


def test_stats_and_client_lists_name_only_namespaces_the_peer_may_open() -> None:
    """A namespace name tells whose model runs on the node: a peer the namespace rules
    refuse does not learn it from stats or the client list (admins see everything)."""
    rules = [{"pattern": "mine-*", "uids": [OTHER]}, {"pattern": "*", "uids": [0]}]
    for svc in make_service(namespace_access=rules):
        other, root = session(svc, 1, uid=OTHER), session(svc, 2, uid=0)
        open_ns(svc, other, "mine-1")
        open_ns(svc, root, "secret-model")
        for s, seen in ((other, {"mine-1"}), (root, {"mine-1", "secret-model"})):
            stats = svc.handle(s, m.GetStats(3))
            assert isinstance(stats, m.StatsReply)
            assert set(stats.sections["namespaces"]) == seen
            assert stats.sections["blocks"]["namespaces"] == 2  # totals stay whole
            clients = svc.handle(s, m.ListClients(4))
            assert isinstance(clients, m.ClientsReply)
            assert {n for c in clients.clients for n in c.namespaces} == seen


def test_housekeeping_expires_a_bounded_number_of_pins_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer that let hundreds of thousands of pins age held the loop half a second
    at the housekeeping that dropped them all. Each call expires at most
    ``CRON_EXPIRY_KEYS`` keys' pins (here 100), oldest first, and says when some are
    left."""
    from kvoffloadd.service import service

    monkeypatch.setattr(service, "CRON_EXPIRY_KEYS", 100)
    n = 150
    for svc in make_service():
        s = session(svc, 1)
        ns = open_ns(svc, s, "aging")
        keys = [b"k%07d" % i for i in range(n)]
        for part in range(0, n, 25):  # within the blocks one client may write at once
            assert isinstance(store(svc, s, ns, keys[part : part + 25]), m.StorePlanReply)
        kp, kb = pack_keys(keys)
        assert isinstance(svc.handle(s, m.PrepareLoad(4, ns, kp, kb)), m.LoadPlanReply)
        index = svc.namespaces[ns]
        assert index.statistics().pinned_blocks == n
        index.pin_timeout_s = 0.0  # every pin is overdue now
        assert svc.cron() is True  # some left for the next call
        assert index.statistics().pinned_blocks == n - 100
        assert svc.cron() is False
        assert index.statistics().pinned_blocks == 0

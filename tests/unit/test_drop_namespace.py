"""An admin drops one namespace (``DropNamespace``), against a Service with a real
region (no socket).

Without ``namespace_access`` rules any uid may create a name first with a layout of
its own, and the name's writers then get ``LAYOUT_MISMATCH``: the admin drops the
squatted name, its holders lose it as when the table takes an entry back (told by a
``Notice`` naming it), its blocks, extents and record go, and the writers open it with
their layout. The client that had it open replaces its connection, whose handshake
opens the namespace again (tests/integration/test_cli.py runs it against a daemon).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from test_access_quotas import make_service, session, store

import kvoffload
from kvoffload.namespace import Namespace
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import (
    ErrorCode,
    InvalidArgumentError,
    LayoutMismatchError,
    NoSpaceError,
    NotFoundError,
    PermissionDeniedError,
)
from kvoffload.protocol.packing import pack_keys
from kvoffloadd.index.index import NamespaceIndex
from kvoffloadd.service.service import Service
from kvoffloadd.service.session import Session

SQUATTER, WRITER = 4242, 4243  # neither root nor the daemon's uid: no admins
ADMIN = 0  # root (the test runs as root or as the daemon's uid: both are admins)
WRITERS = m.KVLayout([65536], model="llama")
SQUATTED = m.KVLayout([4096], model="squatted")
KEYS = [b"sq-%05d" % i for i in range(6)]


def opened(svc: Service, s: Session, name: str, layout: m.KVLayout) -> int:
    r = svc.handle(s, m.OpenNamespace(1, name, layout))
    assert isinstance(r, m.NamespaceOpened)
    return r.ns


def squat(svc: Service) -> tuple[Session, int]:
    """The squatter's connection holding "kv" with its own layout: blocks stored, two
    pinned, empty slots leased; the writer is refused the name."""
    squatter = session(svc, 1, SQUATTER)
    ns = opened(svc, squatter, "kv", SQUATTED)
    assert isinstance(store(svc, squatter, ns, KEYS), m.StorePlanReply)
    svc.handle(squatter, m.PrepareLoad(4, ns, *pack_keys(KEYS[:2])))
    svc.handle(squatter, m.StepBatch(0, ns, 8, want_leases=4))
    with pytest.raises(LayoutMismatchError, match="exists with another layout"):
        svc.handle(session(svc, 2, WRITER), m.OpenNamespace(1, "kv", WRITERS))
    for line in ("namespaces", "pins", "leased_bytes"):  # what it holds there
        assert svc.ledger[line].held(squatter.session_id) > 0, line
    squatter.pushes.clear()
    return squatter, ns


def unchanged(svc: Service, squatter: Session, index: NamespaceIndex) -> None:
    """A refused drop changed nothing: the name, its blocks and its holder are there."""
    assert svc.table.by_name["kv"] is index and index.ns_id in squatter.namespaces
    assert index.lookup(KEYS) == len(KEYS) and index.pinned_by(squatter.session_id) == 2
    assert svc.region.namespace_record(index.ns_id) is not None
    assert not squatter.pushes and svc.table.dropped_total == 0


def test_an_admin_drops_a_squatted_name_and_its_writer_opens_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for svc in make_service():
        pool = svc.region.pool
        free_before = pool.num_free
        squatter, ns = squat(svc)
        assert pool.num_free < free_before
        caplog.set_level(logging.INFO, logger="kvoffloadd.service.namespaces")
        r = svc.handle(session(svc, 3, ADMIN), m.DropNamespace(7, "kv"))
        assert r == m.NamespaceDropped(7, len(KEYS), 1)
        assert "namespace kv dropped by an admin (uid 0)" in caplog.text
        # the holder is told, naming the namespace (pushed at the next housekeeping)
        (notice,) = squatter.pushes
        assert isinstance(notice, m.Notice) and notice.ns == ns
        assert notice.code == ErrorCode.NOT_FOUND
        assert notice.message == "namespace 'kv' was dropped by an admin (uid 0)"
        assert squatter.session_id in svc.pushes_due
        # and lost it: what it held there is released, its next request refused
        assert not squatter.namespaces and not squatter.leases
        assert svc.members.holders.get(ns) is None
        for line in ("namespaces", "pins", "leased_bytes"):
            assert svc.ledger[line].held(squatter.session_id) == 0, line
        with pytest.raises(InvalidArgumentError, match="was not opened"):
            svc.handle(squatter, m.Lookup(5, ns, *pack_keys(KEYS[:1])))
        # the name, its record and every extent it took are gone
        assert "kv" not in svc.table.by_name and svc.region.namespace_record(ns) is None
        assert pool.num_free == free_before
        # the writer opens the name with its layout, and stores into it
        writer = session(svc, 2, WRITER)
        mine = opened(svc, writer, "kv", WRITERS)
        assert svc.table.by_id[mine].layout == WRITERS
        assert isinstance(store(svc, writer, mine, [b"w-000001"]), m.StorePlanReply)
        assert svc.table.by_id[mine].lookup(KEYS) == 0


def test_only_an_admin_drops_a_namespace_and_only_one_that_exists() -> None:
    for svc in make_service():
        squatter, ns = squat(svc)
        index = svc.namespaces[ns]
        for s in (squatter, session(svc, 2, WRITER)):  # its creator is no admin either
            with pytest.raises(PermissionDeniedError, match=r"drop namespace 'kv'.*admin_uids"):
                svc.handle(s, m.DropNamespace(7, "kv"))
        unchanged(svc, squatter, index)
        with pytest.raises(NotFoundError, match="no namespace named 'nope'"):
            svc.handle(session(svc, 3, ADMIN), m.DropNamespace(8, "nope"))
        unchanged(svc, squatter, index)


class TierCopying:
    """A secondary tier whose thread copies one block of every namespace now."""

    def busy_with(self, index: NamespaceIndex) -> int:
        return 1


def test_a_namespace_with_copies_running_is_not_dropped() -> None:
    """A copy in flight would land in extents another namespace may own next: the
    drop is refused, retryably, and changes nothing; once the copies end it goes."""
    for svc in make_service():
        squatter, ns = squat(svc)
        index = svc.namespaces[ns]
        admin = session(svc, 3, ADMIN)
        slot = np.asarray(index.slots_of(KEYS[2:3]), dtype=np.int64)
        index.slots.mark_busy(slot)  # an engine's load copies out of it
        with pytest.raises(NoSpaceError, match=r"copies running in its slots.*try again"):
            svc.handle(admin, m.DropNamespace(7, "kv"))
        unchanged(svc, squatter, index)
        index.slots.unmark_busy(slot)
        svc.tiering = TierCopying()  # type: ignore[assignment]
        with pytest.raises(NoSpaceError, match="secondary tier"):
            svc.handle(admin, m.DropNamespace(8, "kv"))
        unchanged(svc, squatter, index)
        svc.tiering = None
        assert svc.handle(admin, m.DropNamespace(9, "kv")) == m.NamespaceDropped(9, 6, 1)


def test_a_take_back_names_the_namespace_and_the_table_as_why() -> None:
    """The table's take-back and an admin's drop tell holders apart."""
    for svc in make_service():
        squatter, ns = squat(svc)
        assert svc.members.revoke(svc.namespaces[ns]) == 1
        (notice,) = squatter.pushes
        assert isinstance(notice, m.Notice) and notice.ns == ns
        assert "was taken back: uid 4242 holds more than its share" in notice.message


class Connection:
    """The client's connection, as far as losing it goes."""

    closed = False
    lost_noted = False

    def close(self) -> None:
        self.closed = True


def test_a_client_told_it_lost_a_namespace_replaces_its_connection() -> None:
    """Its id, leases and workers there are void: the client drops the connection (no
    outage) and its keeper builds the next one, whose handshake opens it again. Other
    notices are only counted."""
    with kvoffload.Client("/nonexistent/kvoffloadd.sock") as c:
        ns = Namespace(c, "kv", WRITERS)
        ns.ns_id = 3
        c._registrations.append(ns)
        t = Connection()
        c._transport = t  # type: ignore[assignment]
        c._route([
            m.Notice(0, ErrorCode.NOT_LEASED, "a one-way request was refused"),
            m.Notice(0, ErrorCode.NOT_FOUND, "namespace 'other' was dropped by an admin", 4),
        ])  # fmt: skip
        assert c._transport is t and not t.closed and c.notices_total == 2  # type: ignore[comparison-overlap]
        c._route([m.Notice(0, ErrorCode.NOT_FOUND, "namespace 'kv' was dropped", 3)])
        assert c._transport is None and t.closed and c.outages_total == 0
        assert c._keeper.started  # it reconnects (here: to a daemon that is not there)

"""Namespace membership: which connections have which namespace open, what opening one
holds, and what leaving or losing one releases.

Rules:
- Loop thread only. The ``Service`` owns the one ``Membership``; every change of who
  has a namespace open goes through it, so ``holders`` and each ``Session``'s
  namespaces, write rights and lease token always agree.
- Opening a namespace a connection does not have yet charges its ledger row
  ``namespaces`` first (an event cursor, a lease token, a key mirror); a refusal by
  the table gives the charge back, and so does leaving, once everything the
  connection held there is released.
- Leaving releases what the connection holds in the namespace (stores failed, pins
  dropped, its lease freed) at most ``budget`` keys a call, so a leaver holding much
  is released in slices over loop turns (invariant 5); the namespace is forgotten on
  the connection only once all of it is.
- A connection reads any namespace it opened and stores only into those the access
  policy lets it write (``writable``); a refusal names the rule that would allow it.
  One that may only read a namespace pins within the readers' part of it
  (``LoadIndex.reader_joined``).
- A namespace the table takes back, or an admin drops, is lost by every connection
  that has it open: released, its workers there detached, each told by a ``Notice``
  naming it and why, pushed at the next housekeeping turn (``pushes_due``), idle or
  not.
- Leases unused for ``lease_timeout_s`` go back (housekeeping): their holders are
  pushed a ``LeaseRevoke`` and get new slots once they wish for them again.
"""

from __future__ import annotations

import logging

from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import (
    ErrorCode,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)
from kvoffload.protocol.packing import pack_ids
from kvoffloadd.access import AccessPolicy
from kvoffloadd.index.index import NamespaceIndex
from kvoffloadd.index.leases import new_token
from kvoffloadd.ledger import Ledger
from kvoffloadd.service.completions import JobBook
from kvoffloadd.service.engines import EngineChannel
from kvoffloadd.service.namespaces import NamespaceTable
from kvoffloadd.service.session import Session

log = logging.getLogger(__name__)


def deny(s: Session, what: str, fix: str) -> PermissionDeniedError:
    """The refusal of ``what`` to ``s``, logged, saying how to allow it."""
    log.warning("refused uid %d gid %d (pid %d): %s", s.uid, s.gid, s.pid, what)
    return PermissionDeniedError(f"uid {s.uid} may not {what}; {fix}")


class Membership:
    """Who has which namespace open (see the module's rules)."""

    def __init__(
        self,
        table: NamespaceTable,
        sessions: dict[int, Session],
        ledger: Ledger,
        access: AccessPolicy,
        engines: EngineChannel,
        transfers: JobBook,
        tier_count: int,
    ) -> None:
        self.table = table
        self.sessions = sessions
        self.ledger = ledger
        self.access = access
        self.engines = engines
        self.transfers = transfers
        self.tier_count = tier_count
        self.holders: dict[int, set[int]] = {}  # namespace -> connections that have it open
        self.pushes_due: set[int] = set()  # connections with pushes queued outside a request

    def readable(self, s: Session, ns_id: int) -> NamespaceIndex:
        if ns_id not in s.namespaces:
            raise InvalidArgumentError(f"namespace id {ns_id} was not opened on this connection")
        return self.table.by_id[ns_id]

    def writable(self, s: Session, ns_id: int) -> NamespaceIndex:
        index = self.readable(s, ns_id)
        if ns_id not in s.writable:
            raise deny(
                s, f"store into namespace {index.name!r} (it may read it)",
                "list it in the uids or gids of the namespace_access rule that matches",
            )  # fmt: skip
        return index

    def users_of(self, ns_id: int) -> set[int]:
        """The uids of the connections that have the namespace open or joined."""
        return {self.sessions[sid].uid for sid in self.holders.get(ns_id, ())}

    def open(
        self, s: Session, rid: int, name: str, layout: m.KVLayout, subscribe: bool, join: bool
    ) -> m.Reply:
        if not self.access.may_open(s.peer, name):
            raise deny(s, f"open namespace {name!r}", "add a namespace_access rule for it")
        known = self.table.by_name.get(name)
        if known is None and not join and not self.access.may_write(s.peer, name):
            # Creating fixes the layout for everyone: a uid that may only read a name
            # could otherwise claim it first with a layout its writers do not have. A
            # reader waits for a writer instead (clients retry NOT_FOUND, as for a join).
            raise NotFoundError(
                f"namespace {name!r} does not exist yet; this uid may only read it, and "
                "a uid that may write it creates it"
            )
        new = known is None or known.ns_id not in s.namespaces
        if new:  # a cursor, a lease token, a mirror: charged before anything is held
            self.ledger.require(s.session_id, {"namespaces": 1}, f"open namespace {name!r}")
        try:
            index = self.table.open(name, layout, s.uid, self.users_of, join)
        except BaseException:
            if new:
                self.ledger.give(s.session_id, {"namespaces": 1})
            raise
        if index.ns_id not in s.namespaces:
            s.namespaces.add(index.ns_id)
            if self.access.may_write(s.peer, name):
                s.writable.add(index.ns_id)
            else:  # its pins share the readers' part of the namespace
                index.reader_joined(s.session_id, s.uid)
            self.holders.setdefault(index.ns_id, set()).add(s.session_id)
            s.leases[index.ns_id] = new_token()
            if subscribe:
                index.events.subscribe(s.session_id)
        lease = s.leases[index.ns_id]
        fp, slot_bytes = index.fingerprint, index.slots.slot_bytes
        return m.NamespaceOpened(rid, index.ns_id, slot_bytes, fp, self.tier_count, lease)

    def leave(self, s: Session, ns_id: int, budget: int = 1 << 62) -> bool:
        """Release what ``s`` holds in one namespace (at most ``budget`` stores and
        pinned keys of it) and, once all is, forget it there; whether it is."""
        index = self.table.by_id[ns_id]
        index.events.unsubscribe(s.session_id)
        writes, pins, done = index.release_client(s.session_id, s.leases[ns_id], budget)
        if not done:
            return False
        if writes or pins:
            log.info(
                "client %d (pid %d) gone: failed %d stores, dropped %d pins in %s",
                s.session_id,
                s.pid,
                writes,
                pins,
                index.name,
            )
        s.namespaces.discard(ns_id)
        s.writable.discard(ns_id)
        index.reader_left(s.session_id)
        self.ledger.give(s.session_id, {"namespaces": 1})
        held = self.holders.get(ns_id)
        if held is not None:
            held.discard(s.session_id)
            if not held:
                del self.holders[ns_id]
        s.leases.pop(ns_id, None)
        s.want_leases.pop(ns_id, None)
        self.engines.stop_pushing(s, ns_id)
        if ns_id in s.snapshots:
            self.engines.drop_snapshot(s)
        return True

    def revoke(self, index: NamespaceIndex, dropped_by: int | None = None) -> int:
        """Every connection that has ``index`` open loses it (stores failed, pins
        dropped, leases freed, workers detached) and is told why: the table took it back
        (``dropped_by`` None) or the admin of uid ``dropped_by`` dropped it. Returns how
        many connections lost it."""
        ns_id = index.ns_id
        workers = self.transfers.workers
        held = list(self.holders.get(ns_id, ()))
        for sid in held:
            s = self.sessions[sid]
            self.leave(s, ns_id)
            for wid in [w for w in s.workers if workers[w].ns_id == ns_id]:
                self.transfers.detach(workers[wid])
            if dropped_by is None:
                why = f"taken back: uid {s.uid} holds more than its share of the namespace table"
            else:
                why = f"dropped by an admin (uid {dropped_by})"
            s.pushes.append(
                m.Notice(0, ErrorCode.NOT_FOUND, f"namespace {index.name!r} was {why}", ns_id)
            )
            self.pushes_due.add(sid)
        return len(held)

    def take_back_leases(self, index: NamespaceIndex, now_s: float) -> None:
        """Leases unused for ``lease_timeout_s`` go back; their engines are told, and
        get new ones once they wish again."""
        revoked = dict(index.expire_leases(now_s))
        if not revoked:
            return
        for sid in self.holders.get(index.ns_id, ()):
            s = self.sessions[sid]
            slots = revoked.get(s.leases.get(index.ns_id, 0))
            if slots:
                s.want_leases[index.ns_id] = 0
                s.pushes.append(m.LeaseRevoke(0, index.ns_id, pack_ids(slots)))
                self.pushes_due.add(sid)
        log.info("namespace %s: leases unused for %.0f s taken back from %d connections",
                 index.name, index.lease_timeout_s, len(revoked))  # fmt: skip

"""The engine channel: what an engine's scheduler sends once per step, and what the
daemon pushes back without being asked.

An engine's scheduler never waits for the daemon (kvoffload.engine.view). It holds a mirror
of the namespace (keys and their slots), a pool of leased empty slots, and sends one
``StepBatch`` per step, one-way. In return the daemon pushes:

- ``FeedPush``: the namespace's store/evict events, with slots, for every connection
  that mirrors it (``SyncKeys(push=True)``), at most once per loop turn and per
  ``FEED_PUSH_GAP_S`` of the connection (the server holds the rest back until the gap
  has passed), and only while the connection's unsent output stays under
  ``FEED_BACKLOG_BYTES``: a connection that does not read falls behind, its queue
  overflows, and it resyncs from a snapshot.
- ``LeaseGrant``: empty slots, whenever a connection holds fewer than it asked for
  (``want_leases``) and the namespace has room, evicting to make room outside any
  request, one refill ahead for every connection holding leases and, while other
  mirrors are attached, the stores of one ``mirror_grace_s`` more (evicted space frees
  only once every engine's mirror has seen the eviction, which an idle engine does
  only when the grace period ends; at most the lease budget is kept free or coming
  free this way). All connections together hold at most 1/``LEASE_SHARE`` of the
  namespace's largest possible size (its lease budget), checked at every grant; one
  connection at most an equal share among the connections holding leases, one uid an
  equal share among the uids; across all namespaces a connection, a uid and everyone
  at most their ``leased_bytes`` of the region (the ledger). Leases unclaimed for
  ``lease_timeout_s`` are taken back (``LeaseRevoke``). A connection over its share
  (more holders came) gets no refill until it is under it; one that finds the budget
  spent stores through ``prepare_store`` meanwhile.

Rules:
- A batch is applied in field order (claims, pins, unpins, commits, failures, touches,
  the feed ack, the lease wish), so pins taken before an ack are seen before it.
- Nothing in a batch can fail the engine: what does not apply (a claim of a slot no
  longer leased, a pin of a key gone) is counted, never answered.
- A connection pages through one key snapshot at a time (starting another drops the
  first), and connections that start one at the same feed position share it. A
  snapshot is the list of the ready keys at that position (a copy in C); each page
  looks up where its keys are *now*, skipping those gone: with the feed replayed from
  the snapshot's position that is exact (stores and evictions are idempotent), and no
  page costs more than ``SNAPSHOT_PAGE_KEYS`` lookups, however large the namespace.
  The snapshot's references are charged to the connection (``metadata_bytes``).
- Loop thread only, as part of the service.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.packing import id_list, pack_ids, unpack_keys
from kvoffloadd.index.index import NamespaceIndex
from kvoffloadd.ledger import Ledger
from kvoffloadd.service.session import Session

FEED_BACKLOG_BYTES = 4 * 1024 * 1024
LEASE_SHARE = 8  # all connections together lease at most 1/8 of a namespace
MIN_LEASE_CAP = 1


STEP_SLICE_KEYS = 2048  # keys of one engine batch the loop applies in one go
SNAPSHOT_PAGE_KEYS = 8192  # keys of a snapshot one SyncKeys page looks up
SNAPSHOT_ENTRY_BYTES = 8  # a snapshot holds a reference per key
_KEY_FIELDS = ("pin_keys", "unpin_keys", "commit_keys", "fail_keys", "touch_keys")


def split_batch(r: m.StepBatch, max_keys: int = STEP_SLICE_KEYS) -> list[m.StepBatch]:
    """A one-way batch as slices of at most ``max_keys`` keys each, in field order, the
    ack and the lease wish on the last: applied one after another they do what the
    batch does, and the loop serves other connections between them. A batch that is
    malformed, or answered (``rid``), stays whole (it is refused or answered as one)."""
    kb = r.key_bytes
    if r.rid or kb <= 0 or len(r.claim_slots) != len(r.claim_keys) // kb * 8:
        return [r]
    total = sum(len(getattr(r, f)) for f in ("claim_keys", *_KEY_FIELDS)) // kb
    if total <= max_keys:
        return [r]
    step = max_keys * kb
    parts: list[m.StepBatch] = []
    for i in range(0, len(r.claim_keys), step):
        keys = r.claim_keys[i : i + step]
        slots = r.claim_slots[i // kb * 8 : (i + len(keys)) // kb * 8]
        parts.append(m.StepBatch(0, r.ns, kb, claim_keys=keys, claim_slots=slots))
    empty = m.StepBatch(0, r.ns, kb)
    for f in _KEY_FIELDS:
        packed: bytes = getattr(r, f)
        parts.extend(
            msgspec.structs.replace(empty, **{f: packed[i : i + step]})
            for i in range(0, len(packed), step)
        )
    parts[-1] = msgspec.structs.replace(parts[-1], ack_seq=r.ack_seq, want_leases=r.want_leases)
    return parts


class EngineChannel:
    def __init__(
        self, namespaces: dict[int, NamespaceIndex], max_frame_bytes: int, ledger: Ledger
    ) -> None:
        self.namespaces = namespaces
        self.ledger = ledger
        self.max_frame_bytes = max_frame_bytes
        self.refused_claims_total = 0
        # pushed feeds: namespace -> connections it is pushed to, the feed position each
        # namespace had when last pushed, and connections that fell behind (retried once
        # their output drains): a loop turn looks only at namespaces that changed, and
        # at none while nobody is pushed to (the server reads ``push_subs``)
        self.push_subs: dict[int, set[int]] = {}
        self._pushed_seq: dict[int, int] = {}
        self.lagging: set[int] = set()

    # ------------------------------------------------------------ batches

    def apply(self, s: Session, index: NamespaceIndex, r: m.StepBatch) -> None:
        token, sid, kb = s.leases[index.ns_id], s.session_id, r.key_bytes

        def keys(packed: bytes) -> list[bytes]:
            return unpack_keys(packed, kb) if packed else []

        claimed, slots = keys(r.claim_keys), id_list(r.claim_slots)
        if len(claimed) != len(slots):
            raise InvalidArgumentError(f"{len(claimed)} claimed keys for {len(slots)} slots")
        if claimed:
            self.refused_claims_total += index.claim(token, sid, claimed, slots)
        if r.pin_keys:
            index.pin(keys(r.pin_keys), sid)
        if r.unpin_keys:
            index.unpin(keys(r.unpin_keys), sid)
        if r.commit_keys:
            index.commit(token, sid, keys(r.commit_keys), True)
        if r.fail_keys:
            index.commit(token, sid, keys(r.fail_keys), False)
        if r.touch_keys:
            index.touch(keys(r.touch_keys))
        if r.ack_seq >= 0:
            index.ack(sid, r.ack_seq)
        if r.want_leases >= 0:
            s.want_leases[index.ns_id] = r.want_leases
        self.refill(s, index)

    def refill(self, s: Session, index: NamespaceIndex) -> None:
        """Top the connection's lease pool up to what it wants (within its share)."""
        token = s.leases.get(index.ns_id)
        if token is None or index.ns_id not in s.writable:
            return  # no leases for connections that may not store here
        leases = index.leases
        want = min(s.want_leases.get(index.ns_id, 0), self.lease_cap(index, token))
        short = min(
            want - leases.unclaimed(token),
            self.uid_lease_cap(index, s.uid) - leases.unclaimed_by_uid(s.uid),
            self.lease_budget(index) - leases.total_unclaimed(),
            # across namespaces: the connection's, its uid's and everyone's leased bytes
            index.lease_ledger.room(s.session_id) // index.slots.slot_bytes,
        )
        if short > 0 and (slots := index.lease(token, short, s.session_id)):
            s.pushes.append(m.LeaseGrant(0, index.ns_id, pack_ids(slots)))
        # Evicted blocks stay in graves until every engine has seen the eviction, a
        # step or more, or the grace period while an engine is idle: evict ahead now,
        # so later refills find the space free. Every holder refills from the same
        # free space: keep as much free as all of them would take at this connection's
        # wish, and coming free in graves as much as the stores of one grace period
        # take (within the lease budget).
        ahead = want * leases.holders(token)
        if index.graves.needed(None):
            ahead += index.stored_within(index.graves.grace_s)
        index.reserve(min(self.lease_budget(index), ahead))

    @staticmethod
    def lease_budget(index: NamespaceIndex) -> int:
        """How many empty slots all connections together may hold in this namespace."""
        largest = index.slots.pool.num_extents * index.slots.slots_per_extent
        if index.max_blocks is not None:
            largest = min(largest, index.max_blocks)
        return max(MIN_LEASE_CAP, largest // LEASE_SHARE)

    def lease_cap(self, index: NamespaceIndex, token: int = 0) -> int:
        """How many empty slots one connection may hold in this namespace."""
        holders = index.leases.holders(token)
        return max(MIN_LEASE_CAP, self.lease_budget(index) // holders)

    def uid_lease_cap(self, index: NamespaceIndex, uid: int) -> int:
        """How many empty slots all connections of one uid may hold in this namespace."""
        uids = index.leases.holder_uids(uid)
        return max(MIN_LEASE_CAP, self.lease_budget(index) // uids)

    # ------------------------------------------------------------ feeds

    def snapshot_page(self, s: Session, index: NamespaceIndex, r: m.SyncKeys) -> m.KeysPage:
        """Pages of a snapshot of the ready keys and their slots; offset 0 restarts the
        event feed at that instant (pushed from then on with ``push``)."""
        ns = index.ns_id
        if r.offset == 0:
            self.drop_snapshot(s)  # one at a time per connection
            keys = index.snapshot_keys()
            held = SNAPSHOT_ENTRY_BYTES * len(keys)
            self.ledger.require(s.session_id, {"metadata_bytes": held}, "take a key snapshot")
            s.snapshots[ns], s.snapshot_bytes = keys, held
            index.events.subscribe(s.session_id)
            index.add_mirror(s.session_id)
            if r.push:
                s.push_feeds.add(ns)
                self.push_subs.setdefault(ns, set()).add(s.session_id)
            else:
                self.stop_pushing(s, ns)
        snap = s.snapshots.get(ns)
        if snap is None or not 0 <= r.offset < max(len(snap), 1):
            raise InvalidArgumentError("no key snapshot at that offset; start with offset 0")
        per_page = (self.max_frame_bytes - 4096) // (m.MAX_KEY_BYTES + 24)
        end = r.offset + max(1, min(SNAPSHOT_PAGE_KEYS, per_page))
        page = index.where_ready(snap[r.offset : end])
        if end >= len(snap):
            self.drop_snapshot(s)
        return m.KeysPage(
            r.rid,
            [k for k, _ in page],
            -1 if end >= len(snap) else end,
            pack_ids([slot for _, slot in page]),
            index.events.seq,
        )

    def drop_snapshot(self, s: Session) -> None:
        """The connection's key snapshot is paged through, replaced or left."""
        if s.snapshots:
            s.snapshots.clear()
            self.ledger.give(s.session_id, {"metadata_bytes": s.snapshot_bytes})
            s.snapshot_bytes = 0

    def stop_pushing(self, s: Session, ns: int) -> None:
        s.push_feeds.discard(ns)
        subs = self.push_subs.get(ns)
        if subs is not None:
            subs.discard(s.session_id)
            if not subs:
                del self.push_subs[ns]
                self._pushed_seq.pop(ns, None)
        if not s.push_feeds:
            self.lagging.discard(s.session_id)

    def due(self) -> set[int]:
        """Connections with feed events to push now: subscribers of the namespaces whose
        feed moved since the last call (at most one look per pushed namespace)."""
        out: set[int] = set()
        for ns, subs in self.push_subs.items():
            seq = self.namespaces[ns].events.seq
            if self._pushed_seq.get(ns) != seq:
                self._pushed_seq[ns] = seq
                out |= subs
        return out

    def feed_pushes(self, s: Session, backlog_bytes: int) -> Iterator[m.FeedPush]:
        """The connection's pending feed events, as pushes (nothing while it lags: it is
        marked ``lagging`` and tried again once it has read its replies)."""
        if backlog_bytes > FEED_BACKLOG_BYTES:
            self.lagging.add(s.session_id)
            return
        self.lagging.discard(s.session_id)
        for ns in s.push_feeds:
            index = self.namespaces[ns]
            if not index.events.pending(s.session_id):
                continue
            events, lost = index.events.take(s.session_id)
            yield m.FeedPush(0, ns, index.events.seq, events, lost)

"""The namespace table: names, ids, creation, recovery, and the region's share-out.

Rules:
- A name is 1..200 printable characters and at most 255 bytes of UTF-8 (the region's
  record holds 256 with a terminator): no NUL or control character can make two names
  one after a warm restart.
- Opening a known name with another layout is ``LAYOUT_MISMATCH``, never silent sharing.
  Joining (``join``) opens an existing name only, whatever its layout: an engine's
  scheduler joins what the engine's workers created from their own pages.
- The table has ``MAX_NAMESPACES`` entries, kept in the region (they survive restarts).
  A uid may create at most ``max_namespaces_per_uid`` (root and the daemon's uid are
  not limited). A request is validated whole (name, layout, its record's size, its
  slot size, the uid's creations) before anything of anyone else's is dropped.
- When the table is full, a namespace nobody has open and nothing pins, writes, leases
  or copies is dropped (its blocks evicted, its extents freed, its entry cleared) to
  make room, least used first. If none is idle, entries are shared fairly among uids:
  a uid *holds* every entry it created and every one its connections have open or
  joined, and its fair share is the entries root's and the daemon's do not take, over
  the uids holding entries (the newcomer counted). A uid below its share takes the
  least used entry all of whose holders are above theirs, preferring the largest
  holder's, with no copy running in it (``busy``: an engine's, or a secondary tier
  thread's); its connections lose it (``on_revoke``).
  Root's and the daemon's entries are never taken. Only then is the open refused
  (``NO_SPACE``), saying which of these stopped it.
- An admin may drop any namespace with no copy running in it (``DropNamespace``,
  service.py): its connections lose it first, as when it is taken back.
- The region is shared fairly per uid, then per namespace: a namespace whose uid holds
  fewer extents than an equal share among the uids with extents takes them from the
  fattest namespace of a uid above its share; one whose uid has its share takes from
  the uid's other namespaces above an equal share of it. Opening more namespaces buys
  no more of the region. An extent moves by evicting a whole one that holds nothing
  pinned, busy, leased or being written, wherever it lies (``evict_extent``), so a few
  pinned blocks keep their own extents only; one reclaim looks at
  ``RECLAIM_BUDGET_SLOTS`` slots at most, so it costs the loop a bounded slice.
- Loop thread only, as part of the service.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection

import msgspec

from kvoffload.datapath.regionfmt import MAX_LAYOUT_BYTES, MAX_NAMESPACES
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import (
    InvalidArgumentError,
    LayoutMismatchError,
    NoSpaceError,
    NotFoundError,
    QuotaExceededError,
)
from kvoffloadd.config import DaemonConfig
from kvoffloadd.index.index import NamespaceIndex
from kvoffloadd.region.recovery import read_namespaces
from kvoffloadd.region.region import SharedOffloadRegion
from kvoffloadd.region.slots import SlotPool

log = logging.getLogger(__name__)

PAGE_BYTES = 4096
MAX_NAME_CHARS = 200
MAX_NAME_BYTES = 255
MIN_WRITING_CAP = 64
RECLAIM_BUDGET_SLOTS = 1 << 16  # slots one reclaim may look at
TRUSTED = frozenset((0, os.getuid()))  # root and the daemon's own uid


def check_name(name: str) -> None:
    if not 0 < len(name) <= MAX_NAME_CHARS or len(name.encode()) > MAX_NAME_BYTES:
        raise InvalidArgumentError(
            f"a namespace name is 1..{MAX_NAME_CHARS} characters and at most "
            f"{MAX_NAME_BYTES} bytes of UTF-8"
        )
    if not name.isprintable():
        raise InvalidArgumentError("a namespace name holds printable characters only")


def check_layout(layout: m.KVLayout) -> None:
    pages = layout.tensor_page_bytes
    if not pages or any(p <= 0 for p in pages) or layout.world_size < 1:
        raise InvalidArgumentError(
            "layout needs at least one positive tensor_page_bytes and world_size >= 1"
        )
    if not 1 <= layout.block_size_factor <= 1024:
        raise InvalidArgumentError("block_size_factor must be in 1..1024")


class NamespaceTable:
    def __init__(
        self,
        config: DaemonConfig,
        region: SharedOffloadRegion,
        on_new: Callable[[NamespaceIndex], None],
        on_drop: Callable[[NamespaceIndex], None],
        on_revoke: Callable[[NamespaceIndex], object] = lambda index: None,
        busy: Callable[[NamespaceIndex], bool] = lambda index: index.slots.any_busy(),
    ) -> None:
        self.config = config
        self.region = region
        self.busy = busy  # copies run in its slots (an engine's or a tier's): keep it
        self.by_id: dict[int, NamespaceIndex] = {}
        self.by_name: dict[str, NamespaceIndex] = {}
        self._on_new, self._on_drop, self._on_revoke = on_new, on_drop, on_revoke
        self.dropped_total = 0
        self.revoked_total = 0

    def open(
        self,
        name: str,
        layout: m.KVLayout,
        uid: int,
        users: Callable[[int], Collection[int]],
        join: bool = False,
    ) -> NamespaceIndex:
        """The namespace ``name`` (created if new, unless ``join``: then it must exist,
        whatever its layout) for a client of ``uid``; ``users``: the uids of the
        connections that have a namespace (by id) open or joined."""
        check_name(name)
        index = self.by_name.get(name)
        if join:
            if index is None:
                raise NotFoundError(f"namespace {name!r} does not exist (yet)")
            return index
        check_layout(layout)
        fp = layout.fingerprint()
        if index is not None:
            if index.fingerprint != fp:
                raise LayoutMismatchError(
                    f"namespace {name!r} exists with another layout "
                    f"({index.layout}); this client sent {layout}"
                )
            return index
        slot_bytes = self.slot_bytes(layout)
        if slot_bytes > self.region.geometry.extent_bytes:
            raise InvalidArgumentError(
                f"one offloaded block is {slot_bytes} bytes, larger than an extent "
                f"({self.region.geometry.extent_bytes} bytes); raise extent_size"
            )
        record = msgspec.msgpack.encode(layout)
        if len(record) > MAX_LAYOUT_BYTES:
            raise InvalidArgumentError(
                f"the layout takes {len(record)} bytes; a namespace's record holds "
                f"{MAX_LAYOUT_BYTES} (shorten its model, dtype or salt strings)"
            )
        limit = self.config.max_namespaces_per_uid
        if uid not in TRUSTED and limit:
            mine = sum(1 for ns in self.by_id.values() if ns.creator_uid == uid)
            if mine >= limit:
                raise QuotaExceededError(
                    f"uid {uid} created {mine} namespaces, the max_namespaces_per_uid limit"
                )
        ns_id = self._free_id(users, uid)  # only now may another's namespace go
        self.region.register_namespace(ns_id, name, fp, record, uid)
        index = self._new_index(ns_id, name, layout, fp, slot_bytes, uid)
        log.info("namespace %s opened: %d-byte slots, fingerprint %s", name, slot_bytes, fp)
        return index

    def _free_id(self, users: Callable[[int], Collection[int]], uid: int) -> int:
        free = next((i for i in range(MAX_NAMESPACES) if i not in self.by_id), None)
        if free is not None:
            return free
        idle = [
            ns
            for ns in self.by_id.values()
            if not users(ns.ns_id) and ns.is_idle() and not self.busy(ns)
        ]
        if idle:
            victim = min(idle, key=_use)
        else:
            victim = self._over_share(users, uid)
            log.warning(
                "namespace %s of uid %d taken back: every uid holding it holds more "
                "than its share of the namespace table and uid %d needs one",
                victim.name,
                victim.creator_uid,
                uid,
            )
            self.revoked_total += 1
            self._on_revoke(victim)
        self.drop(victim)
        return victim.ns_id

    def _over_share(self, users: Callable[[int], Collection[int]], uid: int) -> NamespaceIndex:
        """The entry a uid below its fair share may take (see the rules); NoSpaceError
        saying why there is none."""
        holders: dict[int, set[int]] = {}  # uid -> entries it holds
        trusted_entries = 0
        for ns in self.by_id.values():
            if ns.creator_uid in TRUSTED:
                trusted_entries += 1
            for holder in {ns.creator_uid, *users(ns.ns_id)} - TRUSTED:
                holders.setdefault(holder, set()).add(ns.ns_id)
        if trusted_entries == MAX_NAMESPACES:
            raise NoSpaceError(
                f"the namespace table is full ({MAX_NAMESPACES}): every entry is root's or "
                "the daemon's"
            )
        counted = len(holders.keys() | {uid})
        fair = (MAX_NAMESPACES - trusted_entries) // counted
        mine = len(holders.get(uid, ()))
        if mine >= fair:
            raise NoSpaceError(
                f"the namespace table is full ({MAX_NAMESPACES}) and uid {uid} holds {mine} "
                f"of its entries, its fair share of {fair} ({counted} uids hold entries); "
                "close namespaces it no longer needs"
            )
        over = {h for h, held in holders.items() if len(held) > fair}
        takeable = [
            ns
            for ns in self.by_id.values()
            if ns.creator_uid not in TRUSTED
            and {ns.creator_uid, *users(ns.ns_id)} - TRUSTED <= over
            and not self.busy(ns)
        ]
        if not takeable:
            raise NoSpaceError(
                f"the namespace table is full ({MAX_NAMESPACES}): every entry is root's or "
                f"the daemon's, has copies running, or is held by a uid within its fair "
                f"share of {fair}"
            )
        # the largest holder's first, least used among them
        return min(takeable, key=lambda ns: (-len(holders.get(ns.creator_uid, ())), *_use(ns)))

    def drop(self, index: NamespaceIndex, why: str = "to make room in the table") -> int:
        """Forget an idle namespace: its blocks, extents, table entry and region
        record; ``why`` goes into the log line. Returns how many blocks it held."""
        blocks = index.evict()
        index.free_graves()
        index.slots.release_free_tail()
        del self.by_id[index.ns_id]
        del self.by_name[index.name]
        self.region.unregister_namespace(index.ns_id)
        self._on_drop(index)
        self.dropped_total += 1
        log.info("namespace %s dropped %s (%d blocks)", index.name, why, blocks)
        return blocks

    def _new_index(
        self, ns_id: int, name: str, layout: m.KVLayout, fp: str, slot_bytes: int, uid: int
    ) -> NamespaceIndex:
        slots = SlotPool(self.region.pool, ns_id, slot_bytes)
        index = NamespaceIndex(
            ns_id,
            name,
            layout,
            fp,
            slots,
            policy=self.config.policy,
            journal=self.region.journal_for(ns_id, slots),
            reclaim=self._reclaim,
            mirror_grace_s=self.config.mirror_grace_s,
            commit_timeout_s=self.config.commit_timeout_s,
        )
        index.pin_timeout_s = self.config.pin_timeout_s
        index.creator_uid = uid
        largest = self.region.pool.num_extents * slots.slots_per_extent
        quota = self.config.quota_for(name)
        if quota is not None and quota.max_region_bytes:
            largest = min(largest, quota.max_region_bytes // slot_bytes)
        fraction = self.config.max_writing_fraction
        if fraction < 1:  # no client holds the pool hostage with stores it never ends
            # small namespaces (a quota) hold only their own space: a floor of 64
            index.max_writing_per_client = max(MIN_WRITING_CAP, int(largest * fraction))
            index.max_writing = max(MIN_WRITING_CAP, int(largest * min(1.0, 1.5 * fraction)))
        if quota is not None:
            if quota.max_region_bytes:
                index.max_blocks = quota.max_region_bytes // slot_bytes
            if quota.max_pinned_blocks:
                index.max_pinned_blocks = quota.max_pinned_blocks
        self.by_id[ns_id] = index
        self.by_name[name] = index
        self._on_new(index)
        return index

    def recover(self) -> None:
        """Warm restart: namespaces and completed blocks from the kept region."""
        for rec in read_namespaces(self.region, self._recovered_slot_bytes):
            if rec.layout.fingerprint() != rec.fingerprint:
                log.warning("namespace %s: layout does not match its fingerprint", rec.name)
                continue
            try:
                check_name(rec.name)
            except InvalidArgumentError:
                log.warning("a namespace record with a bad name is dropped")
                self.region.unregister_namespace(rec.ns_id)
                continue
            slot_bytes = rec.slot_bytes or self.slot_bytes(rec.layout)
            index = self._new_index(
                rec.ns_id, rec.name, rec.layout, rec.fingerprint, slot_bytes, rec.creator_uid
            )
            one = len(rec.blocks[0][1]) if rec.blocks else 0
            blocks = [(slot, key) for slot, key in rec.blocks if len(key) == one]
            if len(blocks) < len(rec.blocks):
                log.warning("namespace %s: %d kept keys of another length are dropped",
                            rec.name, len(rec.blocks) - len(blocks))  # fmt: skip
            index.slots.adopt(rec.extents, {slot for slot, _ in blocks})
            index.restore(blocks)
            log.info("recovered namespace %s: %d blocks", rec.name, len(rec.blocks))
        pool = self.region.pool
        orphans = [e for e, o in enumerate(pool.owner) if o is not None and o not in self.by_id]
        for ext in orphans:  # owned by a record that was dropped or is unreadable
            pool.give_back(ext)
        if orphans:
            log.warning("%d extents of unrecovered namespaces are free again", len(orphans))

    def _recovered_slot_bytes(self, name: str, layout: m.KVLayout) -> int:
        """A kept record passes what an open checks, or recovery drops it."""
        check_name(name)
        check_layout(layout)
        return self.slot_bytes(layout)

    def slot_bytes(self, layout: m.KVLayout) -> int:
        return max(-(-layout.block_bytes // PAGE_BYTES) * PAGE_BYTES, self.config.min_slot_bytes)

    def _reclaim(self, ns_id: int, need: int) -> None:
        """Move extents to a namespace below its fair share (see the rules) from the
        fattest one above its own, a bounded look at a time."""
        needy = self.by_id[ns_id]
        budget = RECLAIM_BUDGET_SLOTS
        while need > needy.slots.num_free and budget > 0:
            donors = self._donors(needy)
            if not donors:
                return
            for donor in donors:
                looked = donor.evict_extent(budget)
                budget -= abs(looked)
                if looked < 0 or budget <= 0:
                    break
            else:
                return

    def _donors(self, needy: NamespaceIndex) -> list[NamespaceIndex]:
        """Namespaces ``needy`` may take an extent from, fattest first: those of uids
        above their share of the region while ``needy``'s uid is below its own, then its
        uid's other namespaces above their share of the uid's while ``needy`` is below
        its own. Shares are equal among the uids with extents, then among each uid's
        namespaces with extents."""
        active = {ns.ns_id: ns for ns in self.by_id.values() if ns.slots.num_extents}
        active[needy.ns_id] = needy
        mine: dict[int, list[NamespaceIndex]] = {}
        for ns in active.values():
            mine.setdefault(ns.creator_uid, []).append(ns)
        held = {uid: sum(ns.slots.num_extents for ns in nss) for uid, nss in mine.items()}
        fair_uid = self.region.pool.num_extents // len(mine)
        uid = needy.creator_uid
        out: list[NamespaceIndex] = []
        if held[uid] < fair_uid:
            over = {u for u, n in held.items() if n > fair_uid}
            out = [ns for u in over for ns in mine[u]]
        fair_ns = fair_uid // len(mine[uid])
        if not out and needy.slots.num_extents < fair_ns:
            out = [ns for ns in mine[uid] if ns.slots.num_extents > fair_ns]
        return sorted(out, key=lambda ns: ns.slots.num_extents, reverse=True)


def _use(ns: NamespaceIndex) -> tuple[int, int]:
    """Least used first: fewest blocks, then fewest lookups."""
    return ns.slots.num_used, ns.statistics().lookups_total

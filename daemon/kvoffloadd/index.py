"""Per-namespace block index: the offloading-manager contract of vLLM, with owners.

Semantics follow vLLM's CPU offloading manager (research/vllm_kv_offload.md section 3)
so that engines see exactly the behaviour of the built-in offloader:

- ``ref`` is -1 while a block is being written, 0 when ready and evictable, N > 0 while
  N loads are in flight. ``lookup`` counts the leading keys that are present *and*
  ready (invariant 1: a block is visible only after ``complete_store(success=True)``).
- ``prepare_store`` skips keys already present; when only such keys are given it
  returns an empty plan, not None. It evicts atomically, never its own input keys and
  never a block with ``ref != 0`` (invariant 2); ``None`` means no space.
- Events are emitted only when a store completes and when blocks are evicted.
- A store can only complete successfully once every rank's copy into its slot has
  finished (``mark_written``): a key never becomes visible over bytes nobody wrote.

One difference, for engines that share a namespace through key mirrors (graves.py):
while other engines' mirrors are attached, evicted blocks stay loadable and keep their
slots until those mirrors have seen the eviction. A ``prepare_store`` that had to
evict for space it cannot use yet then answers ``None`` (no space now) after evicting
exactly what it needed; its next call gets those slots. Evicted keys are announced and
never hit a lookup either way.

On top of that the daemon needs owners: every block being written belongs to the
client that prepared it, every pin to the client that took it. Completing someone
else's store or load is ``NOT_LEASED``; ``release_client`` fails a dead client's
stores and drops its pins at once (invariant 5). ``check_store_slots`` and
``check_load_slots`` are how the data path proves a slot was leased (invariant 4).

Everything here runs on the daemon's loop thread only: no locks.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import takewhile

import numpy as np
import numpy.typing as npt

from kvoffload.plans import OffloadEvent, StorePlan
from kvoffload.protocol.errors import (
    InvalidArgumentError,
    NotFoundError,
    NotLeasedError,
    QuotaExceededError,
)
from kvoffload.protocol.messages import KVLayout

from .allocator import SlotPool
from .events import EventFeed
from .graves import Graveyard
from .policies import Block, make_policy


@dataclass(frozen=True)
class NamespaceStatistics:
    name: str
    fingerprint: str
    policy: str
    slot_bytes: int
    extents: int
    capacity_blocks: int
    free_blocks: int
    stored_blocks: int
    writing_blocks: int
    pinned_blocks: int
    held_evicted_blocks: int  # evicted, kept loadable for other engines' mirrors
    quota_blocks: int  # 0: no quota
    quota_pinned_blocks: int  # 0: no quota
    lookups_total: int
    lookup_keys_total: int
    hit_keys_total: int
    miss_keys_total: int
    lookup_misses_total: int
    stores_prepared_total: int
    stored_blocks_total: int
    store_failures_total: int
    loads_prepared_total: int
    evicted_blocks_total: int
    events_dropped_total: int


class SlotJournal:
    """Receives every slot state change (the region's slot table implements it)."""

    def writing(self, slot: int, key: bytes) -> None: ...
    def ready(self, slot: int, key: bytes) -> None: ...
    def freed(self, slot: int) -> None: ...


class NamespaceIndex:
    def __init__(
        self,
        ns_id: int,
        name: str,
        layout: KVLayout,
        fingerprint: str,
        slots: SlotPool,
        policy: str = "lru",
        journal: SlotJournal | None = None,
        reclaim: Callable[[NamespaceIndex, int], None] | None = None,
        mirror_grace_s: float = 1.0,
    ) -> None:
        self.ns_id = ns_id
        self.name = name
        self.layout = layout
        self.fingerprint = fingerprint
        self.slots = slots
        self.policy_name = policy
        ghost_capacity = slots.pool.num_extents * slots.slots_per_extent
        self._policy = make_policy(policy, ghost_capacity)
        self._journal = journal or SlotJournal()
        self._reclaim = reclaim
        self._num_evictable = 0
        self._num_pinned = 0  # blocks with ref > 0
        # verify_checksums: CRC32 of each (slot, rank) area, and blocks found corrupt
        self._checksums: dict[int, int] = {}
        self._corrupt: set[bytes] = set()
        # quotas (None: unlimited): slots this namespace may hold, blocks it may pin
        self.max_blocks: int | None = None
        self.max_pinned_blocks: int | None = None
        # slot -> key of the block in it (None: free); a list, 8 bytes per slot
        self._slot_key: list[bytes | None] = []
        # keys whose store completed (ref >= 0): lookup runs on this set in C
        self._ready: set[bytes] = set()
        self._written: dict[int, int] = {}  # writing slot -> bit mask of ranks that copied
        self._all_ranks = (1 << layout.world_size) - 1
        self._writers: dict[bytes, int] = {}
        self._pins: dict[int, Counter[bytes]] = {}
        self.events = EventFeed()
        # called with the keys of every successful store (the tiers cascade them)
        self.on_stored: Callable[[NamespaceIndex, list[bytes]], None] | None = None
        # evicted blocks other engines' key mirrors may still hit (graves.py)
        self.graves = Graveyard(mirror_grace_s)
        # statistics
        self._lookups = self._lookup_keys = self._hit_keys = self._lookup_misses = 0
        self._stores_prepared = self._stored = self._store_failures = 0
        self._loads_prepared = self._evicted = 0

    # ------------------------------------------------------------ scheduler side

    def lookup(self, keys: Sequence[bytes]) -> int:
        hits = len(list(takewhile(self._ready.__contains__, keys)))
        self._lookups += 1
        self._lookup_keys += len(keys)
        self._hit_keys += hits
        if hits < len(keys):
            self._lookup_misses += 1
        return hits

    def prepare_store(self, keys: Sequence[bytes], client: int) -> StorePlan | None:
        get = self._policy.get
        to_store = [k for k in dict.fromkeys(keys) if get(k) is None]
        if not to_store:
            return StorePlan([], [], [])
        self.free_graves()
        need = len(to_store)
        if need > self.slots.num_free and not self._quota_binds() and self._reclaim is not None:
            self._reclaim(self, need)  # more region space; useless when the quota binds
        evicted: list[bytes] = []
        n = need - self._free_within_quota() - len(self.graves)  # graves: space to come
        if n > 0:
            victims = self._policy.evict(n, set(keys)) if n <= self._num_evictable else None
            if victims is None:
                if self._quota_binds():
                    raise QuotaExceededError(
                        f"namespace {self.name!r} holds {self.slots.num_used} of the "
                        f"{self.max_blocks} blocks its quota allows, and not enough of them "
                        f"can be evicted for {need} more"
                    )
                return None
            evicted = self._drop(victims, exempt=client)
        if need > self._free_within_quota():
            # The space is evicted but still readable by other engines' mirrors: it
            # frees once they have seen the evictions (their next step) or after the
            # grace period. Not now: vLLM retries the store later.
            gone = set(evicted)
            self.graves.unexempt([s for s, g in self.graves.by_slot.items() if g.key in gone])
            return None
        slots = self.slots.allocate(need)
        slot_key = self._slot_key
        if len(slot_key) < self.slots.capacity:
            slot_key.extend([None] * (self.slots.capacity - len(slot_key)))
        for key, slot in zip(to_store, slots):
            self._policy.insert(key, Block(slot))
            slot_key[slot] = key
            self._writers[key] = client
            self._journal.writing(slot, key)
        self._stores_prepared += need
        return StorePlan(to_store, slots, evicted)

    def _free_within_quota(self) -> int:
        """Free slots this namespace may still take (region space and its quota)."""
        free = self.slots.num_free
        if self.max_blocks is not None:
            free = min(free, max(0, self.max_blocks - self.slots.num_used))
        return free

    def _quota_binds(self) -> bool:
        return self._free_within_quota() < self.slots.num_free

    def complete_store(self, keys: Sequence[bytes], success: bool, client: int) -> None:
        get = self._policy.get
        mine: list[tuple[bytes, Block]] = []
        for key in dict.fromkeys(keys):
            block = get(key)
            if block is None or block.ref != -1:
                continue  # unknown or already complete: ignored, as in vLLM
            if self._writers.get(key) != client:
                raise NotLeasedError(f"key {key.hex()} is being stored by another client")
            mine.append((key, block))
        if success:
            unwritten = [k for k, b in mine if self._written.get(b.slot) != self._all_ranks]
            if unwritten:
                raise InvalidArgumentError(
                    f"{len(unwritten)} of the keys (first {unwritten[0].hex()}) have not been "
                    f"copied by all {self.layout.world_size} ranks yet; complete them after "
                    "their store jobs finished, or with success=False"
                )
        self._finish_stores(mine, success)

    def mark_written(self, slots: Sequence[int], rank: int) -> None:
        """A store copy of ``rank`` into these slots finished successfully."""
        bit = 1 << rank
        slot_key = self._slot_key
        for slot in slots:
            if slot < len(slot_key) and slot_key[slot] is not None:
                self._written[slot] = self._written.get(slot, 0) | bit

    def _finish_stores(self, blocks: list[tuple[bytes, Block]], success: bool) -> None:
        stored: list[bytes] = []
        for key, block in blocks:
            del self._writers[key]
            if success:
                block.ref = 0
                self._num_evictable += 1
                self._written.pop(block.slot, None)
                self._ready.add(key)
                stored.append(key)
                self._journal.ready(block.slot, key)
            else:
                self._policy.remove(key)
                self._free_slot(block.slot)
                self._store_failures += 1
        if stored:
            self._stored += len(stored)
            self.events.emit(OffloadEvent(stored, removed=False))
            if self.on_stored is not None:
                self.on_stored(self, stored)

    def prepare_load(self, keys: Sequence[bytes], client: int) -> list[int]:
        get = self._policy.get
        blocks: list[Block] = []
        buried: set[int] = set()  # ids of grave blocks: a mirror's hit raced their eviction
        for key in keys:
            block = get(key)
            if block is None or block.ref < 0:
                grave = self.graves.loadable(key)
                if grave is None:
                    state = "not stored" if block is None else "still being written"
                    raise NotFoundError(f"cannot load key {key.hex()}: {state}")
                block = grave.block
                buried.add(id(block))
            elif key in self._corrupt:
                raise NotFoundError(f"cannot load key {key.hex()}: corrupt (evicted once unpinned)")
            blocks.append(block)
        if self.max_pinned_blocks is not None:
            new = len({id(b) for b in blocks if b.ref == 0})
            if self._num_pinned + new > self.max_pinned_blocks:
                raise QuotaExceededError(
                    f"namespace {self.name!r} has {self._num_pinned} blocks pinned; "
                    f"{new} more would pass its quota of {self.max_pinned_blocks}"
                )
        pins = self._pins.setdefault(client, Counter())
        for key, block in zip(keys, blocks):
            if id(block) in buried:
                self.graves.pin(client, block.slot)
                continue
            if block.ref == 0:
                self._num_evictable -= 1
                self._num_pinned += 1
            block.ref += 1
            pins[key] += 1
        if not pins:
            del self._pins[client]
        self._loads_prepared += len(keys)
        return [b.slot for b in blocks]

    def complete_load(self, keys: Sequence[bytes], client: int) -> None:
        pins = self._pins.get(client, Counter())
        graves = self.graves.pinned_by(client)
        for key, count in Counter(keys).items():
            if pins[key] + len(graves.get(key, ())) < count:
                raise NotLeasedError(f"key {key.hex()} is not pinned by this client")
        for key in keys:
            if pins[key]:
                self._unpin(key, pins)
            else:
                self.graves.unpin(client, graves[key].pop())
        if client in self._pins and not pins:
            del self._pins[client]
        self.free_graves()

    def _unpin(self, key: bytes, pins: Counter[bytes]) -> None:
        block = self._policy.get(key)
        assert block is not None and block.ref > 0, f"pinned key {key.hex()} lost its block"
        block.ref -= 1
        if block.ref == 0:
            self._num_evictable += 1
            self._num_pinned -= 1
            if key in self._corrupt:
                self._corrupt.discard(key)
                self._policy.remove(key)
                self._drop([(key, block)], bury=False)
        pins[key] -= 1
        if not pins[key]:
            del pins[key]

    # ------------------------------------------------------------ block checksums

    def set_checksums(self, slots: Sequence[int], rank: int, crcs: Sequence[int]) -> None:
        w = self.layout.world_size
        for slot, crc in zip(slots, crcs):
            if slot < len(self._slot_key) and self._slot_key[slot] is not None:
                self._checksums[slot * w + rank] = crc

    def checksums_for(self, slots: Sequence[int], rank: int) -> list[int]:
        """Stored checksums of the slots' rank areas; -1 where none is known."""
        w = self.layout.world_size
        return [self._checksums.get(slot * w + rank, -1) for slot in slots]

    def mark_corrupt(self, slots: Sequence[int]) -> list[bytes]:
        """Blocks whose bytes no longer match their checksum: never served again,
        evicted now or when their last pin goes."""
        keys = []
        for slot in slots:
            self.graves.forbid(slot)
            key = self._slot_key[slot] if slot < len(self._slot_key) else None
            block = self._policy.get(key) if key is not None else None
            if key is None or block is None or block.slot != slot:
                continue  # free, or a grave whose key was stored again elsewhere
            keys.append(key)
            self._ready.discard(key)
            if block.ref == 0:
                self._policy.remove(key)
                self._drop([(key, block)], bury=False)
            else:
                self._corrupt.add(key)
        return keys

    def restore(self, blocks: list[tuple[int, bytes]]) -> None:
        """Re-insert completed stores found in a kept region, oldest first (warm restart)."""
        slot_key = self._slot_key
        if len(slot_key) < self.slots.capacity:
            slot_key.extend([None] * (self.slots.capacity - len(slot_key)))
        for slot, key in blocks:
            block = Block(slot)
            block.ref = 0
            self._policy.insert(key, block)
            slot_key[slot] = key
            self._ready.add(key)
            self._num_evictable += 1

    def touch(self, keys: Sequence[bytes]) -> None:
        self._policy.touch(keys)

    def is_ready(self, key: bytes) -> bool:
        return key in self._ready

    def writer_of(self, key: bytes) -> int | None:
        """The client storing ``key`` right now, if it is being stored."""
        return self._writers.get(key)

    def slots_of(self, keys: Sequence[bytes]) -> list[int]:
        """Slots of present keys (stored or being stored)."""
        get = self._policy.get
        out = []
        for key in keys:
            block = get(key)
            assert block is not None, f"key {key.hex()} has no slot"
            out.append(block.slot)
        return out

    def pin_ready(self, keys: Sequence[bytes], client: int) -> list[tuple[bytes, int]]:
        """Pin the ready ones of ``keys`` for ``client`` (no quota: the daemon's own
        reads, which end by ``complete_load``); returns them with their slots."""
        pins = self._pins.setdefault(client, Counter())
        out = []
        for key in keys:
            block = self._policy.get(key)
            if block is None or block.ref < 0 or key in self._corrupt:
                continue
            if block.ref == 0:
                self._num_evictable -= 1
                self._num_pinned += 1
            block.ref += 1
            pins[key] += 1
            out.append((key, block.slot))
        if not pins:
            del self._pins[client]
        return out

    def take_events(self, subscriber: int = 0) -> list[OffloadEvent]:
        """Events for one subscriber since its last take (see ``events.EventFeed``)."""
        return self.events.take(subscriber)[0]

    def ready_keys(self) -> list[bytes]:
        """Every key a lookup would hit right now (a snapshot for client mirrors)."""
        return list(self._ready)

    # ------------------------------------------------------------ leases (data path)

    def check_store_slots(self, slots: npt.NDArray[np.int64]) -> None:
        """Every slot must be leased for writing (prepared, not yet completed)."""
        self._check_slots(slots, lambda ref: ref == -1, "leased for a store")

    def check_load_slots(self, slots: npt.NDArray[np.int64]) -> None:
        """Every slot must hold a block pinned by an outstanding prepare_load."""
        self._check_slots(slots, lambda ref: ref > 0, "pinned by a prepare_load")

    def _check_slots(
        self, slots: npt.NDArray[np.int64], ok: Callable[[int], bool], what: str
    ) -> None:
        get = self._policy.get
        slot_key = self._slot_key
        for slot in slots.tolist():
            key = slot_key[slot] if 0 <= slot < len(slot_key) else None
            block = get(key) if key is not None else None
            if block is None or block.slot != slot:
                grave = self.graves.by_slot.get(slot)
                block = grave.block if grave is not None else None
            if block is None or not ok(block.ref):
                raise NotLeasedError(f"slot {slot} of namespace {self.name!r} is not {what}")

    # ------------------------------------------------------------ owners, admin

    def release_client(self, client: int) -> tuple[int, int]:
        """Fail the client's in-flight stores and drop its pins; returns both counts."""
        writes = [(k, self._policy.get(k)) for k, c in self._writers.items() if c == client]
        self._finish_stores([(k, b) for k, b in writes if b is not None], success=False)
        pins = self._pins.pop(client, Counter())
        dropped = sum(pins.values())
        for key in list(pins.elements()):
            self._unpin(key, pins)
        dropped += self.graves.release(client)
        self.free_graves()
        return len(writes), dropped

    def pinned_by(self, client: int) -> int:
        return sum(self._pins.get(client, Counter()).values())

    def writing_by(self, client: int) -> int:
        return sum(1 for c in self._writers.values() if c == client)

    def evict(self, keys: Sequence[bytes] | None = None, prefix: bytes | None = None) -> int:
        """Admin eviction of ready, unpinned blocks (all, given keys, or a key prefix)."""
        if keys is None:
            candidates = [k for k, b in self._policy.items() if b.ref == 0]
        else:
            candidates = [
                k for k in dict.fromkeys(keys) if (b := self._policy.get(k)) and b.ref == 0
            ]
        if prefix is not None:
            candidates = [k for k in candidates if k.startswith(prefix)]
        victims = []
        for key in candidates:
            block = self._policy.get(key)
            assert block is not None
            self._policy.remove(key)
            victims.append((key, block))
        self._drop(victims)
        self.slots.release_free_tail()
        return len(victims)

    def evict_top_extent(self) -> bool:
        """Evict every block of the top extent so it can go back to the pool.

        Refused (False) when any block there is being written, pinned or copied.
        """
        self.free_graves()
        slots = self.slots.top_extent_slots()
        if not slots:
            return False
        victims: list[tuple[bytes, Block]] = []
        for slot in slots:
            if slot in self.slots.busy or slot in self.graves.by_slot:
                return False
            key = self._slot_key[slot] if slot < len(self._slot_key) else None
            if key is None:
                continue
            block = self._policy.get(key)
            if block is None or block.ref != 0:
                return False
            victims.append((key, block))
        for key, _ in victims:
            self._policy.remove(key)
        self._drop(victims, bury=False)  # the extent goes elsewhere: nothing to keep
        return self.slots.release_free_tail() > 0

    def _drop(
        self, victims: list[tuple[bytes, Block]], exempt: int | None = None, bury: bool = True
    ) -> list[bytes]:
        """Evict blocks (already out of the policy): announce them, then free their
        slots, or bury them while other engines' mirrors may still hit them."""
        keys = [key for key, _ in victims]
        if not keys:
            return keys
        self._num_evictable -= len(keys)
        self._evicted += len(keys)
        self.events.emit(OffloadEvent(keys, removed=True))
        if bury and self.graves.needed(exempt):
            now = time.monotonic()
            for key, block in victims:
                self._ready.discard(key)
                self.graves.bury(key, block, self.events.seq, exempt, now)
        else:
            for _, block in victims:
                self._free_slot(block.slot)
        return keys

    def free_graves(self) -> None:
        """Free the slots of graves every mirror has seen (or whose grace is over)."""
        if self.graves.by_slot:
            for grave in self.graves.free_now(time.monotonic()):
                self._free_slot(grave.block.slot)

    def add_mirror(self, client: int) -> None:
        """A client took a key snapshot: from now on its mirror can hit evicted keys."""
        self.graves.add_mirror(client, self.events.seq)

    def take_feed(self, client: int) -> tuple[list[OffloadEvent], bool]:
        """The client's events since its last take; for a mirror, also its ack."""
        events, lost = self.events.take(client)
        self.graves.ack(client, self.events.seq)
        self.free_graves()
        return events, lost

    def _free_slot(self, slot: int) -> None:
        key = self._slot_key[slot]
        assert key is not None, f"slot {slot} freed twice"
        self._slot_key[slot] = None
        self._ready.discard(key)
        self._written.pop(slot, None)
        if self._checksums:
            w = self.layout.world_size
            for rank in range(w):
                self._checksums.pop(slot * w + rank, None)
        self._journal.freed(slot)
        self.slots.free(slot)

    def statistics(self) -> NamespaceStatistics:
        blocks = list(self._policy.items())
        return NamespaceStatistics(
            name=self.name,
            fingerprint=self.fingerprint,
            policy=self.policy_name,
            slot_bytes=self.slots.slot_bytes,
            extents=len(self.slots.extents),
            capacity_blocks=self.slots.capacity,
            free_blocks=self.slots.num_free,
            stored_blocks=sum(1 for _, b in blocks if b.ref >= 0),
            writing_blocks=len(self._writers),
            pinned_blocks=sum(1 for _, b in blocks if b.ref > 0),
            held_evicted_blocks=len(self.graves),
            quota_blocks=self.max_blocks or 0,
            quota_pinned_blocks=self.max_pinned_blocks or 0,
            lookups_total=self._lookups,
            lookup_keys_total=self._lookup_keys,
            hit_keys_total=self._hit_keys,
            miss_keys_total=self._lookup_keys - self._hit_keys,
            lookup_misses_total=self._lookup_misses,
            stores_prepared_total=self._stores_prepared,
            stored_blocks_total=self._stored,
            store_failures_total=self._store_failures,
            loads_prepared_total=self._loads_prepared,
            evicted_blocks_total=self._evicted,
            events_dropped_total=self.events.dropped_total,
        )

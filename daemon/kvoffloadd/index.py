"""Per-namespace block index: the offloading-manager contract of vLLM, with owners.

Semantics follow vLLM's CPU offloading manager (research/vllm_kv_offload.md section 3)
so that engines see exactly the behaviour of the built-in offloader:

- ``ref`` is -1 while a block is being written, 0 when ready and evictable, N > 0 while
  N loads are in flight. ``lookup`` counts the leading keys that are present *and*
  ready (invariant 1: a block is visible only after its store completed).
- ``prepare_store`` skips keys already present; when only such keys are given it
  returns an empty plan, not None. It evicts atomically, never its own input keys and
  never a block with ``ref != 0`` (invariant 2); ``None`` means no space.
- Events are emitted only when a store completes and when blocks are evicted; stored
  events carry the blocks' slots, so an engine can plan loads without asking.
- A store can only complete successfully once every rank's copy into its slot has
  finished (``mark_written``): a key never becomes visible over bytes nobody wrote.

Engines' schedulers never wait for the daemon (kvoffload.view): they store into
*leased* slots (leases.py) and send claims, commits, pins and unpins one-way, once
per step. The engine-facing calls are therefore lenient where the blocking API is
strict: ``claim`` of a key someone stored meanwhile becomes a shadow copy, dropped at
commit (one copy stays); ``commit`` before every rank's copy has landed waits for the
copies (``commit_timeout_s``), and a store whose copy failed (``void``) is dropped;
``pin``/``unpin`` act on the key wherever its block is. Nothing an engine sends is
ever an error that could reach vLLM; what was refused is counted.

While other engines' mirrors are attached, evicted blocks stay loadable and keep their
slots until those mirrors have seen the eviction (graves.py). An engine acks its feed
only after the pins it took before reading it, so a block an engine pinned locally is
never reused before the daemon has seen the pin.

Owners: every block being written belongs to the client that prepared or claimed it,
every pin to the client that took it. Completing someone else's store or load through
the blocking API is ``NOT_LEASED``; ``release_client`` fails a dead client's stores,
frees its leases and drops its pins at once (invariant 5).

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
from .checksums import BlockChecksums
from .events import EventFeed
from .graves import Graveyard
from .leases import LeaseBook
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
    leased_blocks: int  # granted to engines ahead of their stores
    commits_waiting: int  # committed, waiting for a rank's copy
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
    duplicate_stores_total: int  # two engines stored one key at once: one copy kept
    loads_prepared_total: int
    pins_missed_total: int  # engine pins of keys already gone (their loads resolve by key)
    evicted_blocks_total: int
    events_dropped_total: int


class SlotJournal:
    """Receives every slot state change (the region's slot table implements it)."""

    def leased(self, slot: int, lease: int) -> None: ...
    def writing(self, slot: int, key: bytes, lease: int = 0) -> None: ...
    def ready(self, slot: int, key: bytes) -> None: ...
    def buried(self, slot: int) -> None: ...
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
        commit_timeout_s: float = 30.0,
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
        self.commit_timeout_s = commit_timeout_s
        self._num_evictable = 0
        self._num_pinned = 0  # blocks with ref > 0
        self.sums = BlockChecksums(layout.world_size)  # verify_checksums
        # quotas (None: unlimited): slots this namespace may hold, blocks it may pin
        self.max_blocks: int | None = None
        self.max_pinned_blocks: int | None = None
        # slot -> key of the block in it (None: free, leased or a shadow copy)
        self._slot_key: list[bytes | None] = []
        # keys whose store completed (ref >= 0): lookup runs on this set in C
        self._ready: set[bytes] = set()
        self._written: dict[int, int] = {}  # slot being written -> bit mask of ranks done
        self._all_ranks = (1 << layout.world_size) - 1
        self._void: set[int] = set()  # slots whose copy failed: their store never commits
        self._waiting: dict[int, float] = {}  # committed slot -> deadline for its copies
        self._writers: dict[bytes, int] = {}
        self._writing_by: Counter[int] = Counter()  # client -> blocks it is writing
        # blocks in flight (being written, or leased empty): per client and in total;
        # None: no limit (set from max_writing_fraction)
        self.max_writing_per_client: int | None = None
        self.max_writing: int | None = None
        self._pins: dict[int, Counter[bytes]] = {}
        self.leases = LeaseBook()
        self.creator_uid = 0  # who created the namespace (per-uid limits)
        self.events = EventFeed()
        # called with the keys of every successful store (the tiers cascade them)
        self.on_stored: Callable[[NamespaceIndex, list[bytes]], None] | None = None
        # evicted blocks other engines' key mirrors may still hit (graves.py)
        self.graves = Graveyard(mirror_grace_s)
        # statistics
        self._lookups = self._lookup_keys = self._hit_keys = self._lookup_misses = 0
        self._stores_prepared = self._stored = self._store_failures = self._duplicates = 0
        self._loads_prepared = self._evicted = self._pins_missed = 0

    # ------------------------------------------------------------ scheduler side

    def lookup(self, keys: Sequence[bytes]) -> int:
        hits = len(list(takewhile(self._ready.__contains__, keys)))
        self._lookups += 1
        self._lookup_keys += len(keys)
        self._hit_keys += hits
        if hits < len(keys):
            self._lookup_misses += 1
        return hits

    def prepare_store(self, keys: Sequence[bytes], client: int, token: int = 0) -> StorePlan | None:
        get = self._policy.get
        to_store = [k for k in dict.fromkeys(keys) if get(k) is None]
        if not to_store:
            return StorePlan([], [], [])
        need = len(to_store)
        if need > self.writing_room(client, token):
            raise QuotaExceededError(
                f"namespace {self.name!r}: {need} more blocks in flight would pass the "
                "limit of blocks being written (max_writing_fraction); complete some first"
            )
        self._reclaim_for(need)
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
        slots = self._allocate(need)
        for key, slot in zip(to_store, slots):
            self._insert_writing(key, slot, client, token)
        return StorePlan(to_store, slots, evicted)

    def _reclaim_for(self, need: int) -> None:
        self.free_graves()
        if need > self.slots.num_free and not self._quota_binds() and self._reclaim is not None:
            self._reclaim(self, need)  # more region space; useless when the quota binds

    def _allocate(self, n: int) -> list[int]:
        slots = self.slots.allocate(n)
        if len(self._slot_key) < self.slots.capacity:
            self._slot_key.extend([None] * (self.slots.capacity - len(self._slot_key)))
        return slots

    def _insert_writing(self, key: bytes, slot: int, client: int, token: int) -> None:
        self._policy.insert(key, Block(slot))
        self._slot_key[slot] = key
        self._writers[key] = client
        self._writing_by[client] += 1
        if token:
            self.leases.token_of[slot] = token
        self._journal.writing(slot, key, token)
        self._stores_prepared += 1

    def _free_within_quota(self) -> int:
        """Free slots this namespace may still take (region space and its quota)."""
        free = self.slots.num_free
        if self.max_blocks is not None:
            free = min(free, max(0, self.max_blocks - self.slots.num_used))
        return free

    def _quota_binds(self) -> bool:
        return self._free_within_quota() < self.slots.num_free

    def complete_store(self, keys: Sequence[bytes], success: bool, client: int) -> None:
        """The blocking API's completion: strict about owners and unwritten blocks."""
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
        slot_key, token_of, written = self._slot_key, self.leases.token_of, self._written
        done: list[tuple[bytes, Block]] = []
        for slot in slots:
            key = slot_key[slot] if slot < len(slot_key) else None
            if key is None and slot not in token_of:
                continue  # freed meanwhile
            bits = written[slot] = written.get(slot, 0) | bit
            if bits == self._all_ranks and slot in self._waiting and key is not None:
                block = self._policy.get(key)
                if block is not None and block.slot == slot and block.ref == -1:
                    done.append((key, block))
        if done:
            self._finish_stores(done, True)

    def void(self, slots: Sequence[int]) -> None:
        """A store copy into these slots failed or came too late: never commit them."""
        failed: list[tuple[bytes, Block]] = []
        for slot in slots:
            key = self._slot_key[slot] if slot < len(self._slot_key) else None
            if key is None and slot not in self.leases.token_of:
                continue
            self._void.add(slot)
            if slot in self._waiting and key is not None:
                block = self._policy.get(key)
                if block is not None and block.slot == slot and block.ref == -1:
                    failed.append((key, block))
        if failed:
            self._finish_stores(failed, False)

    def _finish_stores(self, blocks: list[tuple[bytes, Block]], success: bool) -> None:
        stored: list[bytes] = []
        stored_slots: list[int] = []
        writing_by = self._writing_by
        for key, block in blocks:
            client = self._writers.pop(key)
            writing_by[client] -= 1
            if not writing_by[client]:
                del writing_by[client]
            slot = block.slot
            self._waiting.pop(slot, None)
            self.leases.forget(slot)
            if success:
                block.ref = 0
                self._num_evictable += 1
                self._written.pop(slot, None)
                self._ready.add(key)
                stored.append(key)
                stored_slots.append(slot)
                self._journal.ready(slot, key)
            else:
                self._policy.remove(key)
                self._free_slot(slot)
                self._store_failures += 1
        if stored:
            self._stored += len(stored)
            self.events.emit(OffloadEvent(stored, removed=False, slots=stored_slots))
            if self.on_stored is not None:
                self.on_stored(self, stored)

    # ------------------------------------------------------------ engine batches

    def writing_room(self, client: int, token: int) -> int:
        """How many more blocks ``client`` may have in flight (written or leased)."""
        room = 1 << 62
        if self.max_writing_per_client is not None:
            mine = self._writing_by[client] + self.leases.unclaimed(token)
            room = self.max_writing_per_client - mine
        if self.max_writing is not None:
            total = len(self._writers) + self.leases.total_unclaimed()
            room = min(room, self.max_writing - total)
        return max(0, room)

    def lease(self, token: int, n: int, client: int = 0) -> list[int]:
        """Grant up to ``n`` empty slots to ``token``, evicting to make room if needed.

        Eviction here is not all-or-nothing: it runs outside any engine request, to
        keep the engines' pools filled. Space held in graves counts as coming, so a
        grant may be smaller now and complete at a later refill.
        """
        n = min(n, self.writing_room(client, token))
        if n <= 0:
            return []
        self.reserve(n)
        slots = self._allocate(min(n, self._free_within_quota()))
        self.leases.grant(token, slots)
        for slot in slots:
            self._journal.leased(slot, token)
        return slots

    def reserve(self, n: int) -> None:
        """Keep ``n`` slots free, or coming free from graves, evicting least recently
        used blocks now: what the next lease refill will hand out."""
        self._reclaim_for(n)
        short = n - self._free_within_quota() - len(self.graves)
        if short > 0 and self._num_evictable:
            victims = self._policy.evict(min(short, self._num_evictable), set())
            if victims:
                self._drop(victims)

    def claim(self, token: int, client: int, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        """An engine stores ``keys`` into its leased ``slots``; returns refused claims."""
        get, refused = self._policy.get, 0
        for key, slot in zip(keys, slots):
            if not self.leases.claim(token, slot):
                refused += 1  # not (or no longer) this engine's lease
                continue
            if get(key) is not None:  # stored by someone else meanwhile: a shadow copy
                self.leases.shadows[(token, key)] = slot
                self._journal.writing(slot, key, token)
                continue
            self._insert_writing(key, slot, client, token)
        return refused

    def commit(self, token: int, client: int, keys: Sequence[bytes], success: bool) -> None:
        """An engine's completion of its stores: lenient (see the module docstring)."""
        get, now = self._policy.get, time.monotonic()
        done: list[tuple[bytes, Block]] = []
        failed: list[tuple[bytes, Block]] = []
        for key in dict.fromkeys(keys):
            shadow = self.leases.shadows.pop((token, key), None)
            if shadow is not None:
                self._duplicates += 1
                self._free_slot(shadow)  # one copy of the key stays
                continue
            block = get(key)
            if block is None or block.ref != -1 or self._writers.get(key) != client:
                continue  # not this engine's store (or of an earlier connection)
            slot = block.slot
            if not success or slot in self._void:
                failed.append((key, block))
            elif self._written.get(slot) == self._all_ranks:
                done.append((key, block))
            else:
                self._waiting[slot] = now + self.commit_timeout_s
        if failed:
            self._finish_stores(failed, False)
        if done:
            self._finish_stores(done, True)

    def expire_commits(self, now_s: float) -> int:
        """Fail committed stores whose copies never landed; returns how many."""
        late = [s for s, deadline in self._waiting.items() if deadline <= now_s]
        blocks = []
        for slot in late:
            key = self._slot_key[slot]
            block = self._policy.get(key) if key is not None else None
            if block is not None and block.slot == slot and block.ref == -1:
                blocks.append((key, block))
            else:
                del self._waiting[slot]
        self._finish_stores(blocks, False)  # type: ignore[arg-type]
        return len(blocks)

    def pin(self, keys: Sequence[bytes], client: int) -> None:
        """Pins an engine took locally: each key's block, wherever it is now."""
        pins = self._pins.setdefault(client, Counter())
        limit = self.max_pinned_blocks
        for key in keys:
            block = self._policy.get(key)
            if block is not None and block.ref >= 0 and key not in self.sums.corrupt:
                if block.ref == 0:
                    if limit is not None and self._num_pinned >= limit:
                        self._pins_missed += 1
                        continue
                    self._num_evictable -= 1
                    self._num_pinned += 1
                block.ref += 1
                pins[key] += 1
            elif (grave := self.graves.loadable(key)) is not None:
                self.graves.pin(client, grave.block.slot)
            else:
                self._pins_missed += 1
        if not pins:
            del self._pins[client]

    def unpin(self, keys: Sequence[bytes], client: int) -> None:
        """An engine's completed loads: drop one pin per key (lenient)."""
        pins = self._pins.get(client, Counter())
        graves = self.graves.pinned_by(client)
        for key in keys:
            if pins[key]:
                self._unpin(key, pins)
            elif graves.get(key):
                self.graves.unpin(client, graves[key].pop())
        if client in self._pins and not pins:
            del self._pins[client]
        self.free_graves()

    # ------------------------------------------------------------ loads

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
            elif key in self.sums.corrupt:
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
        self.unpin(keys, client)

    def _unpin(self, key: bytes, pins: Counter[bytes]) -> None:
        block = self._policy.get(key)
        assert block is not None and block.ref > 0, f"pinned key {key.hex()} lost its block"
        block.ref -= 1
        if block.ref == 0:
            self._num_evictable += 1
            self._num_pinned -= 1
            if key in self.sums.corrupt:
                self.sums.corrupt.discard(key)
                self._policy.remove(key)
                self._drop([(key, block)], bury=False)
        pins[key] -= 1
        if not pins[key]:
            del pins[key]

    def resolve_load(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[int]:
        """Where to read each key now: its planned slot while that still holds the key
        (ready or a grave), else wherever the key's block is; NotFoundError if the key
        is gone. A load that names its keys therefore reads exactly their bytes."""
        get, slot_key, graves = self._policy.get, self._slot_key, self.graves.by_slot
        out: list[int] = []
        for key, slot in zip(keys, slots):
            block = get(key)
            usable = block is not None and block.ref >= 0 and key not in self.sums.corrupt
            if 0 <= slot < len(slot_key) and slot_key[slot] == key:
                if usable and block is not None and block.slot == slot:
                    out.append(slot)
                    continue
                grave = graves.get(slot)
                if grave is not None and grave.key == key and grave.loadable:
                    out.append(slot)
                    continue
            if usable and block is not None:
                out.append(block.slot)
            elif (grave := self.graves.loadable(key)) is not None:
                out.append(grave.block.slot)
            else:
                raise NotFoundError(f"cannot load key {key.hex()}: no longer stored")
        return out

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
                self.sums.corrupt.add(key)
        return keys

    def restore(self, blocks: list[tuple[int, bytes]]) -> None:
        """Re-insert completed stores found in a kept region, oldest first (warm restart)."""
        self._allocate(0)
        for slot, key in blocks:
            block = Block(slot)
            block.ref = 0
            self._policy.insert(key, block)
            self._slot_key[slot] = key
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
            if block is None or block.ref < 0 or key in self.sums.corrupt:
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

    def ready_keys(self) -> list[tuple[bytes, int]]:
        """Every key a lookup would hit right now, with its slot (a mirror snapshot)."""
        get = self._policy.get
        return [(k, b.slot) for k in self._ready if (b := get(k)) is not None]

    # ------------------------------------------------------------ leases (data path)

    def check_store_slots(self, slots: npt.NDArray[np.int64], client: int, token: int) -> None:
        """Every slot must be this writer's: leased to ``token`` (granted, claimed or a
        shadow copy), or, without a token, prepared by ``client`` and still being
        written (invariants 4 and 9)."""
        slot_key, get, may_write = self._slot_key, self._policy.get, self.leases.may_write
        for slot in slots.tolist():
            if token:
                ok = may_write(token, slot)
            else:
                key = slot_key[slot] if 0 <= slot < len(slot_key) else None
                block = get(key) if key is not None else None
                ok = (
                    block is not None
                    and block.slot == slot
                    and block.ref == -1
                    and self._writers.get(key) == client  # type: ignore[arg-type]
                )
            if not ok:
                raise NotLeasedError(
                    f"slot {slot} of namespace {self.name!r} is not leased to this writer"
                )

    def check_load_slots(self, slots: npt.NDArray[np.int64]) -> None:
        """Every slot must hold a block pinned by an outstanding prepare_load."""
        get = self._policy.get
        slot_key = self._slot_key
        for slot in slots.tolist():
            key = slot_key[slot] if 0 <= slot < len(slot_key) else None
            block = get(key) if key is not None else None
            if block is None or block.slot != slot:
                grave = self.graves.by_slot.get(slot)
                block = grave.block if grave is not None else None
            if block is None or not block.ref > 0:
                raise NotLeasedError(
                    f"slot {slot} of namespace {self.name!r} is not pinned by a prepare_load"
                )

    # ------------------------------------------------------------ owners, admin

    def release_client(self, client: int, token: int = 0) -> tuple[int, int]:
        """Fail the client's in-flight stores, free its leases and drop its pins;
        returns (stores failed, pins dropped)."""
        writes = [(k, self._policy.get(k)) for k, c in self._writers.items() if c == client]
        self._finish_stores([(k, b) for k, b in writes if b is not None], success=False)
        if token:
            for _, slot in self.leases.shadows_of(token):
                self._free_slot(slot)
            self.leases.shadows = {k: s for k, s in self.leases.shadows.items() if k[0] != token}
            for slot in self.leases.release(token):
                self._free_slot(slot)
        pins = self._pins.pop(client, Counter())
        dropped = sum(pins.values())
        for key in list(pins.elements()):
            self._unpin(key, pins)
        dropped += self.graves.release(client)
        self.free_graves()
        return len(writes), dropped

    def is_idle(self) -> bool:
        """Nothing pinned, written or leased: the namespace may be dropped."""
        return not (self._writers or self._num_pinned or self.leases.token_of or self.graves)

    def pinned_by(self, client: int) -> int:
        return sum(self._pins.get(client, Counter()).values())

    def writing_by(self, client: int) -> int:
        return self._writing_by[client]

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

        Refused (False) when any slot there is leased, being written, pinned or copied.
        """
        self.free_graves()
        slots = self.slots.top_extent_slots()
        if not slots:
            return False
        victims: list[tuple[bytes, Block]] = []
        for slot in slots:
            if slot in self.slots.busy or slot in self.graves.by_slot:
                return False
            if slot in self.leases.token_of:
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
                self._journal.buried(block.slot)
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

    def ack(self, client: int, seq: int) -> None:
        """A mirror applied the feed up to ``seq`` (after sending the pins it took)."""
        self.graves.ack(client, min(seq, self.events.seq))
        self.free_graves()

    def take_feed(self, client: int) -> tuple[list[OffloadEvent], bool]:
        """The client's events since its last take; for a mirror, also its ack."""
        events, lost = self.events.take(client)
        self.ack(client, self.events.seq)
        return events, lost

    def _free_slot(self, slot: int) -> None:
        key = self._slot_key[slot]
        if key is not None:
            self._slot_key[slot] = None
            block = self._policy.get(key)
            if block is None or block.slot == slot:  # not a grave of a key stored again
                self._ready.discard(key)
        self._written.pop(slot, None)
        self._void.discard(slot)
        self._waiting.pop(slot, None)
        self.leases.forget(slot)
        self.sums.forget(slot)
        self._journal.freed(slot)
        self.slots.free(slot)

    def statistics(self) -> NamespaceStatistics:
        """O(1): counters kept as blocks change, never a walk over the blocks."""
        return NamespaceStatistics(
            name=self.name,
            fingerprint=self.fingerprint,
            policy=self.policy_name,
            slot_bytes=self.slots.slot_bytes,
            extents=len(self.slots.extents),
            capacity_blocks=self.slots.capacity,
            free_blocks=self.slots.num_free,
            stored_blocks=len(self._policy) - len(self._writers),
            writing_blocks=len(self._writers),
            pinned_blocks=self._num_pinned,
            leased_blocks=self.leases.total_unclaimed(),
            commits_waiting=len(self._waiting),
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
            duplicate_stores_total=self._duplicates,
            loads_prepared_total=self._loads_prepared,
            pins_missed_total=self._pins_missed,
            evicted_blocks_total=self._evicted,
            events_dropped_total=self.events.dropped_total,
        )

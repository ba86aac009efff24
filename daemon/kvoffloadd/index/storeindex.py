"""A namespace's blocks and their stores: the offloading-manager contract of vLLM.

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
- A block is visible only over bytes its writers wrote in that store: a store
  completes successfully only once every rank area of its slot was written whole
  (``mark_written``; the service accepts only store copies that write whole areas) and
  no store copy into the slot is still running. In a canonical namespace the engine's
  parts each write some fragments of the one area: once all of them reported
  (``mark_parts``), the service checks that what they copied covers every page
  (``seal``), and only then does the area count as written.
- A namespace's keys all have one length, the first stored key's: every packed key
  field of the protocol (a feed event, a plan's evicted keys) has one ``key_bytes``.
  A store of keys of another length is refused (INVALID_ARGUMENT); lookups of them
  simply miss.
- Every block being written belongs to the client that prepared or claimed it. One
  client, and all clients of one uid together, may have ``max_writing_per_client``
  blocks in flight (being written, leased empty, or claimed as a duplicate), all
  clients ``max_writing``: nobody holds the pool with stores it never ends, however
  many connections it opens.
- Evicted blocks go to graves (graves.py) while other engines' key mirrors may still
  hit them; their slots are freed once every mirror has seen the eviction.

This is the state and the store path; index.py adds engines' batches, loads, pins and
admin operations. Everything here runs on the daemon's loop thread only: no locks.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload.plans import OffloadEvent, StorePlan
from kvoffload.protocol.errors import InvalidArgumentError, NotLeasedError, QuotaExceededError
from kvoffload.protocol.messages import KVLayout
from kvoffload.protocol.packing import packed_count
from kvoffloadd.index.checksums import BlockChecksums
from kvoffloadd.index.events import EventFeed
from kvoffloadd.index.graves import Graveyard
from kvoffloadd.index.keyset import KeySetLike, key_set
from kvoffloadd.index.leases import LeaseBook
from kvoffloadd.index.policies import Block, make_policy
from kvoffloadd.ledger import Limits, Line
from kvoffloadd.region.slots import SlotJournal, SlotPool


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
    pins_expired_total: int  # pins held past pin_timeout_s, dropped
    evicted_blocks_total: int
    events_dropped_total: int


class StoreIndex:
    def __init__(
        self,
        ns_id: int,
        name: str,
        layout: KVLayout,
        fingerprint: str,
        slots: SlotPool,
        policy: str = "lru",
        journal: SlotJournal | None = None,
        reclaim: Callable[[int, int], None] | None = None,
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
        # keys whose store completed (ref >= 0): lookups probe this set in C (keyset.py)
        self._ready: KeySetLike = key_set()
        self._written: dict[int, int] = {}  # slot being written -> bit mask of areas done
        # canonical slot -> (parts, {part: worker}) of the parts that reported so far
        self._parts: dict[int, tuple[int, dict[int, int]]] = {}
        self._sealing: dict[int, int] = {}  # canonical slot -> token of its pending seal
        self._all_ranks = (1 << layout.world_size) - 1
        self._void: set[int] = set()  # slots whose copy failed: their store never commits
        self._waiting: dict[int, float] = {}  # committed slot -> deadline for its copies
        self._writers: dict[bytes, int] = {}
        self._writes_of: dict[int, set[bytes]] = {}  # client -> keys it is writing
        self.key_bytes = 0  # the length of every key here (0: none stored yet)
        # blocks in flight per uid (written, leased empty, duplicates); ``uid_of`` is
        # the service's (alone, every client is a uid of its own)
        self._inflight_by_uid: Counter[int] = Counter()
        self.uid_of: Callable[[int], int] = lambda client: -1 - client
        # blocks in flight (being written, or leased empty): per client and in total;
        # None: no limit (set from max_writing_fraction)
        self.max_writing_per_client: int | None = None
        self.max_writing: int | None = None
        self._pins: dict[int, Counter[bytes]] = {}
        # when each (client, key) was first pinned, oldest first (pins expire)
        self.pin_timeout_s = 60.0
        self.clock: Callable[[], float] = time.monotonic  # when pins were taken
        # (client, key) -> when its first pin was taken, oldest first: a key's entry
        # goes with its last pin, so this holds one entry per pinned key, never more
        self._pin_since: OrderedDict[tuple[int, bytes], float] = OrderedDict()
        # pins held per client, per uid and in total (the service's; unlimited alone)
        self.pin_ledger = Line("pins", Limits.scaled(0))
        # pins of the clients that may only read here (``reader_joined``): a reader uid
        # holds at most a quarter of the namespace's slots, all of them half (loads.py)
        self.reader_pins = Line("pins of readers", Limits.scaled(0))
        # region bytes leased empty per client, per uid and in total (the service's)
        self.lease_ledger = Line("leased_bytes", Limits.scaled(0))
        self._lease_client: dict[int, int] = {}  # lease token -> the client it is for
        self.lease_timeout_s = 30.0  # leases unclaimed this long are taken back
        self.leases = LeaseBook()
        self.creator_uid = 0  # who created the namespace (per-uid limits)
        self.events = EventFeed()
        self._snapshot: tuple[int, list[bytes]] | None = None  # (feed seq, ready keys)
        # called with the keys of every successful store (the tiers cascade them)
        self.on_stored: Callable[[list[bytes]], None] | None = None
        # evicted blocks other engines' key mirrors may still hit (graves.py)
        self.graves = Graveyard(mirror_grace_s)
        # statistics
        self._lookups = self._lookup_keys = self._hit_keys = self._lookup_misses = 0
        self._stores_prepared = self._stored = self._store_failures = self._duplicates = 0
        self._loads_prepared = self._evicted = self._pins_missed = self._pins_expired = 0
        # (when, blocks stored by then), every 1/STORE_MARKS of a window: what was stored
        # lately (NamespaceIndex.stored_within); at most STORE_MARKS + 2 entries
        self._store_marks: deque[tuple[float, int]] = deque()

    # ------------------------------------------------------------ scheduler side

    def ready_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are ready (no statistics)."""
        return self._ready.prefix(keys)

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self._counted(len(keys), self._ready.prefix(keys))

    def lookup_packed(self, packed: bytes, key_bytes: int) -> int:
        """``lookup`` of a packed key field (validated: ``packing.packed_count``),
        probed where it lies."""
        n = packed_count(packed, key_bytes)
        return self._counted(n, self._ready.prefix_packed(packed, key_bytes) if n else 0)

    def _counted(self, n: int, hits: int) -> int:
        self._lookups += 1
        self._lookup_keys += n
        self._hit_keys += hits
        if hits < n:
            self._lookup_misses += 1
        return hits

    def check_key_bytes(self, key_bytes: int) -> None:
        """Keys of this length may be stored here (the first store fixes the length)."""
        if key_bytes != self.key_bytes:
            if self.key_bytes:
                raise InvalidArgumentError(
                    f"namespace {self.name!r} holds keys of {self.key_bytes} bytes, not {key_bytes}"
                )
            self.key_bytes = key_bytes

    def prepare_store(self, keys: Sequence[bytes], client: int, token: int = 0) -> StorePlan | None:
        if keys:
            self.check_key_bytes(len(keys[0]))
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
        self._insert_writing(to_store, slots, client, token)
        self._inflight_by_uid[self.uid_of(client)] += need
        return StorePlan(to_store, slots, evicted)

    def _reclaim_for(self, need: int) -> None:
        self.free_graves()
        if need > self.slots.num_free and not self._quota_binds() and self._reclaim is not None:
            self._reclaim(self.ns_id, need)  # more region space; useless when the quota binds

    def _allocate(self, n: int) -> list[int]:
        slots = self.slots.allocate(n)
        if len(self._slot_key) < self.slots.capacity:
            self._slot_key.extend([None] * (self.slots.capacity - len(self._slot_key)))
        return slots

    def _insert_writing(
        self, keys: Sequence[bytes], slots: Sequence[int], client: int, token: int
    ) -> None:
        """Blocks being written by ``client``, new keys each (one batch: a hot loop)."""
        if not keys:
            return
        insert, slot_key = self._policy.insert, self._slot_key
        for key, slot in zip(keys, slots):
            insert(key, Block(slot))
            slot_key[slot] = key
        self._writers.update(dict.fromkeys(keys, client))
        if token:
            self.leases.assign_many(slots, token)
        self._journal.writing_many(slots, keys, token)
        self._writes_of.setdefault(client, set()).update(keys)
        self._stores_prepared += len(keys)

    def _charge(self, client: int, n: int) -> None:
        """``client`` holds ``n`` more (or, negative, fewer) blocks in flight."""
        self._inflight_by_uid[self.uid_of(client)] += n

    def _uncharge(self, client: int, n: int) -> None:
        uid = self.uid_of(client)
        left = self._inflight_by_uid[uid] - n
        if left > 0:
            self._inflight_by_uid[uid] = left
        else:
            del self._inflight_by_uid[uid]

    def _free_within_quota(self) -> int:
        """Free slots this namespace may still take (region space and its quota)."""
        free = self.slots.num_free
        if self.max_blocks is not None:
            free = min(free, max(0, self.max_blocks - self.slots.num_used))
        return free

    def _quota_binds(self) -> bool:
        return self._free_within_quota() < self.slots.num_free

    def writing_room(self, client: int, token: int) -> int:
        """How many more blocks ``client`` may have in flight (written, leased empty,
        or claimed as a duplicate), within its own share, its uid's and everyone's."""
        room = 1 << 62
        leases = self.leases
        if self.max_writing_per_client is not None:
            mine = len(self._writes_of.get(client, ()))
            if token:
                mine += leases.unclaimed(token) + leases.shadow_count(token)
            uid = self._inflight_by_uid[self.uid_of(client)]
            room = self.max_writing_per_client - max(mine, uid)
        if self.max_writing is not None:
            total = len(self._writers) + leases.total_unclaimed() + leases.shadow_count()
            room = min(room, self.max_writing - total)
        return max(0, room)

    def complete_store(self, keys: Sequence[bytes], success: bool, client: int) -> None:
        """The blocking API's completion: strict about owners and unwritten blocks."""
        get, writer = self._policy.get, self._writers.get
        mine: list[tuple[bytes, Block]] = []
        for key in dict.fromkeys(keys):
            block = get(key)
            if block is None or block.ref != -1:
                continue  # unknown or already complete: ignored, as in vLLM
            if writer(key) != client:
                raise NotLeasedError(f"key {key.hex()} is being stored by another client")
            mine.append((key, block))
        if success:
            unwritten = [k for k, b in mine if not self._whole(b.slot)]
            if unwritten:
                raise InvalidArgumentError(
                    f"{len(unwritten)} of the keys (first {unwritten[0].hex()}) have not been "
                    f"copied whole by all {self.layout.world_size} ranks yet; complete them "
                    "after their store jobs finished, or with success=False"
                )
        self._finish_stores(mine, success)

    def _takes_copies(self, slot: int) -> bool:
        """Whether ``slot`` is in a store (being written, or leased to an engine)."""
        key = self._slot_key[slot] if slot < len(self._slot_key) else None
        return key is not None or slot in self.leases.token_of

    def _whole(self, slot: int) -> bool:
        return self._written.get(slot) == self._all_ranks and not self.slots.is_storing(slot)

    def mark_written(self, slots: Sequence[int], area: int) -> None:
        """A store copy wrote rank ``area`` of these slots whole."""
        bit, written, get = 1 << area, self._written, self._written.get
        slot_key, leased, known = self._slot_key, self.leases.token_of, len(self._slot_key)
        for slot in slots:  # _takes_copies, inline: a job's slots, one by one
            if (slot < known and slot_key[slot] is not None) or slot in leased:
                written[slot] = get(slot, 0) | bit
        if self._waiting:  # else no store of them is committed yet
            self.finish_ready(slots)

    def mark_parts(
        self, slots: Sequence[int], part: int, parts: int, worker: int
    ) -> list[tuple[int, tuple[int, ...]]]:
        """A canonical part's store copy landed (``part`` of ``parts``, by ``worker``).
        Returns (slot, workers in part order) for the slots all of whose parts have now
        reported: the caller checks their fragments cover every page, then ``seal``.
        Parts that disagree on how many they are, or two workers of one part, fail
        the store."""
        whole: list[tuple[int, tuple[int, ...]]] = []
        bad: list[int] = []
        for slot in slots:
            if not self._takes_copies(slot) or slot in self._sealing:
                continue
            want, got = self._parts.setdefault(slot, (parts, {}))
            if want != parts or got.setdefault(part, worker) != worker:
                bad.append(slot)
            elif len(got) == parts:
                del self._parts[slot]
                whole.append((slot, tuple(got[p] for p in range(parts))))
        if bad:
            self.void(bad)
        return whole

    def start_seal(self, slots: Sequence[int], token: int) -> None:
        """These canonical slots' coverage is being checked (``seal`` with ``token``)."""
        for slot in slots:
            self._sealing[slot] = token

    def seal(self, ok: Sequence[int], bad: Sequence[int], token: int = 0) -> list[int]:
        """Canonical slots whose parts' copies cover every page (``ok``: the area is
        written) or do not (``bad``: the store fails). With ``token``, only slots
        still waiting for that seal count (a freed slot may be in a new store now).
        Returns the ok slots that were applied."""
        if token:
            ok = [s for s in ok if self._sealing.get(s) == token]
            bad = [s for s in bad if self._sealing.get(s) == token]
            for slot in (*ok, *bad):
                del self._sealing[slot]
        written = self._written
        for slot in ok:
            written[slot] = written.get(slot, 0) | 1
        if bad:
            self.void(bad)
        self.finish_ready(ok)
        return list(ok)

    def finish_ready(self, slots: Sequence[int]) -> None:
        """Complete the committed stores among ``slots`` that are whole now: every
        area written, nothing failed, no store copy into them still running."""
        done: list[tuple[bytes, Block]] = []
        waiting = self._waiting
        for slot in slots:
            if slot not in waiting or slot in self._void or not self._whole(slot):
                continue
            key = self._slot_key[slot]
            block = self._policy.get(key) if key is not None else None
            if block is not None and block.slot == slot and block.ref == -1:
                done.append((key, block))  # type: ignore[arg-type]
        if done:
            self._finish_stores(done, True)

    def holds_ready(self, slot: int) -> bool:
        """Whether ``slot`` holds a ready block (or one still being written)."""
        key = self._slot_key[slot] if 0 <= slot < len(self._slot_key) else None
        block = self._policy.get(key) if key is not None else None
        return block is not None and block.slot == slot

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
        keys = [key for key, _ in blocks]
        writers = list(map(self._writers.pop, keys))
        if writers and writers.count(writers[0]) == len(writers):  # one client's (usual)
            self._ended(writers[0], keys)
        else:
            by_client: dict[int, list[bytes]] = {}
            for key, client in zip(keys, writers):
                by_client.setdefault(client, []).append(key)
            for client, theirs in by_client.items():
                self._ended(client, theirs)
        if not success:
            self._policy.remove_many(keys)
            self._free_slots([block.slot for _, block in blocks])
            self._store_failures += len(blocks)
            return
        stored, stored_slots = keys, []
        waiting_pop, written_pop = self._waiting.pop, self._written.pop
        for _, block in blocks:
            slot = block.slot
            waiting_pop(slot, None)
            block.ref = 0
            written_pop(slot, None)
            stored_slots.append(slot)
        self._ready.update(stored)
        if self.leases.token_of:
            self.leases.forget_many(stored_slots)
        self._journal.ready_many(stored_slots, stored)
        self._num_evictable += len(stored)
        if stored:
            self._stored += len(stored)
            self.events.emit(OffloadEvent(stored, removed=False, slots=stored_slots))
            if self.on_stored is not None:
                self.on_stored(stored)

    def _ended(self, client: int, keys: list[bytes]) -> None:
        """``client``'s stores of ``keys`` ended (their writers are popped already)."""
        mine = self._writes_of[client]
        mine.difference_update(keys)
        if not mine:
            del self._writes_of[client]
        self._uncharge(client, len(keys))

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
            self._free_slots([block.slot for _, block in victims])
        return keys

    def free_graves(self, now_s: float | None = None) -> None:
        """Free the slots of graves every mirror has seen (or whose grace is over)."""
        if self.graves.by_slot:
            gone = self.graves.free_now(time.monotonic() if now_s is None else now_s)
            self._free_slots([grave.block.slot for grave in gone])

    def _free_slot(self, slot: int) -> None:
        self._free_slots((slot,))

    def _free_slots(self, slots: Sequence[int]) -> None:
        """Free these slots, in order: each step once for the whole batch."""
        if not slots:
            return
        slot_key, get, discard = self._slot_key, self._policy.get, self._ready.discard
        for slot in slots:
            key = slot_key[slot]
            if key is not None:
                slot_key[slot] = None
                block = get(key)
                if block is None or block.slot == slot:  # not a grave of a key stored again
                    discard(key)
        for per_slot in (self._written, self._parts, self._sealing, self._waiting):
            if per_slot:
                pop = per_slot.pop
                for slot in slots:
                    pop(slot, None)
        if self._void:
            self._void.difference_update(slots)
        if self.leases.token_of:
            self.leases.forget_many(slots)
        self.sums.forget_many(slots)
        self._journal.freed_many(slots)
        self.slots.free_many(slots)

    def is_idle(self) -> bool:
        """Nothing pinned, written or leased: the namespace may be dropped."""
        return not (self._writers or self._num_pinned or self.leases.token_of or self.graves)

    def pinned_by(self, client: int) -> int:
        return sum(self._pins.get(client, Counter()).values())

    def writing_by(self, client: int) -> int:
        return len(self._writes_of.get(client, ()))

    def statistics(self) -> NamespaceStatistics:
        """O(1): counters kept as blocks change, never a walk over the blocks."""
        return NamespaceStatistics(
            name=self.name,
            fingerprint=self.fingerprint,
            policy=self.policy_name,
            slot_bytes=self.slots.slot_bytes,
            extents=self.slots.num_extents,
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
            pins_expired_total=self._pins_expired,
            evicted_blocks_total=self._evicted,
            events_dropped_total=self.events.dropped_total,
        )

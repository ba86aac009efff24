"""Per-namespace block index: the engine-facing operations over a LoadIndex (its
stores, storeindex.py; its pins and loads, loads.py).

Engines' schedulers never wait for the daemon (kvoffload.engine.view): they store into
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

Owners: every pin belongs to the client that took it. Completing someone else's store
or load through the blocking API is ``NOT_LEASED``, and so is copying through a slot
leased or prepared for another client (invariant 9); ``release_client`` fails a dead
client's stores, frees its leases and drops its pins at once (invariant 5).

Everything here runs on the daemon's loop thread only: no locks.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from kvoffload.plans import OffloadEvent
from kvoffload.protocol.errors import NotLeasedError
from kvoffload.protocol.messages import EventMsg
from kvoffloadd.index.events import unpacked
from kvoffloadd.index.loads import LoadIndex
from kvoffloadd.index.policies import Block
from kvoffloadd.index.storeindex import NamespaceStatistics

__all__ = ["NamespaceIndex", "NamespaceStatistics", "OffloadEvent"]

STORE_MARKS = 8  # marks per window of ``stored_within``


class NamespaceIndex(LoadIndex):
    """A namespace's index as the service uses it (see the module docstring)."""

    # ------------------------------------------------------------ engine batches

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
        self.leases.grant(token, slots, self.uid_of(client), self.clock())
        self._lease_client[token] = client
        self._charge(client, len(slots))
        self.lease_ledger.add(client, len(slots) * self.slots.slot_bytes)
        self._journal.leased_many(slots, token)
        return slots

    def stored_within(self, window_s: float) -> int:
        """About how many blocks were stored in the last ``window_s`` (from marks taken
        every ``window_s / STORE_MARKS`` as this is asked; a bounded few of them)."""
        now, stored, marks = self.clock(), self._stored, self._store_marks
        if not marks or now - marks[-1][0] >= window_s / STORE_MARKS:
            marks.append((now, stored))
        while len(marks) > 1 and now - marks[1][0] >= window_s:
            marks.popleft()  # the oldest mark left is the last at or before the window
        while len(marks) > STORE_MARKS + 2:
            marks.popleft()  # a shorter window than before
        return stored - marks[0][1]

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
        get, leases = self._policy.get, self.leases
        if keys and len(keys[0]) != self.key_bytes:
            if self.key_bytes:
                return len(keys)  # keys of another length: refused, counted
            self.key_bytes = len(keys[0])
        took = leases.claim_many(token, slots[: len(keys)], self.clock())
        new: dict[bytes, int] = {}  # key -> slot: the blocks this batch starts writing
        for key, slot, ok in zip(keys, slots, took):
            if not ok:
                continue  # not (or no longer) this engine's lease: refused
            if key in new or get(key) is not None:
                # stored by someone else meanwhile (or twice here): a shadow copy
                leases.add_shadow(token, key, slot)
                self._journal.writing(slot, key, token)
                continue
            new[key] = slot
        self._insert_writing(list(new), list(new.values()), client, token)
        refused = took.count(False)
        self.lease_ledger.give(client, (len(took) - refused) * self.slots.slot_bytes)
        return refused

    def expire_leases(self, now_s: float) -> list[tuple[int, list[int]]]:
        """Take back the leased slots of tokens that have not claimed one for
        ``lease_timeout_s``; returns (token, slots) for each, to tell their engines."""
        out = []
        for token in self.leases.idle(now_s, self.lease_timeout_s):
            slots = self.leases.release(token)
            client = self._lease_client.get(token, 0)
            self._uncharge(client, len(slots))
            self.lease_ledger.give(client, len(slots) * self.slots.slot_bytes)
            self._free_slots(slots)
            out.append((token, slots))
        return out

    def commit(self, token: int, client: int, keys: Sequence[bytes], success: bool) -> None:
        """An engine's completion of its stores: lenient (see the module docstring)."""
        get, now = self._policy.get, time.monotonic()
        done: list[tuple[bytes, Block]] = []
        failed: list[tuple[bytes, Block]] = []
        shadows = self.leases.shadow_count(token) if token else 0
        for key in dict.fromkeys(keys):
            for shadow in self.leases.pop_shadows(token, key) if shadows else ():
                self._duplicates += 1
                self._uncharge(client, 1)
                self._free_slot(shadow)  # one copy of the key stays
            block = get(key)
            if block is None or block.ref != -1 or self._writers.get(key) != client:
                continue  # not this engine's store (or of an earlier connection)
            slot = block.slot
            if not success or slot in self._void:
                failed.append((key, block))
            elif self._whole(slot):
                done.append((key, block))
            else:
                self._waiting.pop(slot, None)  # kept in deadline order (expire_commits)
                self._waiting[slot] = now + self.commit_timeout_s
        if failed:
            self._finish_stores(failed, False)
        if done:
            self._finish_stores(done, True)

    def expire_commits(self, now_s: float, most: int = 1 << 62) -> int:
        """Fail committed stores whose copies never landed, at most ``most`` a call;
        returns how many. Commits wait in the order they came, each for the same
        ``commit_timeout_s``: the walk stops at the first one not due."""
        late: list[int] = []
        for slot, deadline in self._waiting.items():
            if deadline > now_s or len(late) >= most:
                break
            late.append(slot)
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

    # ------------------------------------------------------------ blocks

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
            self._snapshot = None  # no feed event says so
            if block.ref == 0:
                self._policy.remove(key)
                self._drop([(key, block)], bury=False)
            else:
                self.sums.corrupt.add(key)
        return keys

    def restore(self, blocks: list[tuple[int, bytes]]) -> None:
        """Re-insert completed stores found in a kept region, oldest first (warm restart)."""
        self._allocate(0)
        if blocks:
            self.key_bytes = len(blocks[0][1])  # recovery kept one length only
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

    def take_events(self, subscriber: int = 0) -> list[OffloadEvent]:
        """Events for one subscriber since its last take (see ``events.EventFeed``)."""
        return [unpacked(e) for e in self.events.take(subscriber)[0]]

    def snapshot_keys(self) -> list[bytes]:
        """The ready keys, shared by every caller at the same feed position (never
        changed: callers only page through it, ``where_ready``)."""
        if self._snapshot is None or self._snapshot[0] != self.events.seq:
            self._snapshot = (self.events.seq, list(self._ready))
        return self._snapshot[1]

    def where_ready(self, keys: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """Those of ``keys`` ready now, with their slots."""
        get, ready = self._policy.get, self._ready
        return [(k, b.slot) for k in keys if k in ready and (b := get(k)) is not None]

    # ------------------------------------------------------------ leases (data path)

    def check_store_slots(self, slots: npt.NDArray[np.int64], client: int, token: int) -> None:
        """Every slot must be this writer's: leased to ``token`` (granted, claimed or a
        shadow copy), or, without a token, prepared by ``client`` and still being
        written (invariants 4 and 9)."""
        if token and self.leases.all_writable(token, slots):
            return  # the engine path: one vectorised check of the lease mirror
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

    # ------------------------------------------------------------ owners, admin

    def release_client(
        self, client: int, token: int = 0, budget: int = 1 << 62
    ) -> tuple[int, int, bool]:
        """Fail the client's in-flight stores, free its leases and drop its pins, at
        most ``budget`` stores and pinned keys at a time; returns (stores failed, pins
        dropped, whether all is released: call again until it is)."""
        # its own writes only (indexed by client): a leaver's cost never grows with
        # what other clients have in flight
        mine = self._writes_of.get(client, ())
        writes = [(k, self._policy.get(k)) for k in itertools.islice(mine, budget)]
        self._finish_stores([(k, b) for k, b in writes if b is not None], success=False)
        if client in self._writes_of:
            return len(writes), 0, False
        budget -= len(writes)
        if token:
            unclaimed = self.leases.release(token)
            held = self.leases.release_shadows(token) + unclaimed
            self._uncharge(client, len(held))
            self.lease_ledger.give(client, len(unclaimed) * self.slots.slot_bytes)
            self._lease_client.pop(token, None)
            self._free_slots(held)
        pins = self._pins.get(client, Counter())
        dropped = 0
        for key, n in list(itertools.islice(pins.items(), max(0, budget))):
            self._unpin(key, pins, n, client)  # one step per key, however many pins
            dropped += n
        if pins:
            self._pins_given(client, dropped)
            return len(writes), dropped, False
        self._pins.pop(client, None)
        graves = self.graves.release(client)
        self._pins_given(client, dropped + graves)
        self.free_graves()
        return len(writes), dropped + graves, True

    def evict(
        self,
        keys: Sequence[bytes] | None = None,
        prefix: bytes | None = None,
        limit: int = 1 << 62,
    ) -> int:
        """Admin eviction of ready, unpinned blocks (all, given keys, or a key prefix),
        at most ``limit`` of them."""
        found: Iterable[bytes]
        if keys is None:
            found = (k for k, b in self._policy.items() if b.ref == 0)
        else:
            found = (k for k in dict.fromkeys(keys) if (b := self._policy.get(k)) and b.ref == 0)
        if prefix is not None:
            found = (k for k in found if k.startswith(prefix))
        candidates = list(itertools.islice(found, limit))
        victims = []
        for key in candidates:
            block = self._policy.get(key)
            assert block is not None
            self._policy.remove(key)
            victims.append((key, block))
        self._drop(victims)
        self.slots.release_free_tail()
        return len(victims)

    def evict_extent(self, budget: int = 1 << 30) -> int:
        """Give one extent back to the pool: the topmost one with nothing pinned, busy,
        leased, buried or being written, its blocks evicted. Looks at ``budget``
        slots at most; returns how many it looked at (negative: one was released)."""
        self.free_graves()
        looked = 0
        for chunk in self.slots.owned_chunks():
            if looked >= budget:
                break
            slots = self.slots.chunk_slots(chunk)
            looked += len(slots)
            if self._evict_chunk(chunk, slots):
                return -looked
        return looked

    def _evict_chunk(self, chunk: int, slots: range) -> bool:
        victims: list[tuple[bytes, Block]] = []
        for slot in slots:
            if self.slots.is_busy(slot) or slot in self.graves.by_slot:
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
        return self.slots.release_chunk(chunk)

    def add_mirror(self, client: int) -> None:
        """A client took a key snapshot: from now on its mirror can hit evicted keys."""
        self.graves.add_mirror(client, self.events.seq)

    def ack(self, client: int, seq: int) -> None:
        """A mirror applied the feed up to ``seq`` (after sending the pins it took)."""
        self.graves.ack(client, min(seq, self.events.seq))
        self.free_graves()

    def take_feed(self, client: int) -> tuple[list[EventMsg], bool]:
        """The client's events since its last take, as sent; for a mirror, its ack."""
        events, lost = self.events.take(client)
        self.ack(client, self.events.seq)
        return events, lost

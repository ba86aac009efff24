"""Pins and loads of a namespace's blocks: who holds which block, and for how long.

Rules:
- A pin is a client's hold on a ready block (``ref`` > 0): a pinned block is never
  evicted, nor its extent moved. Every pin belongs to the client that took it, and
  completing a load another client prepared is ``NOT_LEASED``.
- Engines' pins come one-way (``pin``, ``unpin``): lenient, a pin of a key gone or past
  the client's share is counted as missed, never an error. ``prepare_load`` is the
  blocking API's: all or nothing, refused with ``NOT_FOUND`` or ``QUOTA_EXCEEDED``.
- Pins are bounded per client, per uid and in total (``pin_ledger``) and by the
  namespace's ``max_pinned_blocks``; each ages from its first take and is dropped after
  ``pin_timeout_s`` (``expire_pins``): nobody keeps a block, or its extent, for good.
- A client that may only read the namespace (``reader_joined``) pins within the
  readers' part of its slots: one reader uid at most 1/``READER_UID_PIN_PART``, all
  of them 1/``READERS_PIN_PART``. A reader that pins every block again and again,
  before any pin ages out, still leaves the writers half the namespace to store into.
- A pinned block that a mirror may still hit after its eviction lies in a grave
  (graves.py): its pins are the grave's, and a load reads it there (``resolve_load``).
- A block found corrupt is never served again: no new pin, and it is evicted once its
  last pin goes.
- Loop thread only, no locks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from kvoffload.protocol.errors import NotFoundError, NotLeasedError, QuotaExceededError
from kvoffloadd.index.policies import Block
from kvoffloadd.index.storeindex import StoreIndex
from kvoffloadd.ledger import UNLIMITED, Limits

# The parts of a namespace's slots that clients which may only read it may pin: one
# reader uid 1/4, all of them 1/2 (a load pins a step's blocks, not a quarter)
READER_UID_PIN_PART = 4
READERS_PIN_PART = 2

_slot_of = attrgetter("slot")
_ref_of = attrgetter("ref")


class LoadIndex(StoreIndex):
    """A namespace's blocks with their pins and loads (see the module docstring)."""

    def reader_joined(self, client: int, uid: int) -> None:
        """``client`` (of ``uid``) may read this namespace but not write it."""
        self.reader_pins.join(client, uid)

    def reader_left(self, client: int) -> None:
        """``client`` gave back its pins here (``release_client``) and left."""
        self.reader_pins.leave(client)

    def _readers_room(self, client: int) -> int:
        """Pins ``client`` may take within the readers' part (any number: a writer)."""
        owned = self.slots.num_extents * self.slots.slots_per_extent
        line = self.reader_pins
        line.limits = Limits(UNLIMITED, owned // READER_UID_PIN_PART, owned // READERS_PIN_PART)
        return line.room(client)

    def _pins_taken(self, client: int, n: int) -> None:
        self.pin_ledger.add(client, n)
        self.reader_pins.add(client, n)

    def _pins_given(self, client: int, n: int) -> None:
        self.pin_ledger.give(client, n)
        self.reader_pins.give(client, n)

    def pin(self, keys: Sequence[bytes], client: int) -> None:
        """Pins an engine took locally: each key's block, wherever it is now. Pins
        past the client's share (``pin_ledger``) are missed, like pins of keys gone."""
        pins = self._pins.setdefault(client, Counter())
        limit = self.max_pinned_blocks
        room = min(self.pin_ledger.room(client), self._readers_room(client))
        taken = 0
        for key in keys:
            if taken >= room:
                self._pins_missed += 1
                continue
            block = self._policy.get(key)
            if block is not None and block.ref >= 0 and key not in self.sums.corrupt:
                if block.ref == 0 and limit is not None and self._num_pinned >= limit:
                    self._pins_missed += 1
                    continue
                self._pin_block(pins, client, key, block)
                taken += 1
            elif (grave := self.graves.loadable(key)) is not None:
                self.graves.pin(client, grave.block.slot)
                taken += 1
            else:
                self._pins_missed += 1
        self._pins_taken(client, taken)
        if not pins:
            del self._pins[client]

    def unpin(self, keys: Sequence[bytes], client: int) -> None:
        """An engine's completed loads: drop one pin per key (lenient)."""
        pins = self._pins.get(client, Counter())
        graves = self.graves.pinned_by(client) if self.graves.by_slot else {}
        dropped = 0
        for key in keys:
            if pins[key]:
                self._unpin(key, pins, 1, client)
                dropped += 1
            elif held := graves.get(key):
                slot = next(iter(held))
                self.graves.unpin(client, slot)
                dropped += 1
                held[slot] -= 1
                if not held[slot]:
                    del held[slot]
        self._pins_given(client, dropped)
        if client in self._pins and not pins:
            del self._pins[client]
        self.free_graves()

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
        if len(keys) > self._readers_room(client):
            raise QuotaExceededError(
                f"{len(keys)} more pins would pass the part of namespace {self.name!r} "
                f"that uids which may only read it may pin (one uid 1/{READER_UID_PIN_PART}"
                f" of its slots, all 1/{READERS_PIN_PART}); complete some loads first"
            )
        if not self.pin_ledger.take(client, len(keys)):
            raise QuotaExceededError(
                f"this client holds {self.pin_ledger.held(client)} pins; {len(keys)} more "
                "would pass what one client, its uid or all clients may hold; complete "
                "some loads first"
            )
        self.reader_pins.add(client, len(keys))
        pins = self._pins.setdefault(client, Counter())
        for key, block in zip(keys, blocks):
            if id(block) in buried:
                self.graves.pin(client, block.slot)
                continue
            self._pin_block(pins, client, key, block)
        if not pins:
            del self._pins[client]
        self._loads_prepared += len(keys)
        return [b.slot for b in blocks]

    def complete_load(self, keys: Sequence[bytes], client: int) -> None:
        pins = self._pins.get(client, Counter())
        graves = self.graves.pinned_by(client)
        for key, count in Counter(keys).items():
            if pins[key] + sum(graves.get(key, {}).values()) < count:
                raise NotLeasedError(f"key {key.hex()} is not pinned by this client")
        self.unpin(keys, client)

    def _unpin(self, key: bytes, pins: Counter[bytes], n: int = 1, client: int = 0) -> None:
        """Drop ``n`` of ``client``'s pins of ``key`` (one step, whatever ``n``)."""
        block = self._policy.get(key)
        assert block is not None and block.ref >= n, f"pinned key {key.hex()} lost its block"
        block.ref -= n
        if block.ref == 0:
            self._num_evictable += 1
            self._num_pinned -= 1
            if key in self.sums.corrupt:
                self.sums.corrupt.discard(key)
                self._policy.remove(key)
                self._drop([(key, block)], bury=False)
        pins[key] -= n
        if not pins[key]:
            del pins[key]
            self._pin_since.pop((client, key), None)

    def _pin_block(self, pins: Counter[bytes], client: int, key: bytes, block: Block) -> None:
        """One more of ``client``'s pins (``pins``) of ``key``'s ready ``block``."""
        if block.ref == 0:
            self._num_evictable -= 1
            self._num_pinned += 1
        block.ref += 1
        if not pins[key]:
            self._pinned_at(client, key)
        pins[key] += 1

    def _pinned_at(self, client: int, key: bytes) -> None:
        """``client`` pinned ``key`` (its first pin of it): from now its pin ages."""
        if client >= 0:  # the daemon's own pins (tiers) end by their jobs' deadlines
            self._pin_since[(client, key)] = self.clock()  # inserted in age order

    def expire_pins(self, now_s: float, most_keys: int = 1 << 62) -> int:
        """Drop pins held longer than ``pin_timeout_s`` (a load takes a step, not a
        minute): a client cannot keep a block, or the extent it lies in, for good.
        At most ``most_keys`` keys' pins a call, oldest first (the rest at the next).
        Returns how many pins went."""
        since_of, dropped = self._pin_since, 0
        while since_of and most_keys > 0:
            most_keys -= 1
            (client, key), since = next(iter(since_of.items()))  # the oldest pin
            if since > now_s - self.pin_timeout_s:
                break
            pins = self._pins.get(client)
            n = pins[key] if pins is not None else 0
            if n and pins is not None:
                self._unpin(key, pins, n, client)
                self._pins_given(client, n)
                dropped += n
                if not pins:
                    del self._pins[client]
            since_of.pop((client, key), None)
        dropped += self._expire_grave_pins(now_s, most_keys)
        self._pins_expired += dropped
        return dropped

    def pins_due(self, now_s: float) -> bool:
        """Whether a pin is past ``pin_timeout_s`` (``expire_pins`` left some)."""
        since_of, timeout_s = self._pin_since, self.pin_timeout_s
        if since_of and next(iter(since_of.values())) <= now_s - timeout_s:
            return True
        return self.graves.pins_due(now_s, timeout_s)

    def _expire_grave_pins(self, now_s: float, most: int) -> int:
        dropped = 0
        for conn, n in self.graves.expire_pins(now_s, self.pin_timeout_s, most):
            self._pins_given(conn, n)
            dropped += n
        if dropped:
            self.free_graves(now_s)
        return dropped

    def resolve_load(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[int]:
        """Where to read each key now: its planned slot while that still holds the key
        (ready or a grave), else wherever the key's block is; NotFoundError if the key
        is gone. A load that names its keys therefore reads exactly their bytes."""
        get, slot_key, graves = self._policy.get, self._slot_key, self.graves.by_slot
        blocks = list(map(get, keys))
        if (  # every key ready where the engine planned it: C-level loops only
            None not in blocks
            and list(map(_slot_of, blocks)) == slots
            and min(map(_ref_of, blocks), default=0) >= 0
            and self.sums.corrupt.isdisjoint(keys)
        ):
            return list(slots)
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

    def pin_ready(self, keys: Sequence[bytes], client: int) -> list[tuple[bytes, int]]:
        """Pin the ready ones of ``keys`` for ``client`` (no quota: the daemon's own
        reads, which end by ``complete_load``); returns them with their slots."""
        pins = self._pins.setdefault(client, Counter())
        out = []
        for key in keys:
            block = self._policy.get(key)
            if block is None or block.ref < 0 or key in self.sums.corrupt:
                continue
            self._pin_block(pins, client, key, block)
            out.append((key, block.slot))
        if not pins:
            del self._pins[client]
        return out

    def check_load_slots(self, slots: npt.NDArray[np.int64]) -> None:
        """Every slot must hold a block pinned by an outstanding prepare_load."""
        get = self._policy.get
        slot_key = self._slot_key
        wanted = slots.tolist()
        if wanted and min(wanted) >= 0 and max(wanted) < len(slot_key):
            blocks = list(map(get, map(slot_key.__getitem__, wanted)))  # type: ignore[arg-type]
            if (  # every slot's own block, pinned: C-level loops only
                None not in blocks
                and list(map(_slot_of, blocks)) == wanted
                and min(map(_ref_of, blocks)) > 0
            ):
                return
        for slot in wanted:
            key = slot_key[slot] if 0 <= slot < len(slot_key) else None
            block = get(key) if key is not None else None
            if block is None or block.slot != slot:
                grave = self.graves.by_slot.get(slot)
                block = grave.block if grave is not None else None
            if block is None or not block.ref > 0:
                raise NotLeasedError(
                    f"slot {slot} of namespace {self.name!r} is not pinned by a prepare_load"
                )

"""Evicted blocks kept readable until every engine's key mirror has seen the eviction.

Engines answer vLLM's lookups from a local mirror of the namespace's keys
(``kvoffload.mirror``), refreshed from their event feed once per scheduler step. If
another engine's eviction freed a slot the moment it happened, a mirror could still
answer HIT for the evicted key, and the ``prepare_load`` after it would fail — vLLM
0.33 cannot recover from a failed load. So while other mirrors are attached, an
evicted block goes into the graveyard instead of being freed:

Rules:
- A buried block is gone for everything new: the eviction event goes out at once,
  lookups miss, a store of the same key takes a new slot. Only ``prepare_load`` of
  its key still finds it (a mirror's HIT that raced the eviction), pins it and
  reads the old bytes, which stay valid because the slot is not reused.
- A grave is freed once unpinned and either every mirror has read its event feed
  past the eviction (``ack``), except the connection whose own ``prepare_store`` did
  the evicting (it learned of it from the plan), or ``grace_s`` has passed. A mirror
  answers only from a view at most ``max_age_s`` old (0.05 s by default), so a grace
  well above that covers the lookup-to-``prepare_load`` gap.
- Mirrors are the connections that took a key snapshot (``SyncKeys``); a connection
  that goes away stops counting.
- Loop thread only, like the index that owns it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvoffloadd.index.policies import Block


@dataclass
class Grave:
    key: bytes
    block: Block  # its slot; ref counts the loads pinning it
    seq: int  # event feed sequence number of its eviction
    deadline_s: float
    exempt: int | None  # the connection that does not need to ack it
    loadable: bool = True  # False once found corrupt


class Graveyard:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.by_slot: dict[int, Grave] = {}
        self._by_key: dict[bytes, Grave] = {}
        self._mirrors: dict[int, int] = {}  # connection -> feed sequence it has read up to
        self._pins: dict[int, Counter[int]] = {}  # connection -> grave slots it pinned

    def __len__(self) -> int:
        return len(self.by_slot)

    def needed(self, exempt: int | None) -> bool:
        """Whether an eviction now must be buried: some other mirror may still hit it."""
        return any(m != exempt for m in self._mirrors)

    def add_mirror(self, conn: int, seq: int) -> None:
        self._mirrors[conn] = seq

    def drop_mirror(self, conn: int) -> None:
        self._mirrors.pop(conn, None)

    def ack(self, conn: int, seq: int) -> None:
        if conn in self._mirrors:
            self._mirrors[conn] = seq

    def bury(self, key: bytes, block: Block, seq: int, exempt: int | None, now_s: float) -> None:
        grave = Grave(key, block, seq, now_s + self.grace_s, exempt)
        self.by_slot[block.slot] = grave
        old = self._by_key.get(key)
        if old is None or old.seq < seq:
            self._by_key[key] = grave

    def unexempt(self, slots: list[int]) -> None:
        """The evicting connection never saw these evictions (its call failed)."""
        for slot in slots:
            self.by_slot[slot].exempt = None

    def loadable(self, key: bytes) -> Grave | None:
        grave = self._by_key.get(key)
        return grave if grave is not None and grave.loadable else None

    def forbid(self, slot: int) -> None:
        """A grave whose bytes failed their checksum is never loaded again."""
        if (grave := self.by_slot.get(slot)) is not None:
            grave.loadable = False

    def pin(self, conn: int, slot: int) -> None:
        self.by_slot[slot].block.ref += 1
        self._pins.setdefault(conn, Counter())[slot] += 1

    def pinned_by(self, conn: int) -> dict[bytes, dict[int, int]]:
        """Key -> {grave slot: pins} of the connection (its distinct slots, whatever
        the number of pins)."""
        out: dict[bytes, dict[int, int]] = {}
        for slot, n in self._pins.get(conn, Counter()).items():
            out.setdefault(self.by_slot[slot].key, {})[slot] = n
        return out

    def unpin(self, conn: int, slot: int, n: int = 1) -> None:
        self.by_slot[slot].block.ref -= n
        pins = self._pins[conn]
        pins[slot] -= n
        if not pins[slot]:
            del pins[slot]
        if not pins:
            del self._pins[conn]

    def expire_pins(self, now_s: float, timeout_s: float) -> list[tuple[int, int]]:
        """Drop the pins on graves evicted more than ``timeout_s`` past their grace
        (a load takes a step); returns (connection, pins dropped) pairs."""
        late = {
            s for s, g in self.by_slot.items() if g.block.ref and now_s > g.deadline_s + timeout_s
        }
        out: list[tuple[int, int]] = []
        for conn, pins in list(self._pins.items()):
            n = sum(pins.pop(slot) for slot in late & pins.keys())
            if n:
                out.append((conn, n))
            if not pins:
                del self._pins[conn]
        for slot in late:
            self.by_slot[slot].block.ref = 0
        return out

    def release(self, conn: int) -> int:
        """A connection went away: its pins and its mirror go; returns the pins dropped."""
        pins = self._pins.pop(conn, Counter())
        for slot, n in pins.items():
            self.by_slot[slot].block.ref -= n
        self.drop_mirror(conn)
        return sum(pins.values())

    def free_now(self, now_s: float) -> list[Grave]:
        """Take out every grave that may be freed now; the caller frees their slots."""
        out = [g for g in self.by_slot.values() if g.block.ref == 0 and self._seen(g, now_s)]
        for g in out:
            del self.by_slot[g.block.slot]
            if self._by_key.get(g.key) is g:
                del self._by_key[g.key]
        return out

    def _seen(self, g: Grave, now_s: float) -> bool:
        if not g.loadable or now_s >= g.deadline_s:
            return True
        return all(seq >= g.seq for conn, seq in self._mirrors.items() if conn != g.exempt)

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
- Freeing costs what it frees, never graves x mirrors: graves wait in burial order
  (their feed positions and deadlines only grow), mirrors' positions in a heap, so one
  look at the oldest grave and the two least advanced mirrors says whether anything
  can go; a pinned grave waits apart until its last pin goes.
- A grave's pins are dropped ``timeout_s`` past its grace (``expire_pins``), and that
  too costs what it drops: pinned graves wait in a heap by deadline (one entry per
  grave, rebuilt once stale entries outnumber the pinned graves), and each grave
  knows the connections pinning it.
- Loop thread only, like the index that owns it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from dataclasses import dataclass

from kvoffloadd.index.policies import Block

NONE_YET = 1 << 62  # no mirror: every position counts as seen


@dataclass(eq=False)
class Grave:
    key: bytes
    block: Block  # its slot; ref counts the loads pinning it
    seq: int  # event feed sequence number of its eviction
    deadline_s: float
    exempt: int | None  # the connection that does not need to ack it
    loadable: bool = True  # False once found corrupt
    seen: bool = False  # every mirror has seen it (or its grace is over): it waits for pins
    due: bool = False  # in the graveyard's heap of pinned graves (``expire_pins``)


class Graveyard:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.by_slot: dict[int, Grave] = {}
        self._by_key: dict[bytes, Grave] = {}
        self._mirrors: dict[int, int] = {}  # connection -> feed sequence it has read up to
        self._heap: list[tuple[int, int]] = []  # (seq, connection), stale entries skipped
        self._pins: dict[int, Counter[int]] = {}  # connection -> grave slots it pinned
        self._order: deque[Grave] = deque()  # in burial order, not yet seen
        self._ready: list[Grave] = []  # seen, unpinned or forbidden: free at the next call
        self._pinned: set[int] = set()  # slots of graves with pins
        self._pinners: dict[int, set[int]] = {}  # grave slot -> connections pinning it
        # pinned graves by deadline (stale entries of unpinned or freed ones skipped)
        self._due: list[tuple[float, int, Grave]] = []
        self._tiebreak = itertools.count()

    def __len__(self) -> int:
        return len(self.by_slot)

    def needed(self, exempt: int | None) -> bool:
        """Whether an eviction now must be buried: some other mirror may still hit it."""
        return any(m != exempt for m in self._mirrors)

    def add_mirror(self, conn: int, seq: int) -> None:
        self._mirrors[conn] = seq
        heapq.heappush(self._heap, (seq, conn))

    def drop_mirror(self, conn: int) -> None:
        self._mirrors.pop(conn, None)

    def ack(self, conn: int, seq: int) -> None:
        if self._mirrors.get(conn, seq) < seq:
            self._mirrors[conn] = seq
            heapq.heappush(self._heap, (seq, conn))

    def bury(self, key: bytes, block: Block, seq: int, exempt: int | None, now_s: float) -> None:
        grave = Grave(key, block, seq, now_s + self.grace_s, exempt)
        self.by_slot[block.slot] = grave
        self._order.append(grave)
        if block.ref:
            self._pinned.add(block.slot)
            self._queue(grave)
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
        if (grave := self.by_slot.get(slot)) is not None and grave.loadable:
            grave.loadable = False
            grave.seen = True
            if not grave.block.ref:
                self._ready.append(grave)

    def pin(self, conn: int, slot: int) -> None:
        grave = self.by_slot[slot]
        grave.block.ref += 1
        self._pinned.add(slot)
        self._pins.setdefault(conn, Counter())[slot] += 1
        self._pinners.setdefault(slot, set()).add(conn)
        if not grave.due:
            self._queue(grave)

    def _queue(self, grave: Grave) -> None:
        """Put a pinned ``grave`` in the heap its pins expire from."""
        due = self._due
        if len(due) > 2 * len(self._pinned) + 64:  # mostly graves unpinned or freed
            for _, _, g in due:
                g.due = False
            by_slot = self.by_slot
            live = (by_slot[s] for s in self._pinned)
            due[:] = [(g.deadline_s, next(self._tiebreak), g) for g in live if g is not grave]
            heapq.heapify(due)
            for _, _, g in due:
                g.due = True
        grave.due = True
        heapq.heappush(due, (grave.deadline_s, next(self._tiebreak), grave))

    def pinned_by(self, conn: int) -> dict[bytes, dict[int, int]]:
        """Key -> {grave slot: pins} of the connection (its distinct slots, whatever
        the number of pins)."""
        out: dict[bytes, dict[int, int]] = {}
        for slot, n in self._pins.get(conn, Counter()).items():
            out.setdefault(self.by_slot[slot].key, {})[slot] = n
        return out

    def unpin(self, conn: int, slot: int, n: int = 1) -> None:
        self._drop_pins(slot, n)
        pins = self._pins[conn]
        pins[slot] -= n
        if not pins[slot]:
            del pins[slot]
            self._unpinned_by(conn, slot)
        if not pins:
            del self._pins[conn]

    def _unpinned_by(self, conn: int, slot: int) -> None:
        pinners = self._pinners[slot]
        pinners.discard(conn)
        if not pinners:
            del self._pinners[slot]

    def _drop_pins(self, slot: int, n: int) -> None:
        grave = self.by_slot[slot]
        grave.block.ref -= n
        if not grave.block.ref:
            self._pinned.discard(slot)
            if grave.seen:
                self._ready.append(grave)

    def expire_pins(
        self, now_s: float, timeout_s: float, most: int = 1 << 62
    ) -> list[tuple[int, int]]:
        """Drop the pins on graves evicted more than ``timeout_s`` past their grace
        (a load takes a step), looking at most at ``most`` graves, the earliest
        buried first; returns (connection, pins dropped) pairs."""
        out: Counter[int] = Counter()
        due, by_slot = self._due, self.by_slot
        while due and most > 0 and now_s > due[0][0] + timeout_s:
            most -= 1
            grave = heapq.heappop(due)[2]
            grave.due = False
            slot = grave.block.slot
            if by_slot.get(slot) is not grave or not grave.block.ref:
                continue  # unpinned or freed since it was queued
            for conn in self._pinners.pop(slot, ()):
                pins = self._pins[conn]
                out[conn] += pins.pop(slot)
                if not pins:
                    del self._pins[conn]
            self._drop_pins(slot, grave.block.ref)
        return list(out.items())

    def pins_due(self, now_s: float, timeout_s: float) -> bool:
        """Whether a pinned grave may be past ``timeout_s`` (``expire_pins`` left some)."""
        return bool(self._due) and now_s > self._due[0][0] + timeout_s

    def release(self, conn: int) -> int:
        """A connection went away: its pins and its mirror go; returns the pins dropped."""
        pins = self._pins.pop(conn, Counter())
        for slot, n in pins.items():
            self._drop_pins(slot, n)
            self._unpinned_by(conn, slot)
        self.drop_mirror(conn)
        return sum(pins.values())

    def free_now(self, now_s: float) -> list[Grave]:
        """Take out every grave that may be freed now; the caller frees their slots."""
        low, low_conn, second = self._least_acked()
        order = self._order
        while order:
            g = order[0]
            if self.by_slot.get(g.block.slot) is not g or g.seen:
                order.popleft()  # freed or forbidden meanwhile
                continue
            acked = second if g.exempt is not None and g.exempt == low_conn else low
            if now_s < g.deadline_s and acked < g.seq:
                break  # later graves were buried later: none of them is seen either
            order.popleft()
            g.seen = True
            if not g.block.ref:
                self._ready.append(g)
        out = []
        for g in self._ready:
            if self.by_slot.get(g.block.slot) is g and not g.block.ref:
                del self.by_slot[g.block.slot]
                if self._by_key.get(g.key) is g:
                    del self._by_key[g.key]
                out.append(g)
        self._ready = []
        return out

    def _least_acked(self) -> tuple[int, int | None, int]:
        """The least advanced mirror's position and connection, and the position of the
        least advanced other one (a grave exempt from the first waits for the second)."""
        heap, mirrors = self._heap, self._mirrors
        if len(heap) > 2 * len(mirrors) + 64:  # stale entries pile up under a slow mirror
            heap[:] = [(seq, c) for c, seq in mirrors.items()]
            heapq.heapify(heap)
        self._clean_top()
        if not heap:
            return NONE_YET, None, NONE_YET
        first = heapq.heappop(heap)
        self._clean_top()
        second = heap[0][0] if heap else NONE_YET
        heapq.heappush(heap, first)
        return first[0], first[1], second

    def _clean_top(self) -> None:
        heap, mirrors = self._heap, self._mirrors
        while heap and mirrors.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # a mirror that moved on or went away

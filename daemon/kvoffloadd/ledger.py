"""What peers make the daemon hold, counted per connection, per uid and in total.

A client can make the daemon keep things for it: pins on blocks, copy jobs in flight,
the copies those jobs expand to. Each kind has a ``Ledger`` with three limits: one
connection, all connections of one uid, and everyone together (DESIGN.md invariant
11). What does not fit is refused before anything is held, and whatever a connection
holds goes with it when it leaves.

Rules:
- A connection is known once it ``join``-ed with its uid; the daemon's own holders
  (tier promotions, checksum jobs) never join and are neither counted nor limited:
  their own budgets bound them.
- ``take`` is all or nothing; ``room`` says how much would fit now.
- ``leave`` drops the connection's holding at once and returns it (the caller
  released the things themselves).
- Pure bookkeeping on the loop thread: no locks, O(1) per call.
"""

from __future__ import annotations

from dataclasses import dataclass

UNLIMITED = 1 << 62


@dataclass(frozen=True)
class Limits:
    per_connection: int
    per_uid: int
    total: int

    @staticmethod
    def scaled(per_connection: int) -> Limits:
        """A uid may hold 4 connections' worth, everyone 16 (0: no limit)."""
        if per_connection <= 0:
            return Limits(UNLIMITED, UNLIMITED, UNLIMITED)
        return Limits(per_connection, 4 * per_connection, 16 * per_connection)


class Ledger:
    def __init__(self, what: str, limits: Limits) -> None:
        self.what = what
        self.limits = limits
        self.total = 0
        self.refused_total = 0
        self._held: dict[int, int] = {}  # connection -> what it holds
        self._uid_of: dict[int, int] = {}
        self._by_uid: dict[int, int] = {}

    def join(self, conn: int, uid: int) -> None:
        self._uid_of[conn] = uid
        self._held.setdefault(conn, 0)

    def leave(self, conn: int) -> int:
        held = self._held.pop(conn, 0)
        uid = self._uid_of.pop(conn, None)
        if uid is not None and held:
            self._drop_uid(uid, held)
            self.total -= held
        return held

    def held(self, conn: int) -> int:
        return self._held.get(conn, 0)

    def held_by_uid(self, uid: int) -> int:
        return self._by_uid.get(uid, 0)

    def room(self, conn: int) -> int:
        """How much more ``conn`` may take now."""
        uid = self._uid_of.get(conn)
        if uid is None:
            return UNLIMITED
        lim = self.limits
        return max(
            0,
            min(
                lim.per_connection - self._held[conn],
                lim.per_uid - self._by_uid.get(uid, 0),
                lim.total - self.total,
            ),
        )

    def take(self, conn: int, n: int) -> bool:
        """Hold ``n`` more for ``conn`` if all of it fits; False (nothing held) if not."""
        if n > self.room(conn):
            self.refused_total += 1
            return False
        self.add(conn, n)
        return True

    def add(self, conn: int, n: int) -> None:
        """Hold ``n`` more (the caller checked ``room``)."""
        uid = self._uid_of.get(conn)
        if uid is None or not n:
            return
        self._held[conn] += n
        self._by_uid[uid] = self._by_uid.get(uid, 0) + n
        self.total += n

    def give(self, conn: int, n: int) -> None:
        """``conn`` released ``n``."""
        uid = self._uid_of.get(conn)
        if uid is None or not n:
            return
        self._held[conn] -= n
        self._drop_uid(uid, n)
        self.total -= n

    def _drop_uid(self, uid: int, n: int) -> None:
        left = self._by_uid[uid] - n
        if left:
            self._by_uid[uid] = left
        else:
            del self._by_uid[uid]

"""Everything a peer makes the daemon hold, in one ledger: per connection, per uid, in total.

A client can make the daemon keep things for it: its connection and buffered bytes,
descriptors, imported caches and their mappings, workers, namespaces it opened or
joined, pins, leased slots, copy jobs, key snapshots, waits. Each kind is a *line* of
one ``Ledger`` (``LINES`` lists them all, with their defaults and meaning), limited
three ways: one connection, all connections of one uid, and everyone together
(DESIGN.md invariant 11).

Rules:
- Charged before held: ``take`` is all or nothing, across every line it names (a count
  and the metadata bytes that go with it); ``require`` raises ``QuotaExceededError``
  naming the line, who is over which limit, and the configuration key that sets it.
- Released when the peer leaves: ``leave`` drops every line of the connection at once
  (the caller released the things themselves) and returns what it held.
- Each line says what one unit costs the daemon's own memory (``heap_bytes_each``):
  ``heap_bytes`` is what peers make the daemon hold now, and ``worst_heap_bytes``
  what they could at most; the census test holds the daemon's /proc figures to them.
- The daemon's own holders (tier promotions, checksum jobs) never join: they are
  neither counted nor limited here, their own budgets bound them.
- A uid is a tenant: all connections of one uid share its limits (two tenants under
  one uid share one budget).
- Pure bookkeeping on the loop thread: no locks, O(1) per call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvoffload.datapath.canonical import MAX_JOB_COPIES
from kvoffload.protocol.errors import QuotaExceededError

UNLIMITED = 1 << 62
KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


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


@dataclass(frozen=True)
class LineSpec:
    """One kind of thing a peer can make the daemon hold."""

    name: str
    unit: str
    limits: Limits
    heap_bytes_each: int  # the daemon's own memory one unit costs (0: kernel memory only)
    meaning: str
    released: str


# Every line, with its default limits. A limit the service derives from the machine
# (the descriptor limit, the region's size) is filled in by ``derive``; the
# configuration's ``limits`` table overrides any of them.
# fmt: off
LINES: tuple[LineSpec, ...] = (
    LineSpec("connections", "connections", Limits(1, 256, 1024), 12 * KIB,
             "open connections (a socket, its session and protocol state)",
             "closing"),
    LineSpec("buffered_bytes", "bytes", Limits(48 * MIB, 128 * MIB, 256 * MIB), 1,
             "request bytes of frames not yet complete and reply bytes not yet sent",
             "read and sent; the largest holder is cut off past a limit"),
    LineSpec("descriptors", "descriptors", Limits(256, 1024, 4096), 0,
             "descriptors parked with SCM_RIGHTS and held for imported caches",
             "claimed by a message, or closed with the cache"),
    LineSpec("namespaces", "namespaces", Limits(64, 1024, 8192), 2 * KIB,
             "namespaces opened or joined (a feed cursor, a lease token, a mirror each)",
             "leaving the namespace or closing"),
    LineSpec("workers", "workers", Limits(64, 256, 2048), 4 * KIB,
             "attached workers (engine ranks registered for copies)",
             "DetachWorker, or closing, once their copies drained"),
    LineSpec("caches", "caches", Limits(1024, 8192, 65536), 2 * KIB,
             "caches registered by those workers (memfd, memfd_io, CUDA IPC imports)",
             "with their worker"),
    LineSpec("mappings", "mappings", Limits(1024, 4096, 16384), 256,
             "memory mappings of imported caches (caches over one file share one)",
             "with their worker"),
    LineSpec("mapped_bytes", "bytes", Limits(256 * GIB, 1 * TIB, 2 * TIB), 0,
             "bytes of engines' memory the daemon maps (only the rows caches claim; "
             "page tables of 1/512 of what copies touch)",
             "with their worker"),
    LineSpec("metadata_bytes", "bytes", Limits(32 * MIB, 64 * MIB, 512 * MIB), 1,
             "per-peer metadata in the daemon's heap: canonical fragment tables of "
             "workers, key snapshots (SyncKeys)",
             "with the worker; a snapshot when paged through, replaced or left"),
    LineSpec("pins", "pins", Limits(131072, 524288, 2097152), 320,
             "pins on blocks and graves (outstanding loads)",
             "unpin, pin_timeout_s, or closing (one step per key)"),
    LineSpec("leased_bytes", "bytes", Limits(UNLIMITED, UNLIMITED, UNLIMITED), 0,
             "region space leased empty to engines ahead of their stores, across "
             "namespaces (1/8 of the region per uid, 1/4 in all, unless configured)",
             "claimed, lease_timeout_s unused, or closing"),
    LineSpec("jobs", "jobs", Limits(4096, 16384, 65536), 1 * KIB,
             "copy jobs in flight, and finished results not yet taken (GetFinished)",
             "results taken or pushed; a leaver's copies drain charged to nobody"),
    LineSpec("copies", "copies", Limits.scaled(2 * MAX_JOB_COPIES), 0,
             "the copies those jobs expand to (built a piece at a time, off the loop)",
             "completion"),
    LineSpec("waits", "job ids", Limits(65536, 262144, 1048576), 96,
             "jobs named by WaitJobs requests still waiting (one per job a request waits "
             "for: what it holds, and what finishing those jobs walks)",
             "each job as it finishes, the worker detaches, or closing"),
)
# fmt: on
SPECS: dict[str, LineSpec] = {spec.name: spec for spec in LINES}
# Limits the service derives from the machine (service.Service._derived_limits), in words.
DERIVED: dict[str, tuple[str, str, str]] = {
    "connections": (
        "1",
        "a quarter of max_clients (at least 64)",
        "max_clients, within the descriptor limit",
    ),
    "descriptors": ("256", "a quarter of the descriptor budget", "what the fd limit leaves"),
    "leased_bytes": ("1/8 of the region", "1/8 of the region", "1/4 of the region"),
}


class Line:
    """One line of the ledger: what each connection, each uid and everyone holds."""

    def __init__(self, what: str, limits: Limits) -> None:
        self.what = what
        self.limits = limits
        self.total = 0
        self.peak_total = 0
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

    def uids(self) -> int:
        """How many uids hold something on this line."""
        return len(self._by_uid)

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

    def over(self, conn: int, n: int) -> str:
        """Which limit ``n`` more for ``conn`` would pass ("" if none)."""
        uid = self._uid_of.get(conn)
        if uid is None:
            return ""
        lim = self.limits
        if self._held[conn] + n > lim.per_connection:
            return f"one connection's {lim.per_connection}"
        if self._by_uid.get(uid, 0) + n > lim.per_uid:
            return f"uid {uid}'s {lim.per_uid}"
        if self.total + n > lim.total:
            return f"everyone's {lim.total}"
        return ""

    def excess(self, conn: int) -> str:
        """Which limit ``conn`` is over now, for what arrives before it can be refused
        (buffered bytes, parked descriptors): "connection", "uid", "total" or ""."""
        uid = self._uid_of.get(conn)
        if uid is None:
            return ""
        lim = self.limits
        if self._held[conn] > lim.per_connection:
            return "connection"
        if self._by_uid.get(uid, 0) > lim.per_uid:
            return "uid"
        return "total" if self.total > lim.total else ""

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
        self.peak_total = max(self.peak_total, self.total)

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


class Ledger:
    """Every line, joined and left together (see the module rules)."""

    def __init__(self, specs: Iterable[LineSpec] = LINES) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.lines = {name: Line(name, spec.limits) for name, spec in self.specs.items()}

    def __getitem__(self, what: str) -> Line:
        return self.lines[what]

    def join(self, conn: int, uid: int) -> None:
        for line in self.lines.values():
            line.join(conn, uid)

    def leave(self, conn: int) -> dict[str, int]:
        """Forget the connection; returns what it still held, line by line."""
        held = {name: line.leave(conn) for name, line in self.lines.items()}
        return {name: n for name, n in held.items() if n}

    def take(self, conn: int, amounts: Mapping[str, int]) -> str:
        """Hold every amount or none; returns "" or why not (the first line over)."""
        for what, n in amounts.items():
            line = self.lines[what]
            if n > line.room(conn):
                line.refused_total += 1
                return f"{what}: {n} more would pass {line.over(conn, n)}"
        for what, n in amounts.items():
            self.lines[what].add(conn, n)
        return ""

    def require(self, conn: int, amounts: Mapping[str, int], doing: str) -> None:
        """``take``, or raise QuotaExceededError saying what ``doing`` would pass."""
        why = self.take(conn, amounts)
        if why:
            what = why.split(":", 1)[0]
            raise QuotaExceededError(
                f"{doing}: {why} ({self.specs[what].meaning}); release some first, or "
                f"raise limits.{what} in the daemon config"
            )

    def give(self, conn: int, amounts: Mapping[str, int]) -> None:
        for what, n in amounts.items():
            self.lines[what].give(conn, n)

    def heap_bytes(self) -> int:
        """The daemon heap peers make it hold now (an upper bound, per ``LINES``)."""
        return sum(
            line.total * self.specs[name].heap_bytes_each for name, line in self.lines.items()
        )

    def worst_heap_bytes(self) -> int:
        """The most heap all peers together could make the daemon hold."""
        return sum(
            min(spec.limits.total, UNLIMITED // max(1, spec.heap_bytes_each)) * spec.heap_bytes_each
            for spec in self.specs.values()
            if spec.limits.total < UNLIMITED
        )

    def statistics(self) -> dict[str, dict[str, Any]]:
        return {
            name: {
                "total": line.total,
                "by_uid": {str(uid): n for uid, n in line._by_uid.items()},
                "peak_total": line.peak_total,
                "uids": line.uids(),
                "refused_total": line.refused_total,
                "limit_per_connection": line.limits.per_connection,
                "limit_per_uid": line.limits.per_uid,
                "limit_total": line.limits.total,
            }
            for name, line in self.lines.items()
        }


def configured(
    overrides: Mapping[str, Mapping[str, int]], derived: Mapping[str, Limits]
) -> list[LineSpec]:
    """``LINES`` with the limits the service derived from the machine, then those the
    configuration sets (a missing or 0 field keeps the default)."""
    out = []
    for spec in LINES:
        lim = derived.get(spec.name, spec.limits)
        o = overrides.get(spec.name, {})
        lim = Limits(
            o.get("per_connection") or lim.per_connection,
            o.get("per_uid") or lim.per_uid,
            o.get("total") or lim.total,
        )
        out.append(replace(spec, limits=lim))
    return out

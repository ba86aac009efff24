"""What the shared tiers (Redis, Mooncake Store) have in common: a view of a store that
other daemons change too, jobs whose results update it, and health.

Rules:
- The view (``(tier id, key) -> when it entered``) belongs to the loop thread; lookups
  answer from it without I/O. The tier's threads only post what they learned:
  ``job`` (a finished job and the entries the store evicted meanwhile), ``seen``
  (entries found present), ``gone`` (entries a full read found missing, with the time
  it started: entries newer than that stay) and ``health`` (reachable or not, and why).
- Everything a store tells about itself is bounded before the loop sees it: a post
  carries at most ``VIEW_CHUNK`` entries, one ``get_finished`` applies at most
  ``VIEW_ENTRIES_PER_TURN`` of them (the rest waits for the next turn, which the tier
  wakes), and the view holds at most ``max_view_blocks`` entries: beyond that the
  entries that entered longest ago leave it (they miss; the store keeps them).
- A full read is turned into ``seen`` and ``gone`` posts on the tier's thread, against
  a copy of the view: the loop only applies them. A full read cut short by its bounds
  removes nothing.
- A job's successful keys enter the view; a load that failed drops its keys (the
  store lost them: one miss, then no more lookups hit them until the store lists them
  again). A block refused by its seal (``refused``) is kept out of the view for
  ``REFUSED_HOLD_S`` whatever the store lists, so a planted block costs one transfer
  a minute at most, not one per lookup; a good block of that key written or read
  here ends the hold.
- Blocks carry a seal (blockauth.py), checked on the way back.
- An unreachable store makes every lookup miss; the region is not affected. The first
  change of health is logged once, as is the recovery.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from kvoffloadd.tiers.base import SecondaryTier, TierJob, TierNamespace, TierResult

log = logging.getLogger(__name__)

Entry = tuple[str, bytes]  # (tier id, key)
VIEW_CHUNK = 4096  # entries per post from a tier thread
VIEW_ENTRIES_PER_TURN = 8192  # entries one get_finished applies; the rest next turn
MAX_VIEW_BLOCKS = 262_144  # default cap of the view (about 250 B an entry)
REFUSED_HOLD_S = 60.0  # a block refused by its seal is not looked for again this long
MAX_REFUSED = 65_536  # entries remembered as refused (the oldest are forgotten)


class RemoteTier(SecondaryTier):
    """Base of the tiers behind a server; ``endpoint`` names the server in logs."""

    def __init__(
        self,
        name: str,
        endpoint: str,
        capacity_bytes: int,
        wake: Any,
        max_view_blocks: int = MAX_VIEW_BLOCKS,
        tier_threads: int = 1,
    ) -> None:
        super().__init__(name, capacity_bytes, wake, tier_threads)
        self.endpoint = endpoint
        self._view: OrderedDict[Entry, float] = OrderedDict()
        self.max_view_blocks = max_view_blocks
        self.view_evicted_total = 0  # entries that left the view for its cap
        self._refused: OrderedDict[Entry, float] = OrderedDict()  # entry -> held until
        self._jobs: dict[int, tuple[bool, list[Entry]]] = {}
        self.last_error = ""
        self.used_bytes = 0  # the shared total, as last polled
        # read by the tier's threads; replaced (never mutated) by the loop thread
        self._tier_ids: frozenset[str] = frozenset()

    # ------------------------------------------------------------ loop thread

    def open_namespace(self, ns: TierNamespace) -> None:
        self._tier_ids = self._tier_ids | {sys.intern(ns.tier_id)}
        self.namespace_added()

    def namespace_added(self) -> None:
        """A new tier id to follow (the view should be re-read soon)."""

    def lookup(self, ns: TierNamespace, keys: Sequence[bytes]) -> list[bool]:
        if not self.healthy:
            return [False] * len(keys)
        view, tid = self._view, ns.tier_id
        return [(tid, k) in view for k in keys]

    def track(self, job: TierJob, store: bool) -> list[Entry]:
        """Remember a job the loop hands to the threads; its entries, for them."""
        entries = [(job.ns.tier_id, k) for k in job.keys]
        self._jobs[job.job_id] = (store, entries)
        return entries

    def get_finished(self) -> list[TierResult]:
        out = []
        now = time.monotonic()
        budget = VIEW_ENTRIES_PER_TURN
        while budget > 0 and (posted := self.finished.next()) is not None:
            kind, item = posted
            if kind == "job":
                result, gone = item
                store, entries = self._jobs.pop(result.job_id)
                self.counters.count(store, result)
                self.counters.evicted_blocks_total += len(gone)
                for e, ok in zip(entries, result.ok):
                    if ok:
                        self._refused.pop(e, None)
                        self._view.pop(e, None)
                        self._admit(e, now)
                    elif not store:
                        self._view.pop(e, None)
                for e in gone:
                    self._view.pop(e, None)
                budget -= len(entries) + len(gone)
                out.append(result)
            elif kind == "seen":
                refused = self._refused
                for e in item:
                    if e not in self._view and refused.get(e, 0.0) <= now:
                        self._admit(e, now)
                budget -= len(item)
            elif kind == "refused":
                for e in item:
                    self._view.pop(e, None)
                    self._refused.pop(e, None)
                    self._refused[e] = now + REFUSED_HOLD_S
                    if len(self._refused) > MAX_REFUSED:
                        self._refused.popitem(last=False)
                budget -= len(item)
            elif kind == "gone":
                started_s, entries = item  # entries that entered since the read stay
                for e in entries:
                    if self._view.get(e, started_s) < started_s:
                        del self._view[e]
                budget -= len(entries)
            elif kind == "health":
                self._apply_health(*item)
        if self.finished.pending():
            self.finished.rewake()  # the rest next turn: the loop serves others first
        return out

    def _admit(self, e: Entry, now: float) -> None:
        view = self._view
        while len(view) >= self.max_view_blocks:
            view.popitem(last=False)
            self.view_evicted_total += 1
        view[e] = now

    def _apply_health(self, up: bool, why: str, used: int) -> None:
        # a change, or a new reason not to connect (a tier that never came up says why)
        if up != self.healthy or (not up and why and why != self.last_error):
            log.log(
                logging.INFO if up else logging.WARNING,
                "tier %s: %s",
                self.name,
                f"reachable at {self.endpoint}" if up else f"unreachable: {why}",
            )
        self.healthy, self.used_bytes = up, used if up else self.used_bytes
        self.last_error = why or self.last_error

    def remote_statistics(self, **extra: Any) -> dict[str, Any]:
        out = self.base_statistics(len(self._view), self.used_bytes, self.healthy)
        out.update(
            extra,
            last_error=self.last_error,
            max_view_blocks=self.max_view_blocks,
            view_evicted_total=self.view_evicted_total,
        )
        return out

    # ------------------------------------------------------------ tier threads

    def post_unreachable(self, why: str) -> None:
        self.finished.post("health", (False, why, 0))

    def post_refused(self, entries: list[Entry]) -> None:
        """Blocks a load refused by their seal (before its job result is posted)."""
        if entries:
            self.finished.post("refused", entries)

    def post_seen(self, entries: Iterable[Entry]) -> None:
        """Entries found present, in posts of at most ``VIEW_CHUNK``."""
        chunk: list[Entry] = []
        for e in entries:
            chunk.append(e)
            if len(chunk) == VIEW_CHUNK:
                self.finished.post("seen", chunk)
                chunk = []
        if chunk:
            self.finished.post("seen", chunk)

    def post_full(self, started_s: float, present: set[Entry], complete: bool) -> None:
        """A full read of the store that began at ``started_s``: what it found enters
        the view; if it read everything, entries it did not find leave (unless they
        entered after it began)."""
        view = list(self._view.items())  # one step under the GIL: a copy of the loop's view
        known = {e for e, _ in view}
        self.post_seen(e for e in present if e not in known)
        if not complete:
            return
        stale = [e for e, t in view if t < started_s and e not in present]
        for a in range(0, len(stale), VIEW_CHUNK):
            self.finished.post("gone", (started_s, stale[a : a + VIEW_CHUNK]))

    def ours(self, tier_id: str) -> str | None:
        """The interned tier id of a namespace opened here, or None."""
        ids = self._tier_ids
        if tier_id not in ids:
            return None
        return sys.intern(tier_id)

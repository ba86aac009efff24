"""What the shared tiers (Redis, Mooncake Store) have in common: a view of a store that
other daemons change too, jobs whose results update it, and health.

Rules:
- The view (``(tier id, key) -> when it entered``) belongs to the loop thread; lookups
  answer from it without I/O. The tier's threads only post what they learned:
  ``job`` (a finished job and the entries the store evicted meanwhile), ``seen``
  (entries found present), ``full`` (every entry present when a full read started:
  older entries missing from it leave) and ``health`` (reachable or not, and why).
- A job's successful keys enter the view; a load that failed drops its keys (the
  store lost them: one miss, then no more lookups hit them).
- Blocks carry their CRC-32 (``crc.crc32``) in their header, checked on the way back.
- An unreachable store makes every lookup miss; the region is not affected. The first
  change of health is logged once, as is the recovery.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from .base import SecondaryTier, TierJob, TierNamespace, TierResult

log = logging.getLogger(__name__)

Entry = tuple[str, bytes]  # (tier id, key)


class RemoteTier(SecondaryTier):
    """Base of the tiers behind a server; ``endpoint`` names the server in logs."""

    def __init__(self, name: str, endpoint: str, capacity_bytes: int, wake: Any) -> None:
        super().__init__(name, capacity_bytes, wake)
        self.endpoint = endpoint
        self._view: dict[Entry, float] = {}
        self._jobs: dict[int, tuple[bool, list[Entry]]] = {}
        self.last_error = ""
        self.used_bytes = 0  # the shared total, as last polled
        # read by the tier's threads; replaced (never mutated) by the loop thread
        self._tier_ids: frozenset[str] = frozenset()

    # ------------------------------------------------------------ loop thread

    def open_namespace(self, ns: TierNamespace) -> None:
        self._tier_ids = self._tier_ids | {ns.tier_id}
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
        for kind, item in self.finished.take():
            if kind == "job":
                result, gone = item
                store, entries = self._jobs.pop(result.job_id)
                self.counters.count(store, result)
                self.counters.evicted_blocks_total += len(gone)
                for e, ok in zip(entries, result.ok):
                    if ok:
                        self._view[e] = now
                    elif not store:
                        self._view.pop(e, None)
                for e in gone:
                    self._view.pop(e, None)
                out.append(result)
            elif kind == "seen":
                for e in item:
                    self._view.setdefault(e, now)
            elif kind == "full":
                started_s, present = item  # entries newer than the read are kept
                stale = [e for e, t in self._view.items() if t < started_s and e not in present]
                for e in stale:
                    del self._view[e]
                for e in present:
                    self._view.setdefault(e, now)
            elif kind == "health":
                self._apply_health(*item)
        return out

    def _apply_health(self, up: bool, why: str, used: int) -> None:
        if up != self.healthy:
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
        out.update(extra, last_error=self.last_error)
        return out

    # ------------------------------------------------------------ tier threads

    def post_unreachable(self, why: str) -> None:
        self.finished.post("health", (False, why, 0))

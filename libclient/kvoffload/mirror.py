"""A client-side mirror of one namespace's keys, for lookups without a round trip.

vLLM asks ``lookup`` one key at a time, thousands of times per scheduler step; a
socket round trip per key would cost more than the offload saves. The mirror answers
from local sets instead and is kept current by the daemon's per-connection event feed.

Rules:
- State comes from the daemon only: a key snapshot (``sync_keys``) and then the
  events that followed it (``read_feed``), applied in order. Local updates from this
  engine's own calls (a plan's evicted keys, its completions) are applied early; the
  feed confirms them later, so applying it again is harmless.
- ``refresh`` reads the feed; it runs at most every ``max_age_s`` when lookups come
  in (and whenever the caller wants, e.g. once per scheduler step). A feed with a gap
  (the daemon dropped events), a reconnect, or the first use triggers a full
  snapshot instead.
- A lost daemon makes the mirror unusable: lookups answer RETRY for ``retry_s`` (the
  client is reconnecting, the engine should ask again), then MISS, so an engine never
  waits on a cache that is down (DESIGN.md invariant 7).
- A HIT must hold until ``prepare_load``, although another engine may evict the block
  in between (the mirror is up to ``max_age_s`` behind). The daemon keeps an evicted
  block loadable until every mirror has read past its eviction, or for its
  ``mirror_grace_s`` (kvoffloadd.graves); only a ``prepare_load`` later than that
  fails.
- Not thread-safe: the owner serialises calls (vLLM holds ``manager.lock``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from enum import IntEnum

from .client import Namespace
from .plans import OffloadEvent
from .protocol.errors import DaemonUnavailableError

log = logging.getLogger(__name__)


class KeyState(IntEnum):
    MISS = 0
    HIT = 1  # stored and ready
    HIT_PENDING = 2  # being stored by this engine
    RETRY = 3  # the daemon is unreachable for now: ask again later


class KeyMirror:
    def __init__(
        self,
        ns: Namespace,
        max_age_s: float = 0.05,
        retry_s: float = 5.0,
        keep_events: bool = False,
    ) -> None:
        self.ns = ns
        self.max_age_s = max_age_s
        self.retry_s = retry_s
        self.keep_events = keep_events
        self._ready: set[bytes] = set()
        self._writing: set[bytes] = set()
        self._epoch = -1  # client epoch the snapshot belongs to; -1: none yet
        self._synced_s = float("-inf")
        self._lost_since_s: float | None = None
        self.events: list[tuple[list[bytes], bool]] = []  # (keys, removed) for take_events
        self.snapshots_total = 0

    def lookup(self, key: bytes) -> KeyState:
        if time.monotonic() - self._synced_s > self.max_age_s:
            self.refresh()
        if self._lost_since_s is not None:
            if key in self._writing:
                return KeyState.HIT_PENDING
            recent = time.monotonic() - self._lost_since_s < self.retry_s
            return KeyState.RETRY if recent else KeyState.MISS
        if key in self._ready:
            return KeyState.HIT
        if key in self._writing:
            return KeyState.HIT_PENDING
        return KeyState.MISS

    def refresh(self) -> None:
        """Bring the mirror up to date with the daemon (one or more round trips)."""
        now = time.monotonic()
        self._synced_s = now
        try:
            if self._epoch != self.ns.client.epoch or self._lost_since_s is not None:
                self._snapshot()
            else:
                events, lost = self.ns.read_feed()
                if lost or self._epoch != self.ns.client.epoch:
                    log.info("namespace %s: event feed had a gap; resyncing keys", self.ns.name)
                    self._snapshot()
                else:
                    self._apply(events)
        except DaemonUnavailableError as exc:
            if self._lost_since_s is None:
                log.warning(
                    "namespace %s: lookups degrade while kvoffloadd is away: %s", self.ns.name, exc
                )
                self._lost_since_s = now
                # kept for the diff a later snapshot reports, but never answered from

    def _snapshot(self) -> None:
        new = set(self.ns.sync_keys())  # raises DaemonUnavailableError
        if self.keep_events:  # what changed unseen, so event consumers stay exact
            if gone := self._ready - new:
                self.events.append((list(gone), True))
            if came := new - self._ready:
                self.events.append((list(came), False))
        self._epoch = self.ns.client.epoch
        self._ready = new
        self._lost_since_s = None
        self.snapshots_total += 1

    def _apply(self, events: Sequence[OffloadEvent]) -> None:
        ready = self._ready
        for e in events:
            keys, removed = e.keys, e.removed
            if removed:
                ready.difference_update(keys)
            else:
                ready.update(keys)
            if self.keep_events:
                self.events.append((keys, removed))

    # -------------------------------------------------- this engine's own calls

    def stores_prepared(self, keys: Sequence[bytes], evicted: Sequence[bytes]) -> None:
        self._ready.difference_update(evicted)
        self._writing.update(keys)

    def stores_completed(self, keys: Sequence[bytes], success: bool) -> None:
        mine = [k for k in keys if k in self._writing]
        self._writing.difference_update(mine)
        if success and self._lost_since_s is None:
            self._ready.update(mine)

    def clear(self) -> None:
        self._ready.clear()
        self._writing.clear()
        self._epoch = -1
        self._synced_s = float("-inf")

"""The secondary-tier interface: what the daemon's loop asks of a disk, Redis or
Mooncake tier.

Rules:
- The loop thread calls every method. ``lookup`` answers from the tier's own view of
  what it holds, in memory: it never waits on a disk or a network.
- ``submit_store`` and ``submit_load`` queue a job and return at once; the tier's
  threads move the bytes between the job's buffers (region slots the loop keeps
  pinned until the job finishes) and the tier. A finished job wakes the loop through
  ``wake`` and is collected by ``get_finished``, which is also where a tier applies
  what its threads learned (scans, refreshes) to its view: its metadata changes on
  the loop thread only.
- A load's blocks are copied into their slots and their MACs verified on the tier's
  promotion threads (``tier_threads``, spread.py), apart from its I/O threads.
- Results are per key: one bad block does not fail the others of its job. A tier
  never raises into the loop for an I/O problem; it reports failed keys and counts them.
- A block is written once: storing a key the tier already holds succeeds without a write.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffloadd.tiers.spread import JobThreads, TierThreads, join_all

log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 10.0  # what closing a tier waits for its threads, all of them together


@dataclass(frozen=True)
class TierNamespace:
    """A namespace as tiers see it. ``tier_id`` names it in every tier and on every
    node: two daemons with the same namespace name and layout share its blocks."""

    tier_id: str
    name: str
    fingerprint: str
    block_bytes: int

    @staticmethod
    def of(name: str, fingerprint: str, block_bytes: int) -> TierNamespace:
        digest = hashlib.sha256(f"{name}\0{fingerprint}".encode()).hexdigest()[:32]
        return TierNamespace(digest, name, fingerprint, block_bytes)


@dataclass
class TierJob:
    """Blocks to move between region slots and one tier.

    ``buffers[i]`` is the region memory of ``keys[i]`` (``block_bytes`` long): read
    from for a store, written into for a load. ``addresses[i]`` is where that memory
    is, for tiers that copy through registered memory (``attach_region``).
    """

    job_id: int
    ns: TierNamespace
    keys: list[bytes]
    buffers: list[memoryview]
    addresses: list[int] = field(default_factory=list)
    started_s: float = field(default_factory=time.perf_counter)

    def result(self, ok: list[bool], nbytes: int) -> TierResult:
        return TierResult(self.job_id, ok, nbytes, time.perf_counter() - self.started_s)


@dataclass(frozen=True)
class TierResult:
    job_id: int
    ok: list[bool]  # per key of the job
    nbytes: int  # bytes moved successfully
    seconds: float


@dataclass
class TierCounters:
    """What every tier counts; ``statistics`` adds the tier's own fields."""

    stores_total: int = 0  # blocks written
    store_failures_total: int = 0
    loads_total: int = 0  # blocks read
    load_failures_total: int = 0
    evicted_blocks_total: int = 0
    stored_bytes_total: int = 0
    loaded_bytes_total: int = 0
    load_seconds_total: float = 0.0

    def count(self, store: bool, result: TierResult) -> None:
        good = sum(result.ok)
        bad = len(result.ok) - good
        if store:
            self.stores_total += good
            self.store_failures_total += bad
            self.stored_bytes_total += result.nbytes
        else:
            self.loads_total += good
            self.load_failures_total += bad
            self.loaded_bytes_total += result.nbytes
            self.load_seconds_total += result.seconds


AUTH_REASONS = ("other_secret", "bad_mac", "unauthenticated", "bad_seal")


def auth_statistics(counts: dict[str, int]) -> dict[str, int]:
    """Blocks refused by their seal (blockauth.py), per reason and in all."""
    out = {f"auth_{r}_total": counts.get(r, 0) for r in AUTH_REASONS}
    out["auth_failures_total"] = sum(counts.values())
    return out


class TierError(Exception):
    """A tier that cannot start: bad configuration, unreachable directory."""


class Finished:
    """Results and view updates from a tier's threads, handed to the loop thread."""

    def __init__(self, wake: Any) -> None:
        self._wake = wake
        self._items: deque[tuple[str, Any]] = deque()

    def post(self, kind: str, item: Any) -> None:
        self._items.append((kind, item))
        self._wake()

    def take(self) -> list[tuple[str, Any]]:
        out = []
        while self._items:
            out.append(self._items.popleft())
        return out

    def next(self) -> tuple[str, Any] | None:
        """The oldest item, or None (the loop may stop early and ``rewake``)."""
        return self._items.popleft() if self._items else None

    def pending(self) -> bool:
        return bool(self._items)

    def rewake(self) -> None:
        self._wake()


class SecondaryTier(ABC):
    """One secondary tier. ``name`` is its config name, ``kind`` its type."""

    kind = ""
    promotion_jobs = 1  # jobs it runs at once (a disk tier: one, spread over tier_threads)

    def __init__(self, name: str, capacity_bytes: int, wake: Any, tier_threads: int = 1) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes  # 0: bounded by the store itself
        self.tier_threads = TierThreads(tier_threads, name)  # a promotion's blocks spread
        self.finished = Finished(wake)
        self.counters = TierCounters()
        self.healthy = True  # False: unreachable for now; lookups miss, cascades are skipped
        self.seals: Any = None  # blockauth.SealCheck of tiers that seal their blocks

    def open_namespace(self, ns: TierNamespace) -> None:  # noqa: B027 - optional hook
        """A namespace opened on this daemon; its blocks may be asked for from now on."""

    def attach_region(self, address: int, nbytes: int) -> None:  # noqa: B027 - optional hook
        """The region every job's buffers lie in (called once, before any job): a tier
        that moves bytes without copies registers it with its transport."""

    @abstractmethod
    def lookup(self, ns: TierNamespace, keys: Sequence[bytes]) -> list[bool]:
        """Per key: does this tier hold it (from its view, without I/O)?"""

    @abstractmethod
    def submit_store(self, job: TierJob) -> None: ...

    @abstractmethod
    def submit_load(self, job: TierJob) -> None: ...

    @abstractmethod
    def get_finished(self) -> list[TierResult]:
        """Finished jobs, after applying them to the tier's view."""

    @abstractmethod
    def statistics(self) -> dict[str, Any]: ...

    @abstractmethod
    def close(self) -> None:
        """Stop the threads; jobs still queued fail."""

    def stop_threads(self, jobs: JobThreads, others: Sequence[threading.Thread]) -> bool:
        """Close the tier's job and promotion threads and wait for its ``others``
        (poller, scanner), all within ``CLOSE_TIMEOUT_S``; whether every one stopped
        (one stuck in I/O is left behind, with what it may still use)."""
        deadline_s = time.monotonic() + CLOSE_TIMEOUT_S

        def left_s() -> float:
            return max(0.0, deadline_s - time.monotonic())

        closed = [jobs.close(left_s()), self.tier_threads.close(left_s())]  # both, always
        stopped = join_all(others, left_s()) and all(closed)
        if not stopped:
            log.error("tier %s: a thread is stuck in I/O; stopping without it", self.name)
        return stopped

    def base_statistics(self, blocks: int, used_bytes: int, healthy: bool) -> dict[str, Any]:
        c = self.counters
        return {
            "kind": self.kind,
            "healthy": healthy,
            "capacity_bytes": self.capacity_bytes,
            "tier_threads": self.tier_threads.count,
            "blocks": blocks,
            "used_bytes": used_bytes,
            "stores_total": c.stores_total,
            "store_failures_total": c.store_failures_total,
            "loads_total": c.loads_total,
            "load_failures_total": c.load_failures_total,
            "evicted_blocks_total": c.evicted_blocks_total,
            "stored_bytes_total": c.stored_bytes_total,
            "loaded_bytes_total": c.loaded_bytes_total,
            "load_seconds_total": round(c.load_seconds_total, 6),
            **(self.seals.statistics() if self.seals is not None else auth_statistics({})),
        }


class WakeFd:
    """An eventfd the tiers' threads write to wake the loop."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def __call__(self) -> None:
        fd = self.fd
        if fd >= 0:  # tiers stop their threads before the loop closes this
            os.eventfd_write(fd, 1)

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        os.close(fd)

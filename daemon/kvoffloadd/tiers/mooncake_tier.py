"""Mooncake Store tier: blocks in a Mooncake Store cluster that daemons on many nodes share.

Rules:
- Objects: one per block, named ``<prefix>/<tier id>/<key hex>``. Tier ids come from the
  namespace name and layout fingerprint, so only daemons serving the same namespace
  share its blocks. An object is the block followed by a 64-byte header holding its
  seal (blockauth.py: magic, key id, length, keyed MAC); both are moved by Mooncake's
  transfer engine straight between the store and the region slot (the region is
  registered with ``register_buffer``) and a registered header area, so no block
  passes through a Python object. A block is loaded only if its seal verifies over
  the bytes in the slot: the store, the master's replica descriptors and other nodes'
  objects are data, never trusted.
- The daemon mounts a segment of ``segment_size`` bytes into the cluster (its share of
  the store's memory; 0: it only reads and writes others' segments) and writes it once
  at start. Mooncake places, replicates, leases and evicts the blocks; the daemon never
  removes one. Blocks that lie in this segment are copied into the region by the
  tier's promotion threads (``tier_threads``, ``mooncake_local``), others by Mooncake's
  transfer engine and then verified on the promotion threads.
- View: a block the daemon wrote or read is in it; a lookup that misses queues the key
  for an existence check (``batch_is_exist``) by the poller, so a block another daemon
  wrote hits from the next probe on. Every ``full_sync_s`` the poller re-reads what the
  store holds (the master's ``/get_all_keys`` when ``admin_url`` is set, else an
  existence check of the view): blocks Mooncake evicted, or lost with a node or a
  master restart, leave. A block gone before that fails one load and leaves. The
  listing is read within bounds of lines, bytes and time and takes at most
  ``max_view_blocks`` of ours (mooncake_listing.py: a listing cut short removes
  nothing), and the view is capped (remote.py).
- Failure: an unreachable master marks the tier unhealthy (lookups miss, jobs fail)
  until ``health_check`` passes again; Mooncake's client re-mounts its segment itself.
  A new client is set up only once the master's ports answer: Mooncake's ``setup``
  holds the GIL while it waits (the daemon's loop would stop with it).
  A transfer that failed in a way that may leave I/O in flight (anything but a
  rejection before the transfer) holds its job's slots for ``timeout_s`` more before
  the job is reported, so no late write lands in a reused slot.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvoffloadd.tiers.base import TierError, TierJob, TierNamespace
from kvoffloadd.tiers.blockauth import SEAL, BlockMac, SealCheck
from kvoffloadd.tiers.mooncake_listing import MAX_LISTING_LINES, reachable, read_listing
from kvoffloadd.tiers.mooncake_local import (
    WARM_CHUNK_BYTES,
    OwnSegmentRead,
    Span,
    object_sizes,
    read_own_segment,
    warm_segment,
)
from kvoffloadd.tiers.remote import MAX_VIEW_BLOCKS, Entry, RemoteTier
from kvoffloadd.tiers.spread import JobThreads

log = logging.getLogger(__name__)

MAGIC = b"KVOMC003"  # a blockauth seal in the header (KVOMC002: a CRC-32, refused)
HEADER_BYTES = 64  # one slot of the header area per key: the seal, then zeros
MAX_JOB_KEYS = 256  # header slots per job thread; longer jobs go in pieces
EXIST_BATCH = 4096  # keys per existence check
MAX_WANTED = 65_536  # misses queued for an existence check

# Mooncake's ErrorCode values (mooncake-store types.h) that reject a transfer before
# any byte moves: the slots are safe to reuse at once.
OBJECT_NOT_FOUND = -704
# NO_AVAILABLE_HANDLE, INVALID_PARAMS, REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND,
# OBJECT_ALREADY_EXISTS, OBJECT_HAS_LEASE, LEASE_EXPIRED (checked after the copy),
# RPC_FAIL, RPC_TIMEOUT (the master's answer, before any transfer), TENANT_QUOTA_EXCEEDED.
_SAFE_REJECTIONS = frozenset({-200, -600, -703, -704, -705, -706, -707, -900, -901, -1700})
RPC_FAIL = -900


@dataclass(frozen=True)
class MooncakeSettings:
    """A ``[[tiers]]`` entry of type ``mooncake``, as the tier uses it."""

    master: str  # host:port of mooncake_master's RPC service
    metadata_server: str  # http://host:port/metadata, or an etcd address
    local_hostname: str = "127.0.0.1"  # address other nodes reach this one at
    protocol: str = "tcp"  # or "rdma"
    device: str = ""  # RDMA device names (protocol rdma)
    segment_bytes: int = 512 << 20  # memory this daemon lends the store
    local_buffer_bytes: int = 16 << 20  # Mooncake's own staging buffer
    prefix: str = "kvoffload"
    admin_url: str = ""  # http://host:port of the master's admin server (optional)
    timeout_s: float = 2.0
    refresh_s: float = 0.2
    full_sync_s: float = 10.0
    threads: int = 4
    tier_threads: int = 1  # promotion threads: own-segment copies and MAC checks
    lease_ttl_s: float = 10.0  # the master's -default_kv_lease_ttl (0: no own-segment reads)
    max_view_blocks: int = MAX_VIEW_BLOCKS


def _load_client_class() -> Any:
    """Mooncake's client class; ``TierError`` naming what is missing."""
    # Mooncake's own log: errors only (its INFO lines would flood the daemon's log).
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    # setup() holds the GIL while it tries: 90 s against an absent master with the
    # default retries, 4 s with one. The poller calls it only once the master answers.
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise TierError(
            "the mooncake tier needs Mooncake's client (pip install 'kvoffload[mooncake]') "
            f"and its libraries (libibverbs1, librdmacm1, libnuma1): {exc}"
        ) from exc
    return MooncakeDistributedStore


class MooncakeTier(RemoteTier):
    kind = "mooncake"

    def __init__(
        self,
        name: str,
        settings: MooncakeSettings,
        capacity_bytes: int,
        wake: Any,
        *,
        mac: BlockMac,
        client_class: Any = None,  # Mooncake's MooncakeDistributedStore unless given
    ) -> None:
        cls = client_class or _load_client_class()  # before any thread starts
        super().__init__(
            name,
            settings.master,
            capacity_bytes,
            wake,
            settings.max_view_blocks,
            settings.tier_threads,
        )
        self.seals = SealCheck(mac, name, MAGIC)
        self._cls = cls
        self.s = settings
        self.healthy = False  # until the poller has connected (and written the segment)
        self._region: tuple[int, int] | None = None
        # One header area per job thread, registered with every client.
        self._headers = np.zeros((settings.threads, MAX_JOB_KEYS * HEADER_BYTES), np.uint8)
        self._zeros = np.zeros(WARM_CHUNK_BYTES, np.uint8)  # the segment's first writes
        self._slot_of_thread: dict[int, int] = {}
        self._client: Any = None  # replaced by the poller only
        self._poisoned: list[Any] = []  # clients a transfer may still use: kept alive
        self._lock = threading.Lock()
        self._own_reads_total = 0  # blocks promoted from this daemon's own segment
        # Did most blocks of the latest load lie in the own segment (promotion_jobs)?
        self._own_last = settings.lease_ttl_s > 0 and settings.segment_bytes > 0
        self._spans: dict[int, Span] = {}  # id(client) -> its own segment (poller writes)
        self._listing_cut_logged = False
        self._wanted: dict[Entry, None] = {}  # loop thread fills, poller swaps out
        self._stop = threading.Event()
        self._want_full = threading.Event()
        self._pool = JobThreads(settings.threads, name)
        self._poller = threading.Thread(target=self._poll, name=f"kvoffload-{name}-poll")
        self._poller.daemon = True

    # ------------------------------------------------------------ loop thread

    @property
    def promotion_jobs(self) -> int:  # type: ignore[override]
        """Jobs a lookup's keys are split into. While loads find their blocks in this
        daemon's own segment, one: its blocks spread over the promotion threads, and a
        job per job thread would only ask the master more often, CPU the copies need.
        Otherwise one per job thread: Mooncake copies a job's batch on one thread."""
        return 1 if self._own_last else self.s.threads

    def attach_region(self, address: int, nbytes: int) -> None:
        self._region = (address, nbytes)
        self._poller.start()  # connects, registers the region, follows the store

    def namespace_added(self) -> None:
        self._want_full.set()

    def lookup(self, ns: TierNamespace, keys: Sequence[bytes]) -> list[bool]:
        found = super().lookup(ns, keys)
        # Misses are checked against the store by the poller (a lost race with its
        # swap only loses a check: the next miss queues the key again).
        if self.healthy and len(self._wanted) < MAX_WANTED:
            tid = ns.tier_id
            self._wanted.update(((tid, k), None) for k, f in zip(keys, found) if not f)
        return found

    def submit_store(self, job: TierJob) -> None:
        self._pool.submit(self._run, job, self.track(job, True), True)

    def submit_load(self, job: TierJob) -> None:
        self._pool.submit(self._run, job, self.track(job, False), False)

    def statistics(self) -> dict[str, Any]:
        return self.remote_statistics(
            master=self.s.master,
            protocol=self.s.protocol,
            poisoned_clients=len(self._poisoned),
            own_segment_reads_total=self._own_reads_total,
        )

    def close(self) -> None:
        self._stop.set()
        self._want_full.set()
        if not self.stop_threads(self._pool, [self._poller]):
            return  # closing a client a thread still uses would crash the daemon
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # ------------------------------------------------------------ job threads

    def object_name(self, e: Entry) -> str:
        return f"{self.s.prefix}/{e[0]}/{e[1].hex()}"

    def _header_area(self) -> int:
        """This thread's header area (each pool thread gets one for its life)."""
        me = threading.get_ident()
        with self._lock:
            slot = self._slot_of_thread.setdefault(me, len(self._slot_of_thread))
        return int(self._headers[slot].ctypes.data)

    def _run(self, job: TierJob, entries: list[Entry], store: bool) -> None:
        ok = [False] * len(entries)
        hold_s = 0.0
        client = self._client
        try:
            if client is None or not self.healthy:
                raise ConnectionError(self.last_error or f"not connected to {self.endpoint}")
            for a in range(0, len(entries), MAX_JOB_KEYS):
                part = range(a, min(a + MAX_JOB_KEYS, len(entries)))
                codes = self._move(client, job, entries, part, store)
                for i, code in zip(part, codes):
                    ok[i] = code == 0
                    if code < 0 and code not in _SAFE_REJECTIONS:
                        hold_s = self.s.timeout_s  # I/O may still be running
                    if code == RPC_FAIL:
                        self.post_unreachable(f"Mooncake RPC failed (code {code})")
        except ConnectionError as exc:
            log.debug("tier %s: job %d not run: %s", self.name, job.job_id, exc)
        except Exception as exc:  # a tier fault stays inside the tier
            log.warning("tier %s: a %s failed: %r", self.name, "store" if store else "load", exc)
            hold_s = self.s.timeout_s
        if hold_s:
            self._poison(client, hold_s)
        done = sum(len(b) for b, good in zip(job.buffers, ok) if good)
        result = job.result(ok, done)
        if hold_s:
            threading.Timer(hold_s, self.finished.post, ("job", (result, []))).start()
        else:
            self.finished.post("job", (result, []))

    def _move(
        self, client: Any, job: TierJob, entries: list[Entry], part: range, store: bool
    ) -> list[int]:
        """One piece of a job; per key 0 (done) or Mooncake's negative code."""
        n = job.ns.block_bytes
        hdr = self._header_area()
        names = [self.object_name(entries[i]) for i in part]
        ptrs = [[job.addresses[i], hdr + j * HEADER_BYTES] for j, i in enumerate(part)]
        sizes = [[n, HEADER_BYTES]] * len(part)
        view = memoryview(self._headers.reshape(-1).data)  # header bytes, all threads
        base = hdr - int(self._headers.ctypes.data)
        if store:
            for j, i in enumerate(part):
                at = base + j * HEADER_BYTES
                view[at : at + SEAL.size] = self.seals.seal(job.ns, job.keys[i], job.buffers[i])
            return [min(c, 0) for c in client.batch_put_from_multi_buffers(names, ptrs, sizes)]
        # a short object leaves no seal of an earlier job behind
        view[base : base + len(part) * HEADER_BYTES] = bytes(len(part) * HEADER_BYTES)
        own = self._read_own_segment(client, job, names, part, hdr)
        counts = dict.fromkeys(own.tags, n + HEADER_BYTES)
        # An object of another size is no block of ours: refused before any transfer
        # (Mooncake fails a transfer into buffers of another size mid-way).
        answer = own.answer if own.answer is not None else client.batch_get_replica_desc(names)
        rest, misfits = [], set()
        for j in own.rest:
            found = object_sizes(answer.get(names[j]))
            (misfits.add(j) if found and n + HEADER_BYTES not in found else rest.append(j))
        if rest:
            got = client.batch_get_into_multi_buffers(
                [names[j] for j in rest], [ptrs[j] for j in rest], [sizes[j] for j in rest]
            )
            counts.update(zip(rest, got))
        refused: list[Entry] = []  # appended to by the promotion threads

        def check(j: int) -> int:
            """Block ``j`` of the piece verified in its slot: 0, or a rejection."""
            i = part[j]
            if j in misfits:  # a rejection before any transfer: the slot was never written
                self.seals.refuse("bad_seal", names[j])
                refused.append(entries[i])
                return OBJECT_NOT_FOUND
            count = counts[j]
            if count < 0:
                return count
            seal = view[base + j * HEADER_BYTES : base + j * HEADER_BYTES + SEAL.size]
            if count != n + HEADER_BYTES:
                good = self.seals.refuse("bad_seal", names[j])
            else:
                tag = own.tags.get(j, b"")
                good = self.seals.check(seal, job.ns, job.keys[i], job.buffers[i], names[j], tag)
            if not good:
                refused.append(entries[i])
            return 0 if good else OBJECT_NOT_FOUND

        # Blocks Mooncake copied are hashed on the promotion threads; the others' tags
        # were taken as they were copied: only compared here.
        codes = (
            self.tier_threads.run(len(part), n, check)
            if rest
            else [check(j) for j in range(len(part))]  # all copied here: only compared
        )
        self.post_refused(refused)
        return [OBJECT_NOT_FOUND if c is None else c for c in codes]

    def _read_own_segment(
        self, client: Any, job: TierJob, names: list[str], part: range, hdr: int
    ) -> OwnSegmentRead:
        """The piece's blocks that lie in this daemon's own segment, copied and checked
        here; the rest is left to Mooncake."""
        span = self._spans.get(id(client))
        if not (self.s.lease_ttl_s > 0 and span is not None):
            self._own_last = False
            return OwnSegmentRead(rest=list(range(len(part))))
        mac, ns, idx = self.seals.mac, job.ns, list(part)

        def copy(j: int, src: int) -> bytes:
            i = idx[j]
            tag: bytes = mac.copy_and_hash(ns, job.keys[i], job.buffers[i], job.addresses[i], src)
            return tag

        own = read_own_segment(
            client,
            names,
            job.ns.block_bytes,
            copy,
            [hdr + j * HEADER_BYTES for j in range(len(part))],
            HEADER_BYTES,
            span,
            self.s.lease_ttl_s,
            start=lambda count, work: self.tier_threads.started(count, ns.block_bytes, work),
        )
        with self._lock:
            self._own_reads_total += len(own.tags)
            self._own_last = 2 * len(own.tags) >= len(part)
        return own

    def _poison(self, client: Any, hold_s: float) -> None:
        """A transfer may still use this client's registrations: keep it alive forever,
        and let the poller connect a fresh one."""
        with self._lock:
            if client is not None and self._client is client:
                self._poisoned.append(client)
                self._client = None
        self.post_unreachable(f"a transfer failed mid-way; reconnecting after {hold_s:g} s")

    # ------------------------------------------------------------ poller thread

    def _connect(self) -> Any:
        s = self.s
        # Mooncake's setup() blocks the whole daemon (it keeps the GIL) while it waits
        # for a master: knock on the master's ports first, from Python, with a timeout.
        for what, where in (("master", s.master), ("metadata server", s.metadata_server)):
            if not reachable(where, s.timeout_s):
                raise ConnectionError(f"{what} {where} does not answer")
        client = self._cls()
        rc = client.setup(
            s.local_hostname,
            s.metadata_server,
            s.segment_bytes,
            s.local_buffer_bytes,
            s.protocol,
            s.device,
            s.master,
        )
        if rc != 0:
            client.close()  # retried every second while the master is away: never leak
            raise ConnectionError(f"setup with master {s.master} failed (code {rc})")
        assert self._region is not None
        for address, nbytes in (
            self._region,
            (int(self._headers.ctypes.data), self._headers.nbytes),
            (int(self._zeros.ctypes.data), self._zeros.nbytes),
        ):
            rc = client.register_buffer(address, nbytes)
            if rc != 0:
                client.close()
                raise ConnectionError(f"cannot register {nbytes} bytes of memory (code {rc})")
        log.info("tier %s: connected to Mooncake master %s (%s)", self.name, s.master, s.protocol)
        self._warm_segment(client)
        return client

    def _warm_segment(self, client: Any) -> None:
        t0 = time.monotonic()
        span = warm_segment(client, self.s.prefix, self.s.segment_bytes, self._zeros)
        if span is not None:
            self._spans[id(client)] = span
        if self.s.segment_bytes:
            log.info(
                "tier %s: wrote the %d MiB segment once in %.1f s%s",
                self.name,
                self.s.segment_bytes >> 20,
                time.monotonic() - t0,
                "" if span else "; its blocks are promoted through Mooncake's own copy",
            )

    def _poll(self) -> None:
        next_full = 0.0
        up = False
        while not self._stop.is_set():
            try:
                if self._client is None:
                    client = self._connect()
                    with self._lock:
                        self._client = client
                rc = self._client.health_check()
                if rc != 0:
                    raise ConnectionError(f"master {self.s.master} unreachable (health {rc})")
                # Back after an outage (a restarted master has lost every object): the
                # view is re-read before the tier answers lookups again.
                if not up or self._want_full.is_set() or time.monotonic() >= next_full:
                    self._want_full.clear()
                    started = time.monotonic()
                    self._full_sync(started)
                    next_full = started + self.s.full_sync_s
                self._check_wanted()
                self.finished.post("health", (True, "", 0))
                up = True
            except Exception as exc:  # never the end of the poller: retried, reported
                up = False
                self.post_unreachable(f"{type(exc).__name__}: {exc}")
                self._want_full.wait(max(self.s.refresh_s, 1.0))
                continue
            self._want_full.wait(self.s.refresh_s)

    def _exist(self, entries: list[Entry]) -> list[Entry]:
        present: list[Entry] = []
        for a in range(0, len(entries), EXIST_BATCH):
            part = entries[a : a + EXIST_BATCH]
            found = self._client.batch_is_exist([self.object_name(e) for e in part])
            if any(f < 0 for f in found):
                raise ConnectionError(f"existence check failed (codes {set(found)})")
            present.extend(e for e, f in zip(part, found) if f == 1)
        return present

    def _check_wanted(self) -> None:
        wanted, self._wanted = self._wanted, {}  # the loop thread starts a fresh one
        if wanted:
            self.post_seen(self._exist(list(wanted)))

    def _full_sync(self, started: float) -> None:
        if self.s.admin_url:
            present, complete = self._all_keys()
        else:  # list() copies the loop thread's view under the GIL, in one step
            present, complete = set(self._exist(list(self._view))), True
        self.post_full(started, present, complete)

    def _all_keys(self) -> tuple[set[Entry], bool]:
        """The objects of our tier ids that the master's admin server lists, within the
        listing's bounds; and whether the listing was read to its end."""
        bound = self.max_view_blocks
        out, complete = read_listing(
            self.s.admin_url, self.s.prefix, self.ours, bound, self.s.timeout_s
        )
        if not complete and not self._listing_cut_logged:
            self._listing_cut_logged = True
            log.warning(
                "tier %s: the store lists more than %d objects, or %d of ours; the view "
                "follows it partly",
                self.name,
                MAX_LISTING_LINES,
                bound,
            )
        return out, complete

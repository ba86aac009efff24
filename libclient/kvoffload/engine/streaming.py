"""A worker that never waits for the daemon per call, and never reports a daemon fault.

vLLM 0.33's offloading worker asserts that every submit returned True and every
result succeeded. This worker keeps that contract whatever happens to the daemon:

- Submits are one-way (queued, written without blocking, results pushed): a submit
  returns True at once. Client-copy workers copy loads in the call itself, and the
  stores submitted since the last report together, with one ``Wrote`` per lease
  (``report_writes``, which every result call and every wait makes unless the
  connection's owner does it for all of its workers); such a store is finished for
  the engine only once its ``Wrote`` is queued.
- A store writes each of its slots whole: every cache, every one of the
  ``block_size_factor`` sub-blocks (a store that would not is dropped at once; the
  daemon refuses one anyway).
- A store that cannot happen finishes *dropped*: its result says ``success=False``
  with ``dropped=True`` (the vLLM adapter reports it finished; the block is simply not
  offloaded, later lookups miss). That covers a daemon that is away, refuses the job,
  or does not finish it by ``store_timeout_s``: the copy carries that deadline and the
  daemon never commits a copy that ends after it, so the engine may reuse its blocks.
  Drops are counted (``stores_dropped_total``); a refusal is logged once per reason.
- A load that was planned completes byte-exact, or this worker raises
  ``LoadLostError`` (never a silent failure). In order: the daemon's copy, which reads
  each key wherever its block is now; if the daemon is away or its copy failed, a copy
  of its own from its mapping of the region (trusted uids), checked against the slot
  records; the key's current slot asked from the daemon; resubmitting on the next
  connection. A load that none of these can complete within ``load_wait_s`` raises
  ``LoadLostError`` naming the case (docs/vllm.md: "What the engine sees when
  kvoffloadd fails").
- Nothing here blocks but ``wait``, which blocks at most until the jobs' deadlines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvoffload.cuda.export import current_stream
from kvoffload.datapath.canonical import CanonicalPart, area_of
from kvoffload.datapath.client_copy import CopyFn, LocalCopies, RegionMapping, SlotChanged
from kvoffload.datapath.memruns import copy_runs
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import (
    DaemonUnavailableError,
    ErrorCode,
    KVOffloadError,
    LoadLostError,
)
from kvoffload.protocol.packing import pack_ids, pack_keys
from kvoffload.worker import TransferResult, Worker

if TYPE_CHECKING:
    from kvoffload.namespace import Namespace

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]


@dataclass
class Job:
    job_id: int
    is_store: bool
    slots: I64
    ids: I64
    skip: int
    caches: list[int]
    keys: list[bytes]  # loads: the key of each slot
    lease: int  # stores: the engine's lease token
    deadline_s: float  # monotonic
    region: RegionMapping | None = None  # the mapping the job was planned against
    started_s: float = field(default_factory=time.perf_counter)
    gone: str = ""  # loads: the daemon found the keys gone


@dataclass(frozen=True)
class StreamResult(TransferResult):
    dropped: bool = False  # a store that did not happen (the block is not offloaded)


class StreamingWorker(Worker):
    push = True
    want_region = True
    ns: Namespace  # loads by key use the namespace's own calls

    def __init__(
        self,
        ns: Namespace,
        caches: Sequence[Any],
        rank: int = 0,
        stream: int | None = None,
        copy_mode: str = "auto",
        store_timeout_s: float = 10.0,
        load_wait_s: float = 10.0,
        canonical: Sequence[CanonicalPart] = (),
        parts: int = 1,
    ) -> None:
        self.store_timeout_s = store_timeout_s
        self.load_wait_s = load_wait_s
        self._jobs: dict[int, Job] = {}  # submitted to the daemon, results pending
        self._stalled: list[Job] = []  # loads waiting for a daemon (or a mapping)
        self._results: list[StreamResult] = []
        self._local: LocalCopies | None = None
        self._fatal: LoadLostError | None = None
        self._wrote: dict[int, list[int]] = {}  # lease -> slots copied, for one Wrote each
        self._unreported: list[StreamResult] = []  # client copies awaiting their Wrote
        self._copies: list[Job] = []  # client-copy stores not copied yet
        self._refusals: set[str] = set()  # reasons already logged
        self.stores_dropped_total = 0
        self.loads_recovered_total = 0  # loads read from the region while the daemon was away
        super().__init__(ns, caches, rank, stream, copy_mode, canonical, parts)

    # ------------------------------------------------------------ registration

    def _adopt(self, state: tuple[m.WorkerAttached, list[int]]) -> None:
        super()._adopt(state)
        self._void_copies()
        self._local = None
        if self._region is not None:
            self._local = self._local_copies(self._region)

    def _local_copies(self, region: RegionMapping) -> LocalCopies:
        copy: CopyFn = copy_runs if self._cuda is None else self._cuda_copy
        return LocalCopies(
            self.ns.layout,
            area_of(self.rank, self.parts),
            self.geometries,
            self.bases,
            self.ns.ns_id,
            self.ns.slot_bytes,
            region,
            copy,
            self.canonical,
        )

    def _cuda_copy(self, dst: I64, src: I64, nbytes: I64) -> None:
        """Copies between the region mapping and GPU caches, done when it returns."""
        api, fence = self._cuda, self._fence
        assert api is not None and fence is not None
        api.set_device(fence.ordinal)
        stream = api.stream_create()
        try:
            for d, s, n in zip(dst.tolist(), src.tolist(), nbytes.tolist()):
                api.memcpy_async(d, s, n, stream)
            event = api.event_create()
            api.event_record(event, stream)
            api.event_synchronize(event)
            api.event_destroy(event)
        finally:
            api.stream_destroy(stream)

    def _void_copies(self) -> None:
        """Client copies under an earlier connection's leases are void there: finished
        for the engine, never committed."""
        self._wrote.clear()
        self._results += self._unreported
        self._unreported = []
        copies, self._copies = self._copies, []
        for job in copies:
            self._drop(job, "kvoffloadd is away")

    def _lost(self) -> None:
        self._void_copies()
        jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            if job.is_store:
                self._drop(job, "kvoffloadd went away during the copy")
            else:
                self._stalled.append(job)

    def _on_push(self, msg: m.Reply) -> None:
        assert isinstance(msg, m.JobsDone)
        for r in msg.results:
            job = self._jobs.pop(r.job_id, None)
            if job is None:
                continue
            if r.success:
                self._results.append(StreamResult(r.job_id, True, r.nbytes, r.seconds))
            elif job.is_store:
                self._drop(job, f"kvoffloadd refused or failed it ({ErrorCode(r.error).name})")
            else:
                if r.error == ErrorCode.NOT_FOUND:
                    job.gone = "kvoffloadd no longer holds its blocks"
                self._stalled.append(job)

    # ------------------------------------------------------------ submits

    def submit_store(
        self,
        job_id: int,
        engine_block_ids: npt.ArrayLike,
        slots: npt.ArrayLike,
        caches: Sequence[int] = (),
        lease: int = 0,
    ) -> bool:
        job = self._job(job_id, True, slots, engine_block_ids, 0, caches, [], lease)
        f = self.ns.layout.block_size_factor
        if job.ids.size != job.slots.size * f or sorted(set(job.caches)) not in (
            [],
            list(range(len(self.caches))),
        ):
            self._drop(job, "it would not write its slots whole (every cache, every sub-block)")
            return True
        if self.copy_mode == "client":
            self._copies.append(job)  # copied with the others at the next report
            return True
        if self._fence is not None:
            ordinal = self._fence.ordinal
            self._fence.record(
                self._stream if self._stream is not None else current_stream(ordinal)
            )
        deadline_ns = int(job.deadline_s * 1e9)
        msg = m.SubmitStore(
            0,
            self.worker_id,
            job_id,
            pack_ids(job.ids),
            pack_ids(job.slots),
            job.caches,
            lease,
            deadline_ns,
        )
        if self.ns.client.post(msg):
            self._jobs[job_id] = job
        else:
            self._drop(job, "kvoffloadd is away")
        return True

    def submit_load(
        self,
        job_id: int,
        slots: npt.ArrayLike,
        engine_block_ids: npt.ArrayLike,
        skip: int = 0,
        caches: Sequence[int] = (),
        keys: Sequence[bytes] = (),
    ) -> bool:
        job = self._job(job_id, False, slots, engine_block_ids, skip, caches, list(keys), 0)
        try:
            if self.copy_mode == "client":
                self._load(job)
            elif not self.ns.client.connected:  # the daemon is away: from the region
                self.loads_recovered_total += 1
                self._load(job)
            else:
                self._submit_load(job)
        except LoadLostError as exc:
            self._fatal = exc  # a submit never raises: the next result call does
        return True

    def _job(
        self,
        job_id: int,
        is_store: bool,
        slots: npt.ArrayLike,
        ids: npt.ArrayLike,
        skip: int,
        caches: Sequence[int],
        keys: list[bytes],
        lease: int,
    ) -> Job:
        wait_s = self.store_timeout_s if is_store else self.load_wait_s
        return Job(
            job_id,
            is_store,
            np.asarray(slots, dtype=np.int64),
            np.asarray(ids, dtype=np.int64),
            skip,
            list(caches),
            keys,
            lease,
            time.monotonic() + wait_s,
            self._region,
        )

    def _submit_load(self, job: Job) -> None:
        kp, kb = pack_keys(job.keys) if job.keys else (b"", 0)
        msg = m.SubmitLoad(
            0,
            self.worker_id,
            job.job_id,
            pack_ids(job.slots),
            pack_ids(job.ids),
            job.skip,
            job.caches,
            kp,
            kb,
            int(job.deadline_s * 1e9),
        )
        if self.ns.client.post(msg):
            self._jobs[job.job_id] = job
            self.ns.client.flush()  # loads start now; stores go with the next flush
        else:
            self._load(job)

    # ------------------------------------------------------------ local copies

    def _store_locally(self) -> None:
        """Copy the stores submitted since the last report: one plan and copy for all
        of one lease's (a job whose slots are no longer leased fails alone)."""
        jobs, self._copies = self._copies, []
        by_lease: dict[int, list[Job]] = {}
        for job in jobs:
            by_lease.setdefault(job.lease, []).append(job)
        for lease, group in by_lease.items():
            if len(group) > 1 and self._copy_stores(lease, group):
                continue
            for job in group:
                self._copy_stores(lease, [job])

    def _copy_stores(self, lease: int, jobs: list[Job]) -> bool:
        """Copy jobs of one lease together; False (nothing copied) if that failed."""
        local = self._local
        if local is None:
            if len(jobs) == 1:
                self._drop(jobs[0], "no mapping of the region to copy into")
            return False
        slots = np.concatenate([j.slots for j in jobs])
        try:
            nbytes = local.store(slots, np.concatenate([j.ids for j in jobs]), [], lease)
        except (SlotChanged, KVOffloadError, OSError) as exc:
            if len(jobs) == 1:
                self._drop(jobs[0], str(exc))
            return False
        self._wrote.setdefault(lease, []).extend(slots.tolist())
        now = time.perf_counter()
        for job in jobs:
            # Finished for the engine only once the daemon is told: an engine that
            # idles after its last store has every copy it made reported.
            share = nbytes * job.slots.size // slots.size
            self._unreported.append(StreamResult(job.job_id, True, share, now - job.started_s))
        return True

    def _load(self, job: Job) -> None:
        """Complete a load without the daemon's copy, or leave it stalled."""
        region = job.region or self._region
        if region is not None and job.keys:
            local = self._local if region is self._region else self._local_copies(region)
            try:
                nbytes = local.load(job.slots, job.ids, job.skip, job.caches, job.keys)  # type: ignore[union-attr]
            except SlotChanged:
                nbytes = self._load_where_now(job)
            if nbytes >= 0:
                seconds = time.perf_counter() - job.started_s
                self._results.append(StreamResult(job.job_id, True, nbytes, seconds))
                return
        if job.gone:
            raise LoadLostError(self._lost_message(job, job.gone))
        if self.ns.client.connected and self.ns.client.epoch and job.keys:
            self._submit_load(job)  # on a (new) connection: the daemon reads by key
            return
        self._stalled.append(job)

    def _load_where_now(self, job: Job) -> int:
        """The keys' current slots from the daemon, copied from there; -1 if unknown."""
        local = self._local
        if local is None:
            return -1
        try:
            plan = self.ns.prepare_load(job.keys)
        except DaemonUnavailableError:
            return -1
        except KVOffloadError as exc:
            raise LoadLostError(self._lost_message(job, f"its blocks are gone ({exc})")) from exc
        try:
            slots = np.asarray(plan.slots, dtype=np.int64)
            return local.load(slots, job.ids, job.skip, job.caches, job.keys)
        except SlotChanged as exc:
            raise LoadLostError(self._lost_message(job, str(exc))) from exc
        finally:
            self.ns.complete_load(job.keys)

    # ------------------------------------------------------------ results

    def _drop(self, job: Job, why: str) -> None:
        self.stores_dropped_total += 1
        if why not in self._refusals and "away" not in why and "deadline" not in why:
            self._refusals.add(why)  # an outage is logged by the client, once
            log.warning(
                "kvoffload: a store to namespace %s was dropped: %s (each reason logged once)",
                self.ns.name,
                why,
            )
        log.debug("store job %d dropped: %s", job.job_id, why)
        self._results.append(StreamResult(job.job_id, False, 0, 0.0, dropped=True))

    def _settle(self) -> None:
        """Deadlines: stores past theirs are dropped; stalled loads retried or lost."""
        if self._fatal is not None:
            raise self._fatal
        now = time.monotonic()
        for job in [j for j in self._jobs.values() if j.is_store and now > j.deadline_s]:
            del self._jobs[job.job_id]
            self._drop(job, "not finished by its deadline")
        stalled, self._stalled = self._stalled, []
        for job in stalled:
            self.loads_recovered_total += 1
            self._load(job)
        for job in self._stalled:
            if now > job.deadline_s:
                raise LoadLostError(
                    self._lost_message(job, f"kvoffloadd stayed away for {self.load_wait_s} s")
                )

    def _lost_message(self, job: Job, why: str) -> str:
        return (
            f"kvoffload: load job {job.job_id} ({job.slots.size} blocks) that vLLM planned "
            f"cannot complete: {why}; the engine stops rather than compute with KV it did "
            "not load"
        )

    @property
    def loads_waiting(self) -> bool:
        """A load is in flight or stalled: its result is read at every call."""
        return bool(self._stalled) or any(not j.is_store for j in self._jobs.values())

    def report_writes(self) -> None:
        """Copy the client-copy stores submitted since the last report, and queue one
        ``Wrote`` per lease (the next write to the daemon takes it); those stores are
        then finished."""
        if self._copies:
            self._store_locally()
        wrote, self._wrote = self._wrote, {}
        for lease, slots in wrote.items():
            self.ns.client.post(m.Wrote(0, self.worker_id, lease, pack_ids(slots)))
        self._results += self._unreported
        self._unreported = []

    def get_finished(self, poll: bool = True) -> list[TransferResult]:
        """Results so far; with ``poll`` (unless the connection's owner reads for all of
        its workers) after reporting client copies and reading the pushes."""
        if poll:
            self.report_writes()
            self.ns.client.poll()
        self._settle()
        out, self._results = self._results, []
        return list(out)

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs finished, at most until their deadlines."""
        wanted = set(job_ids)
        while True:
            self.report_writes()
            self._settle()
            pending = [j for j in [*self._jobs.values(), *self._stalled] if j.job_id in wanted]
            if not pending:
                return
            left = max(j.deadline_s for j in pending) - time.monotonic()
            self.ns.client.poll(timeout_s=max(0.0, min(left, 0.05)))

"""Workers and their copy jobs: registration, validated submission, completions.

Rules:
- Runs on the loop thread only, as part of the service; it owns the attached workers
  and the jobs in flight, and reads the service's namespaces and sessions.
- A transfer is validated completely (slots leased to the namespace in the right
  state, no slot twice, engine block ids inside the registered caches, quotas) before
  any address reaches a copier (invariant 4); then its slots are marked busy so they
  cannot be freed under the copy.
- A store writes each of its slots whole (``check_whole_store``: every registered
  cache, every engine block), so a block never becomes visible over bytes of the
  slot's earlier owner (invariant 12). A canonical part writes only its fragments:
  the slot is written once its parts' fragments cover every page (seals.py); the job
  that completed a slot whose check runs on a copier thread gets its result only
  after it (so a blocking client's ``complete_store`` after ``wait`` finds it
  written).
- What a job holds is charged to its connection (jobs and the copies they expand
  to, ledger.py) until it completes. The loop validates a job and hands over its plan:
  copiers build its runs (a tiny CPU job is copied at once, on the loop).
- A completion updates the index (written ranks, checksums, corrupt blocks), the
  counters and the worker's results, and answers the waits it ends. Push workers
  (engines that never wait for a reply) submit one-way and get their results pushed.
- A store names its engine's lease token: only slots leased to that token may be
  written (invariant 9); a store's copy that ends after its ``deadline_ns`` (when the
  engine may reuse its blocks) or whose worker went away is void: never committed. A
  load that names its keys reads each key wherever its block is now.
- A detached worker (or one whose client died) keeps its mappings until its copies
  have drained; only then are they closed, by a copier thread (unmapping is page-table
  work: never on the loop), and its charges given back once they are (invariant 5).
- Client-copy workers (trusted uids only, see access.py) get the region's descriptor.
  Blocking ones get, per submitted job, the copy runs the daemon validated and end the
  job with ``ClientCopyDone``; push ones plan their copies themselves from the region's
  tables and report stores with ``Wrote``. A client-copy worker that goes away fails
  its open jobs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvoffload.datapath.canonical import check_copy_count
from kvoffload.datapath.copyplan import (
    JobPlan,
    check_transfer,
    check_whole_store,
    has_duplicates,
)
from kvoffload.datapath.runs import JobRuns
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import (
    InvalidArgumentError,
    NotLeasedError,
    PermissionDeniedError,
    QuotaExceededError,
    TimedOutError,
)
from kvoffload.protocol.messages import pack_ids, unpack_ids, unpack_keys
from kvoffloadd.access import AccessPolicy
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import ChecksumCheck, Completion, CpuCopier, finished
from kvoffloadd.copies.fdcopy import FdCopier, is_descriptor
from kvoffloadd.copies.gpu import GpuRuntime
from kvoffloadd.copies.seals import Sealer
from kvoffloadd.copies.workers import (
    AttachedWorker,
    ClientJob,
)
from kvoffloadd.index.index import NamespaceIndex
from kvoffloadd.ledger import Ledger
from kvoffloadd.region.region import SharedOffloadRegion
from kvoffloadd.service.attach import Attacher
from kvoffloadd.service.session import Session

log = logging.getLogger(__name__)


SUM_JOB = -1  # a _Job's worker id when it only takes checksums of whole canonical slots


@dataclass
class _Job:
    worker_id: int
    job_id: int
    ns_id: int
    slots: np.ndarray
    is_store: bool
    deadline_ns: int = 0
    copies: int = 0  # charged to its connection until it completes


class Transfers:
    def __init__(
        self,
        config: DaemonConfig,
        region: SharedOffloadRegion,
        copier: CpuCopier,
        gpu: GpuRuntime | None,
        gpu_unavailable: str,
        namespaces: dict[int, NamespaceIndex],
        sessions: dict[int, Session],
        count_error: Callable[[str], None],
        access: AccessPolicy,
        ledger: Ledger,
    ) -> None:
        self.config = config
        self.region = region
        self._region_addr = int(region.buffer.ctypes.data)  # numpy's .ctypes is slow
        self.copier = copier
        self.gpu = gpu
        self.gpu_unavailable = gpu_unavailable
        self.namespaces = namespaces
        self.sessions = sessions
        self._count_error = count_error
        self.access = access
        self.ledger = ledger
        # copy jobs in flight (and results not yet taken), the copies they expand to
        self.jobs, self.copies = ledger["jobs"], ledger["copies"]
        self.workers: dict[int, AttachedWorker] = {}
        self.fd_copier: FdCopier | None = None  # started by the first memfd_io job
        self._jobs: dict[int, _Job] = {}
        self._tokens = itertools.count(1)
        self._unmapping: dict[int, tuple[int, dict[str, int]]] = {}  # token -> its charges
        self.bytes_stored = self.bytes_loaded = 0
        self.jobs_failed = 0
        self.store_seconds = self.load_seconds = 0.0
        # Engine pages planned and the copy runs they merged into: pages / runs is the
        # mean run length (contiguous engine blocks into contiguous slots merge).
        self.pages_planned = self.runs_planned = 0
        self.sealer = Sealer(copier, self._tokens, namespaces, self._sum_whole)
        self.attacher = Attacher(
            ledger, copier, gpu, gpu_unavailable, access, region, namespaces, sessions,
            self._tokens, self._add, self._close_off_loop,
        )  # fmt: skip

    @property
    def inflight_jobs(self) -> int:
        return len(self._jobs) + self.sealer.pending + self.attacher.importing

    def worker(self, s: Session, worker_id: int) -> AttachedWorker:
        w = self.workers.get(worker_id)
        if w is None or w.session_id != s.session_id or w.closing:
            raise InvalidArgumentError(f"worker {worker_id} is not attached on this connection")
        return w

    def attach(self, s: Session, r: m.AttachWorker) -> m.Reply | None:
        return self.attacher.attach(s, r)

    def _add(self, s: Session, w: AttachedWorker) -> None:
        self.workers[w.worker_id] = w
        s.workers.add(w.worker_id)
        self.sealer.add(w.worker_id, w.placements)

    def submit(
        self,
        s: Session,
        r: m.SubmitStore | m.SubmitLoad,
        slots: np.ndarray,
        block_ids: np.ndarray,
        skip: int,
        is_store: bool,
    ) -> m.Reply | None:
        """Validate and start one job; the reply for a blocking submit, None for a
        one-way one (its result is pushed)."""
        w = self.worker(s, r.worker)
        index = self.namespaces[w.ns_id]
        if r.job_id in w.active_jobs:
            raise InvalidArgumentError(f"job {r.job_id} is already in flight")
        if not self.jobs.room(s.session_id):
            raise QuotaExceededError(
                f"this client has {self.jobs.held(s.session_id)} jobs in flight or "
                f"finished and not taken; one more would pass {self.jobs.over(s.session_id, 1)} "
                "(take results with get_finished; limits.jobs in the daemon config)"
            )
        if has_duplicates(slots):
            raise InvalidArgumentError("a transfer names the same slot twice")
        if not index.slots.is_valid(slots):
            raise_not_leased(index, slots)
        if isinstance(r, m.SubmitStore):
            if w.ns_id not in s.writable:
                raise PermissionDeniedError(
                    f"uid {s.uid} may read namespace {index.name!r} but not store into it"
                )
            index.check_store_slots(slots, s.session_id, r.lease)
        elif r.keys:
            keys = unpack_keys(r.keys, r.key_bytes)
            if len(keys) != slots.size:
                raise InvalidArgumentError(f"{len(keys)} keys for {slots.size} slots")
            slots = np.asarray(index.resolve_load(keys, slots.tolist()), dtype=np.int64)
            if has_duplicates(slots):
                raise InvalidArgumentError("a load names the same key twice")
        else:
            index.check_load_slots(slots)
        if r.deadline_ns and time.monotonic_ns() > r.deadline_ns:
            raise TimedOutError(f"job {r.job_id} arrived after its deadline; not started")
        chosen = w.chosen(r.caches)
        caches = chosen.caches
        if is_store:
            check_whole_store(index.layout, len(w.caches), len(caches), slots.size, block_ids.size)
        check_transfer(index.layout, slots.size, block_ids, skip, chosen.geometries)
        check_copy_count(block_ids.size, chosen.placements)
        plan = JobPlan(
            index.layout,
            w.area,
            index.slots.region_offsets(slots),
            block_ids,
            skip,
            chosen.geometries,
            chosen.placements,
            slots if is_store else None,
            self._region_addr,
            chosen.bases,
        )
        if not self.copies.take(s.session_id, plan.copies):
            raise QuotaExceededError(
                f"this job expands to {plan.copies} copies; with the "
                f"{self.copies.held(s.session_id)} this client has in flight that passes "
                "what one client, its uid or all clients may have; wait for some jobs"
            )
        self.pages_planned += block_ids.size * len(caches)
        token = next(self._tokens)
        self._jobs[token] = _Job(
            r.worker, r.job_id, w.ns_id, slots.copy(), is_store, r.deadline_ns, plan.copies
        )
        index.slots.mark_busy(slots, is_store)
        w.active_jobs.add(r.job_id)
        self.jobs.add(s.session_id, 1)
        # Parts of one canonical slot land from several ranks: no rank's copy sees the
        # whole page, so its checksum is taken once every part has landed (_sum_whole).
        check = (
            None
            if is_store and w.parts > 1
            else self._checksum_check(index, w.area, slots, is_store)
        )
        if w.client_copy:  # a trusted peer: its runs are built here
            runs = plan.runs()
            self.runs_planned += runs.region.size
            return self._client_plan(w, r, token, runs, chosen.indices, check)
        if w.device is not None and self.gpu is not None:
            self.gpu.submit(w.device, token, plan, w.store_event, check)
        elif caches and is_descriptor(caches[0]):  # unsealable memfds: never mapped
            fdc = self.fd_copier = self.fd_copier or FdCopier(
                self.config.copy_threads, self.copier.sink, self.region.open_fd(), self._region_addr
            )
            fdc.submit_planned(token, plan, caches, r.deadline_ns, check)  # type: ignore[arg-type]
        else:  # built by the copier threads, a piece at a time
            self.copier.submit_planned(token, plan, check)
        return m.OkReply(r.rid) if r.rid else None

    def _client_plan(
        self,
        w: AttachedWorker,
        r: m.SubmitStore | m.SubmitLoad,
        token: int,
        runs: JobRuns,
        chosen: list[int],
        check: ChecksumCheck | None,
    ) -> m.Reply:
        """The runs a client-copy worker copies itself; a load whose blocks fail their
        checksum gets no runs and fails when the client reports it done."""
        corrupt = check.mismatches() if check is not None and check.expected else []
        w.client_jobs[r.job_id] = ClientJob(
            token, runs.total_bytes, time.perf_counter(), check, corrupt
        )
        if corrupt:
            empty = b""
            return m.CopyPlanReply(r.rid, empty, empty, empty, empty)
        which = np.array(chosen, dtype=np.int64)[runs.which]
        return m.CopyPlanReply(
            r.rid,
            pack_ids(runs.region),
            pack_ids(runs.cache),
            pack_ids(runs.nbytes),
            pack_ids(which),
        )

    def wrote(self, s: Session, r: m.Wrote) -> None:
        """A push client-copy worker copied a store into its engine's leased slots."""
        w = self.worker(s, r.worker)
        index = self.namespaces[w.ns_id]
        if w.ns_id not in s.writable:
            raise PermissionDeniedError(
                f"uid {s.uid} may read namespace {index.name!r} but not store into it"
            )
        slots = unpack_ids(r.slots)
        if not index.slots.is_valid(slots):
            raise_not_leased(index, slots)
        index.check_store_slots(slots, s.session_id, r.lease)
        if r.success:
            self._written(index, w, slots.tolist())
        else:
            index.void(slots.tolist())

    def _written(self, index: NamespaceIndex, w: AttachedWorker, slots: list[int]) -> int:
        """A store copy of ``w`` into ``slots`` landed; returns the token of the seal
        its canonical slots wait for (0: none)."""
        if not self.sealer.is_canonical(w.worker_id):
            index.mark_written(slots, w.area)
            return 0
        return self.sealer.parts_landed(index, slots, w.rank, w.parts, w.worker_id)

    def client_copy_done(self, s: Session, r: m.ClientCopyDone) -> None:
        """A client-copy worker finished a job: complete it like a daemon copy."""
        w = self.worker(s, r.worker)
        job = w.client_jobs.pop(r.job_id, None)
        if job is None:
            raise InvalidArgumentError(f"job {r.job_id} is not a client copy in flight")
        self._post_client_done(job, r.success)

    def _post_client_done(self, job: ClientJob, ok: bool) -> None:
        check = job.check if job.check is not None and job.check.expected is None else None
        done = finished(job.token, ok, job.nbytes, job.started_s, check, job.corrupt)
        self.copier.sink.post(done)

    def _checksum_check(
        self, index: NamespaceIndex, rank: int, slots: np.ndarray, is_store: bool
    ) -> ChecksumCheck | None:
        if not self.config.verify_checksums:
            return None
        rank_bytes = index.layout.rank_bytes
        base = self._region_addr + rank * rank_bytes
        areas = (index.slots.region_offsets(slots) + base).tolist()
        expected = None if is_store else index.sums.expected(slots.tolist(), rank)
        return ChecksumCheck(areas, rank_bytes, expected)

    def on_completions(self, done: list[Completion]) -> list[tuple[int, m.Reply]]:
        """Apply finished copies; returns deferred replies and pushed results as
        (session id, message)."""
        replies: list[tuple[int, m.Reply]] = []
        pushed: dict[int, list[m.JobResult]] = {}
        now_ns = time.monotonic_ns()
        for c in done:
            if self.attacher.is_import(c.token):
                replies.extend(self.attacher.imported(c))
                continue
            if (unmapped := self._unmapping.pop(c.token, None)) is not None:
                self.ledger.give(*unmapped)  # a no-op once its connection left
                continue
            if self.sealer.is_seal(c.token):
                for held_job, held in self.sealer.sealed(c):
                    self._finish_job(held_job, held, replies, pushed)
                continue
            job = self._jobs.pop(c.token)
            if job.worker_id == SUM_JOB:
                if (summed := self.namespaces.get(job.ns_id)) is not None:
                    self._summed(summed, job, c)
                continue
            index = self.namespaces[job.ns_id]
            index.slots.unmark_busy(job.slots, job.is_store)
            w = self.workers[job.worker_id]
            seal = 0
            if job.is_store:
                # A copy that ended after the engine may reuse its blocks, or whose
                # worker went away, may have read reused memory: never commit it.
                late = bool(job.deadline_ns) and now_ns > job.deadline_ns
                if c.success and not late and not w.closing:
                    if c.checksums is not None:
                        index.sums.set(job.slots.tolist(), w.area, c.checksums)
                    seal = self._written(index, w, job.slots.tolist())
                else:
                    index.void(job.slots.tolist())
            if c.corrupt:
                bad = index.mark_corrupt([int(job.slots[i]) for i in c.corrupt])
                self._count_error("CHECKSUM_MISMATCH")
                log.error(
                    "namespace %s: %d blocks failed their checksum on load and are evicted",
                    index.name,
                    len(bad),
                )
            if seal:  # its result waits for the check of what the slots' parts covered
                self.sealer.hold(seal, (job, c))
            else:
                self._finish_job(job, c, replies, pushed)
        for wid, results in pushed.items():
            replies.append((self.workers[wid].session_id, m.JobsDone(0, wid, results)))
        return replies

    def _finish_job(
        self,
        job: _Job,
        c: Completion,
        replies: list[tuple[int, m.Reply]],
        pushed: dict[int, list[m.JobResult]],
    ) -> None:
        """A job is over: count it, hand out its result, end the waits on it, and
        unmap a closing worker's caches after its last job."""
        w = self.workers[job.worker_id]
        w.active_jobs.discard(job.job_id)
        self.copies.give(w.session_id, job.copies)
        self.runs_planned += c.runs
        self._account(w, job, c)
        if w.push or w.closing:  # else its result holds the job's charge until taken
            self.jobs.give(w.session_id, 1)
        if w.closing:
            if not w.active_jobs:
                self._unmap(w)
                if w.session_id in self.sessions:
                    replies.extend((w.session_id, m.OkReply(r)) for r in w.detach_rids)
            return
        result = m.JobResult(job.job_id, c.success, c.nbytes, c.seconds)
        if w.push:
            pushed.setdefault(w.worker_id, []).append(result)
        else:
            w.finished.append(result)
        replies.extend(self._resolve_waits(w, job.job_id))

    def _sum_whole(self, index: NamespaceIndex, slots: list[int]) -> None:
        """Canonical slots whose parts all landed: their checksum is taken now, by a
        copier thread (no rank's copy saw the whole page)."""
        if not slots or not self.config.verify_checksums:
            return
        arr = np.asarray(slots, dtype=np.int64)
        check = self._checksum_check(index, 0, arr, True)
        token = next(self._tokens)
        self._jobs[token] = _Job(SUM_JOB, 0, index.ns_id, arr, True)
        index.slots.mark_busy(arr)  # not reused while it is read
        empty = np.zeros(0, dtype=np.int64)
        self.copier.submit(token, empty, empty, empty, check)

    def _summed(self, index: NamespaceIndex, job: _Job, c: Completion) -> None:
        """A canonical slot's checksum, kept unless its block went meanwhile."""
        slots = job.slots.tolist()
        if c.success and c.checksums is not None:
            keep = [i for i, slot in enumerate(slots) if index.holds_ready(slot)]
            index.sums.set([slots[i] for i in keep], 0, [c.checksums[i] for i in keep])
        index.slots.unmark_busy(job.slots)

    def _account(self, w: AttachedWorker, job: _Job, c: Completion) -> None:
        if not c.success:
            self.jobs_failed += 1
            return
        s = self.sessions.get(w.session_id)
        if job.is_store:
            self.bytes_stored += c.nbytes
            self.store_seconds += c.seconds
            if s is not None:
                s.bytes_stored += c.nbytes
        else:
            self.bytes_loaded += c.nbytes
            self.load_seconds += c.seconds
            if s is not None:
                s.bytes_loaded += c.nbytes

    def _resolve_waits(self, w: AttachedWorker, job_id: int) -> list[tuple[int, m.Reply]]:
        s = self.sessions.get(w.session_id)
        if s is None:
            return []
        out: list[tuple[int, m.Reply]] = []
        for wait in list(s.waits):
            rid, wid, pending = wait
            if wid == w.worker_id:
                pending.discard(job_id)
                if not pending:
                    s.waits.remove(wait)
                    self.ledger.give(s.session_id, {"waits": 1})
                    out.append((s.session_id, m.OkReply(rid)))
        return out

    def take_results(self, w: AttachedWorker) -> list[m.JobResult]:
        """The worker's finished results, handed to its client: their charge goes."""
        results, w.finished = w.finished, []
        self.jobs.give(w.session_id, len(results))
        return results

    def detach(self, w: AttachedWorker) -> None:
        w.closing = True
        self.take_results(w)  # nobody will take them now
        for job in w.client_jobs.values():  # nobody will finish these copies now
            self._post_client_done(job, False)
        w.client_jobs.clear()
        s = self.sessions.get(w.session_id)
        if s is not None:
            s.workers.discard(w.worker_id)
            for wait in [x for x in s.waits if x[1] == w.worker_id]:
                s.waits.remove(wait)
                self.ledger.give(s.session_id, {"waits": 1})
        if not w.active_jobs:
            self._unmap(w)

    def _unmap(self, w: AttachedWorker) -> None:
        """Forget a worker whose copies drained; a copier thread unmaps its caches and
        closes its imports (unmapping what copies touched costs page-table work in
        proportion: never on the loop), and its charges go once that is done."""
        del self.workers[w.worker_id]
        self.sealer.remove(w.worker_id)
        self._close_off_loop(w.session_id, w.charges, w.close)

    def _close_off_loop(
        self, session_id: int, charges: dict[str, int], close: Callable[[], None]
    ) -> None:
        """Run ``close`` (unmapping, closing imports) on a copier thread; ``charges`` go
        back to the connection once it has run."""
        token = next(self._tokens)
        self._unmapping[token] = (session_id, charges)
        self.copier.run_task(token, close)


def raise_not_leased(index: NamespaceIndex, slots: np.ndarray) -> None:
    bad = [int(x) for x in slots if not 0 <= x < index.slots.capacity][:1]
    raise NotLeasedError(f"slot {bad[0] if bad else '?'} of namespace {index.name!r} is not leased")
